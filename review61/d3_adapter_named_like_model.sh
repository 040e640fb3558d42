#!/bin/bash
# D3: an adapter whose name is the model's name (or an alias) takes over: --model MODEL_STEM runs under it.
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/d3
review61/start_daemon.sh $W --lora SmolLM2-135M-Instruct.Q4_1=/tmp/h61/tone.gguf
for m in SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.Q4_1; do
  echo "model=[$m] -> $($P submit $W "Tell me a story about a cat." --max-tokens 12 --temperature 0 --model $m --wait 2>/dev/null)"; done
kill $(cat $W.pid)
