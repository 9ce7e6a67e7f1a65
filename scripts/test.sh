#!/usr/bin/env bash
# Set up from scratch, lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check pccl tests benchmarks examples
mypy pccl
python -m pytest -q "$@"
