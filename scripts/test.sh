#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it: install what is missing, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest test_nrvna.py -v "$@"
