#!/bin/bash
# A conversation's parent under adapter tone, its saved state on disk; after a restart, children under
# base / tone / zero, each compared with the same child run with an empty state cache.
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/wr
start() { NRVNA_WORKERS=1 NRVNA_CACHE_DIR=$1 NRVNA_CACHE_MIN_TOKENS=16 nice -n 10 $P daemon models/SmolLM2-135M-Instruct.Q4_1.gguf $W --lora tone=/tmp/h61/tone.gguf --lora zero=/tmp/h61/zero.gguf >> $W.log 2>&1 & echo $! > $W.pid; for i in $(seq 60); do grep -q "Server started" $W.log && break; sleep 0.5; done; }
stopd() { kill $(cat $W.pid); wait $(cat $W.pid) 2>/dev/null; sleep 1; : > $W.log; }
rm -rf $W /tmp/h61/cacheA /tmp/h61/cacheB; mkdir -p $W
start /tmp/h61/cacheA
parent=$($P submit $W "Write three sentences about the sea and its waves, slowly and carefully." --max-tokens 40 --temperature 0 --model tone --wait >/dev/null; ls $W/output | tail -1)
echo parent=$parent; stopd; ls /tmp/h61/cacheA | head
for run in A B; do
  start /tmp/h61/cache$run
  for m in "" tone zero; do a=(); [ -n "$m" ] && a=(--model $m)
    echo "$run [$m] $($P submit $W "And now about the sky." --parent $parent --max-tokens 16 --temperature 0 "${a[@]}" --wait 2>&1 | tr '\n' ' ')"; done
  grep -i "restor\|saved state" $W.log | head -3 | cut -c1-200; stopd
done
