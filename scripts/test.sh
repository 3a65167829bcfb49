#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, lint and format checks included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium for the dashboard's browser tests (tests/api/test_dashboard.py)
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "test: install Debian's chromium and chromium-driver for the browser tests" >&2
  fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# types: pyproject.toml's [tool.mypy] says what is checked and how strictly
.venv/bin/python -m mypy
# a test process per two cores, at most 4 (tests/conftest.py: [Note: parallel tests]):
# on 2 cores one process (two were measured no faster there: pytest 2,110 s against 2,127 s
# on 2026-11-29, the engine's CPU tests 4x slower beside the Ray tests, and a fuzzed
# completion timed out); PSTAR_TEST_WORKERS=N sets it
workers=${PSTAR_TEST_WORKERS:-$(( $(nproc 2>/dev/null || echo 2) / 2 ))}
[ "$workers" -gt 4 ] && workers=4
if [ "$workers" -gt 1 ]; then
  .venv/bin/python -m pytest -q -n "$workers" "$@"
else
  .venv/bin/python -m pytest -q "$@"
fi
