#!/usr/bin/env bash
# Create .venv (if missing) and install pccl with its test/dev/examples extras and the CPU build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch that lies on this machine's disk (a plain "torch" may pull a multi-GB CUDA build).
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,dev,examples]"
