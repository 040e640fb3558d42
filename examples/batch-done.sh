#!/bin/sh
# nrvna daemon --on-batch-done examples/batch-done.sh: run once every job of a tag has ended.
# $1 is the tag; NRVNA_JOBS, NRVNA_DONE, NRVNA_FAILED count its jobs.
echo "tag $1: $NRVNA_DONE of $NRVNA_JOBS done, $NRVNA_FAILED failed" >> "$NRVNA_WORKSPACE/../batches.log"
