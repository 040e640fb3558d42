#!/bin/bash
# the test adapters every repro here uses, in /tmp/h61
cd /work/wt/h61; mkdir -p /tmp/h61; M=models/SmolLM2-135M-Instruct.Q4_1.gguf
.venv/bin/python scripts/lora_model.py adapter $M /tmp/h61/tone.gguf --kind delta --seed 61
.venv/bin/python scripts/lora_model.py adapter $M /tmp/h61/zero.gguf --kind zero
.venv/bin/python scripts/lora_model.py adapter $M /tmp/h61/other.gguf --kind delta --seed 7 --base-name "Llama-3 8B"
head -c 70000 /tmp/h61/tone.gguf > /tmp/h61/torn.gguf   # header whole (general.type adapter), tensors cut
