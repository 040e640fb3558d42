#!/bin/sh
# nrvna daemon --on-done examples/notify.sh: run once (at least) for every job that ends.
# $1 is the job's directory; NRVNA_JOB_ID, NRVNA_STATUS, NRVNA_CODE, NRVNA_TAG are set.
echo "$NRVNA_JOB_ID $NRVNA_STATUS ${NRVNA_CODE:--} ${NRVNA_TAG:--} $1" >> "$NRVNA_WORKSPACE/../ends.log"
