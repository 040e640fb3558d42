#!/bin/bash
# parent under tone then child under tone in one daemon (prefix cells reused in memory, no disk state)
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/wi
rm -rf $W; mkdir -p $W
NRVNA_WORKERS=1 nice -n 10 $P daemon models/SmolLM2-135M-Instruct.Q4_1.gguf $W --lora tone=/tmp/h61/tone.gguf > $W.log 2>&1 & echo $! > $W.pid
for i in $(seq 60); do grep -q "Server started" $W.log && break; sleep 0.5; done
$P submit $W "Write three sentences about the sea and its waves, slowly and carefully." --max-tokens 40 --temperature 0 --model tone --wait >/dev/null; parent=$(ls $W/output | tail -1)
echo "in-process [tone] $($P submit $W "And now about the sky." --parent $parent --max-tokens 16 --temperature 0 --model tone --wait 2>&1)"
grep -i "prefix\|shared\|reused" $W.log | tail -2 | cut -c1-200
kill $(cat $W.pid)
