#!/usr/bin/env bash
# Set up from scratch and run the main job: a local demo (master + peers training, one killed, one joining).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pccl demo "$@"
