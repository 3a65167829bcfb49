#!/usr/bin/env bash
# The benchmarks' peers, on top of scripts/setup.sh: DeepSpeed (ZeRO-3 with CPU offload)
# for `pstar bench scale` and `pstar bench zero`. Not part of the main set-up: the engine
# and the service never need it. torch stays the pinned CPU build installed by setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install -q -e ".[bench]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import deepspeed, torch; print('setup-bench: deepspeed', deepspeed.__version__, 'torch', torch.__version__)"
