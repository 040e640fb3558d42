#!/bin/bash
# D5 probe: 2 workers, both full of tone jobs; a priority job of another set (base) is queued that
# neither context may take until it drains. Does every full worker's _admit (top_priority is over
# all sets) keep preempting/pausing the other (_outranked, set_top) for a job it cannot take?
# Compare the tone jobs' wall time with and without that queued job ($1 = with|without).
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/d5$1
rm -rf $W; mkdir -p $W
NRVNA_WORKERS=2 NRVNA_SEQS=2 nice -n 10 $P daemon models/SmolLM2-135M-Instruct.Q4_1.gguf $W --lora tone=/tmp/h61/tone.gguf > $W.log 2>&1 & echo $! > $W.pid
for i in $(seq 60); do grep -q "Server started" $W.log && break; sleep 0.5; done
ids=""; for i in 1 2 3 4; do ids="$ids $($P submit $W "Count from one to a hundred in words: $i" --max-tokens 150 --temperature 0 --ignore-eos --model tone)"; done
sleep 3
[ "$1" = with ] && pid=$($P submit $W "hi" --max-tokens 2 --priority 10)
t0=$(date +%s.%N); $P wait $W $ids > /dev/null; t1=$(date +%s.%N)
echo "$1: tone jobs done $(echo "$t1 - $t0" | bc) s after the priority job's submit"; [ -n "$pid" ] && $P wait $W $pid >/dev/null && echo "priority job: $($P status $W $pid)"
grep -ci "preempt\|paus" $W.log
kill $(cat $W.pid)
