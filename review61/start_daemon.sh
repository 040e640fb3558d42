#!/bin/bash
# usage: start_daemon.sh WS [daemon args]: a 1-worker daemon on the test model in the background; pid in WS.pid
cd /work/wt/h61
WS=$1; shift
rm -rf $WS; mkdir -p $WS
NRVNA_WORKERS=1 nice -n 10 .venv/bin/python nrvna.py daemon models/SmolLM2-135M-Instruct.Q4_1.gguf $WS "$@" > $WS.log 2>&1 &
echo $! > $WS.pid
for i in $(seq 60); do grep -q "Server started" $WS.log && break; sleep 0.5; done
