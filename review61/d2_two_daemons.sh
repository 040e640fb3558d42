#!/bin/bash
# D2: two daemons on one workspace, A with adapter tone, B (another model file) without. Jobs naming the
# adapter as their model (tone, or MODEL:tone with MODEL outside B's models folder) are run by B on
# its base model: done, exit 0, the base's text. (--lora tone waits for A, as it should.)
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/d2
mkdir -p /tmp/h61/m2; [ -f /tmp/h61/m2/copy.gguf ] || cp models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/h61/m2/copy.gguf
review61/start_daemon.sh $W --lora tone=/tmp/h61/tone.gguf
NRVNA_WORKERS=1 nice -n 10 $P daemon /tmp/h61/m2/copy.gguf $W > $W.b.log 2>&1 & echo $! > $W.b.pid
for i in $(seq 60); do grep -q "Server started" $W.b.log && break; sleep 0.5; done
ids=""; for m in tone tone tone tone tone tone copy:tone copy:tone; do ids="$ids $($P submit $W "Tell me a story about a cat." --max-tokens 12 --temperature 0 --model $m 2>/dev/null)"; done
$P wait $W $ids > /dev/null
for j in $ids; do echo "$j $(cat $W/output/$j/result.txt) (ran by $(grep -l "Processing job: $j" $W.log $W.b.log))"; done
echo "(tone's text: 'The cat. She was a majestic creature...'; base: 'There was a time when...')"
kill $(cat $W.pid) $(cat $W.b.pid)
