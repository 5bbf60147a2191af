"""What training's stored features cost, and how far each way of computing them is from the
features the runtime feeds the draft.

Usage: python scripts/profile_features.py [--data data/smollm2-selfdistill] [--shard 2020] [--limit 16]
                                          [--threads 2]

For the first `--limit` samples of one shard of the default target's data, each engine computes the
tapped features of every sample (one forward per sample, as `training.run.ensure_features` does),
timed after one untimed warm-up sample:

- "runtime": `runtime.api.runtime_target_adapter`, what `ensure_features` uses since session 44
  (for the embedded default: the lean engine on the GGUF's Q4_1 blocks) and what decoding runs;
- "hf-fp32": the transformers forward in fp32 with packed linears (`ensure_features` before);
- "hf-bf16": the transformers forward with bf16 weights (how `dflash-robot data` computes the
  features it stores while generating, there batched).

Prints one JSON line per engine: seconds, tokens/s, and the per-tap cosine of its features to the
runtime's (minimum over tokens and mean).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.runtime.api import DEFAULT_DRAFT, runtime_target_adapter
from dflash_robot.targets.fastpath import pack_linears
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training.data import Shard
from dflash_robot.training.trainer import target_features


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--shard", type=int, default=2020)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.limit < 2:
        ap.error("--limit must be >= 2 (one sample warms up)")
    path = Path(args.data) / f"shard-{args.shard:05d}.npz"
    if not path.is_file():
        ap.error(f"{path} does not exist")
    torch.set_num_threads(args.threads)
    taps = load_draft(DEFAULT_DRAFT).metadata.target_layer_ids
    shard = Shard.load(path)
    seqs = [shard.sample(i)[0] for i in range(min(args.limit, len(shard)))]
    model, _ = load_target_model(default_target_path())
    pack_linears(model)  # as `train` does before it builds the runtime adapter from the same model
    runtime = runtime_target_adapter(model, str(default_target_path()))
    model16, _ = load_target_model(default_target_path(), dtype="bfloat16")
    engines = {
        "runtime": lambda s: runtime.prefill(s, taps, 512).features,
        "hf-fp32": lambda s: target_features(model, s, taps),
        "hf-bf16": lambda s: target_features(model16, s, taps),
    }
    ref: list[torch.Tensor] = []
    for name, fn in engines.items():
        fn(seqs[0])
        start = time.perf_counter()
        feats = [fn(s).float() for s in seqs[1:]]
        secs = time.perf_counter() - start
        ref = ref or feats
        cos = torch.cat([torch.nn.functional.cosine_similarity(f.view(f.shape[0], len(taps), -1),
                                                               r.view(r.shape[0], len(taps), -1), dim=-1)
                         for f, r in zip(feats, ref, strict=True)])
        tokens = sum(len(s) for s in seqs[1:])
        print(json.dumps({"engine": name, "samples": len(feats), "tokens": tokens, "seconds": round(secs, 2),
                          "tok_s": round(tokens / secs), "taps": list(taps),
                          "cos_min_vs_runtime": [round(x, 4) for x in cos.min(0).values.tolist()],
                          "cos_mean_vs_runtime": [round(x, 5) for x in cos.mean(0).tolist()]}), flush=True)


if __name__ == "__main__":
    main()
