#!/usr/bin/env bash
# Set up from scratch, lint and type-check the whole tree, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check pccl tests benchmarks examples
mypy  # pccl, tests, benchmarks and examples (pyproject.toml [tool.mypy] files)
python -m pytest -q "$@"
