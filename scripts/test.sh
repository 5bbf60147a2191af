#!/usr/bin/env bash
# Set up and run the test suite (CPU, tiny models + the real SmolLM2 end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "dflash==0.1.0"   # the reference implementation, a test oracle
python -m ruff check dflash_robot tests
python -m pytest -q "$@"
