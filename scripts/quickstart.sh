#!/usr/bin/env bash
# Install, then run one real job end to end on SmolLM2-135M: queue a prompt, let a daemon
# drain the queue, print the generated text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ws=$(mktemp -d)/ws
id=$(.venv/bin/python nrvna.py submit "$ws" "What is a job queue? Answer in two sentences." --max-tokens 80)
echo "queued $id in $ws" >&2
NRVNA_LOG_LEVEL=warn .venv/bin/python nrvna.py daemon models/SmolLM2-135M-Instruct.Q4_1.gguf "$ws" -w 2 --drain
.venv/bin/python nrvna.py get "$ws" "$id"
echo
