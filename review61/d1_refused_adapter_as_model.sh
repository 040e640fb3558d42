#!/bin/bash
# D1: an adapter the model refused (torn tensors; or another stated base), named as the job's model,
# runs the job on the BASE model, done, exit 0. Its lora-list form fails (unsupported), as documented.
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/d1
review61/start_daemon.sh $W --lora tone=/tmp/h61/tone.gguf --lora torn=/tmp/h61/torn.gguf --lora other=/tmp/h61/other.gguf
for m in "" tone torn other; do a=(); [ -n "$m" ] && a=(--model $m)
  echo "model=[$m] -> $($P submit $W "Tell me a story about a cat." --max-tokens 12 --temperature 0 "${a[@]}" --wait 2>/dev/null) rc=$?"; done
echo "lora torn -> $($P submit $W "Tell me a story about a cat." --max-tokens 12 --temperature 0 --lora torn --wait 2>&1 | tail -1 | cut -c1-120)"
kill $(cat $W.pid)
