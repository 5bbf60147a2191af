"""ExecuTorch export against the eager lean engine, side by side, on the embedded default target.

Usage: python scripts/profile_executorch.py --export DIR [--threads 2] [--context 256] [--reps 9]
                                            [--prompts 4] [--max-new-tokens 96]

DIR is an export of the default target and shipped draft (`dflash-robot export executorch --out
DIR`). In one process: the lean engine at fp32 (the export's weights are fp32) and at the default
precision, and the ExecuTorch programs. Prints, as JSON:
- verify cost (target forward of q tokens + rollback) at q = 1 and at the export's block size,
  median over --reps, engines interleaved each repetition;
- the draft's cost per proposal;
- greedy decoding on --prompts HumanEval/GSM8K prompts at block size 1 and at the export's
  block size: tok/s, τ, and whether every engine's tokens equal the eager fp32 engine's;
- the .pte sizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from dflash_robot.bench.runner import chat_ids, conversations
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    et = DFlashRuntime.load_executorch(args.export)
    q = et.target.block
    runtimes = {"lean fp32": DFlashRuntime.load(precision="fp32"), "lean default": DFlashRuntime.load(),
                "executorch": et}
    g = torch.Generator().manual_seed(0)
    vocab = et.target.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=g)
    taps = et.draft.metadata.target_layer_ids
    feats = {}
    for name, rt in runtimes.items():
        feats[name] = rt.target.prefill(prompt, taps, 512).features
        rt.orchestrator.drafter.reset(prompt)
        rt.orchestrator.drafter.propose(feats[name], torch.full((q,), et.draft.metadata.mask_token_id))
    times: dict[str, dict[str, list[float]]] = {n: {"verify_q1": [], f"verify_q{q}": [], "draft": []}
                                                for n in runtimes}
    for _ in range(args.reps + 1):
        for name, rt in runtimes.items():
            tgt, drafter = rt.target, rt.orchestrator.drafter
            for qq in (1, q):
                block = torch.randint(0, vocab, (qq,), generator=g)
                t0 = time.perf_counter()
                snap = tgt.snapshot()
                tgt.verify(block, taps).logits.argmax(-1).tolist()
                tgt.rollback(snap, 1)
                times[name][f"verify_q{qq}" if qq == q else "verify_q1"].append(time.perf_counter() - t0)
            block = torch.full((q,), et.draft.metadata.mask_token_id)
            t0 = time.perf_counter()
            drafter.propose(feats[name][:1], block).argmax(-1).tolist()
            times[name]["draft"].append(time.perf_counter() - t0)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "context": args.context, "block_size": q,
              "pte_bytes": et.target.manifest["pte_bytes"],
              "ms": {n: {k: round(1000 * statistics.median(v[1:]), 2) for k, v in d.items()} for n, d in times.items()}}
    prompts = []
    for ds in ("humaneval", "gsm8k"):
        prompts += [c[0] for c in conversations(ds, args.prompts // 2, 0)]
    tok = et.tokenizer
    decode: dict[str, dict[str, dict[str, float]]] = {}
    ref: dict[tuple[int, int], list[int]] = {}
    for bs in (1, q):
        for name, rt in runtimes.items():
            n_tok = dec = 0.0
            acc: list[int] = []
            same = 0
            for i, text in enumerate(prompts):
                ids = chat_ids(tok, [{"role": "user", "content": text}])
                cfg = GenerationConfig(args.max_new_tokens, bs, stop_token_ids=(tok.eos_token_id,))
                r = rt.orchestrator.generate(ids, cfg)
                n_tok += len(r.token_ids) - 1
                dec += r.decode_s
                acc += r.acceptance_lengths
                ref.setdefault((bs, i), r.token_ids) if name == "lean fp32" else None
                same += r.token_ids == ref[(bs, i)]
            decode.setdefault(f"block {bs}", {})[name] = {
                "tok_s": round(n_tok / dec, 2), "tau": round(sum(acc) / len(acc), 3),
                "identical_to_lean_fp32": f"{same}/{len(prompts)}"}
    result["decode"] = decode
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
