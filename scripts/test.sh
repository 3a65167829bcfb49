#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, lint and format checks included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
