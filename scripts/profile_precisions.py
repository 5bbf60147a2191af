"""Verify cost against q for each weight precision of the lean engine, side by side.

Usage: python scripts/profile_precisions.py [--threads 2] [--context 256] [--reps 9]
                                            [--precisions fp32,bf16,int8,int4,gguf] [--block-sizes 1,...,16]

Loads the embedded default target (SmolLM2-135M-Instruct GGUF) once, builds one lean adapter per
precision over it, prefills --context random tokens, then times verify(q) + rollback(1) with the
shipped draft's three taps, median over --reps, the precisions interleaved every repetition so
that drift on a shared box hits all alike. Also prints the weight bytes a single-token step reads
per precision, a bandwidth probe (a `torch.sum` over 512 MB) and the memory floor they imply,
and the top-1 agreement of each precision's logits with fp32 over the prefill positions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.loading import default_target_path, load_target_model

BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32, "gguf": 0.5 + 4 / 32}


def bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return mb * 2**20 / min(ts) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--precisions", default="fp32,bf16,int8,int4,gguf")
    ap.add_argument("--block-sizes", default="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_target_path()
    model, _ = load_target_model(path, dtype="float32")
    precisions = args.precisions.split(",")
    engines = {p: LeanTargetAdapter(model, precision=p, gguf_file=str(path)) for p in precisions}
    qs = [int(q) for q in args.block_sizes.split(",")]
    taps = (1, 14, 27)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    ref = None
    agree = {}
    for p, eng in engines.items():
        eng.reset()
        out = eng._forward(prompt, taps)  # all positions' logits
        top = out.logits.argmax(-1)
        ref = top if ref is None else ref
        agree[p] = float((top == ref).float().mean())
    times: dict[str, dict[int, list[float]]] = {p: {q: [] for q in qs} for p in precisions}
    for rep in range(args.reps + 1):
        for q in qs:
            block = torch.randint(0, model.config.vocab_size, (q,))
            for p, eng in engines.items():
                snap = eng.snapshot()
                t0 = time.perf_counter()
                v = eng.verify(block, taps)
                v.logits.argmax(-1).tolist()
                eng.rollback(snap, 1)
                if rep:
                    times[p][q].append(time.perf_counter() - t0)
    n_linear = sum(p.numel() for n, p in model.named_parameters() if "layers" in n and p.dim() == 2)
    head = model.get_output_embeddings().weight.numel()
    bw = bandwidth_gbs()
    rows = {}
    for p in precisions:
        head_bytes = {"fp32": 4, "int8": 1}.get(p, 2)
        weight_mb = (n_linear * BYTES_PER_WEIGHT[p] + head * head_bytes) / 1e6
        rows[p] = {"verify_ms": {q: round(1e3 * statistics.median(times[p][q]), 2) for q in qs},
                   "weight_mb_per_step": round(weight_mb, 1), "memory_floor_ms": round(weight_mb / 1e3 / bw * 1e3, 2),
                   "top1_agreement_with_fp32": round(agree[p], 4)}
    print(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "machine": platform.processor() or platform.machine(), "threads": args.threads,
                      "context": args.context, "reps": args.reps, "bandwidth_gb_s": round(bw, 1),
                      "torch": torch.__version__, "precisions": rows}, indent=1))


if __name__ == "__main__":
    main()
