#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it: install what is missing, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -rP: the crash-point and fault matrices print what they covered; show it in the log
exec .venv/bin/python -m pytest test_nrvna.py -v -rP "$@"
