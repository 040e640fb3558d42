#!/usr/bin/env bash
# Install, then run one real job end to end on SmolLM2-135M: queue a prompt, let a daemon
# drain the queue, print the generated text. The workspace is NRVNA_QUICKSTART_WS, or a new
# temporary directory; its path is printed, and it is kept so the next commands can use it.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -n "${NRVNA_QUICKSTART_WS:-}" ]; then
  ws=$NRVNA_QUICKSTART_WS
  case $ws in /*) ;; *) ws=$caller/$ws ;; esac  # relative to where you ran this, not the repo
  remove=$ws
else
  remove=$(mktemp -d)
  ws=$remove/ws
fi
echo "workspace: $ws (remove it when done: rm -rf $(printf %q "$remove"))" >&2
id=$(.venv/bin/python nrvna.py submit "$ws" "What is a job queue? Answer in two sentences." --max-tokens 80)
echo "queued $id in $ws" >&2
NRVNA_LOG_LEVEL=warn .venv/bin/python nrvna.py daemon "$MODEL" "$ws" -w 2 --drain
.venv/bin/python nrvna.py get "$ws" "$id"
echo
echo "(SmolLM2-135M is a tiny test model: the pipeline works, but its answers are often wrong; use a real model for real answers: docs/models.md)" >&2
# The next commands, exactly as they can be pasted (paths quoted where they need it).
q_ws=$(printf %q "$ws")
{
  echo
  echo "Next: activate the environment that holds llama-cpp-python and the nrvna command, then use the same workspace:"
  echo
  [ "$caller" = "$PWD" ] || echo "  cd $(printf %q "$PWD")"
  echo "  source .venv/bin/activate"
  echo "  nrvna daemon $MODEL $q_ws &"
  echo "  nrvna submit $q_ws \"Name three rivers.\" --wait"
  echo "  nrvna stop $q_ws"
} >&2
