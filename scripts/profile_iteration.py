"""Measure the cost of each step of one DFlash chain iteration on the default runtime.

Usage: python scripts/profile_iteration.py [--draft shipped|DIR] [--block-sizes 4,16] [--context 256]
                                           [--iters 60] [--threads 2] [--engine auto] [--precision auto]
                                           [--draft-precision int8|int4|...]

Loads what `dflash-robot generate` loads (the lean engine on the GGUF's own weights, fused kernels,
the draft at the precision the runtime gives it), then times the same calls the orchestrator makes
in one greedy chain iteration (`RuntimeOrchestrator._steps`), each with perf_counter (CPU:
synchronous): the draft's proposal (block, draft forward, argmax, ids back to the target's side),
the snapshot and the target's verify forward with its taps, acceptance and the stop scan, the one
device->host transfer, and the rollback with the next features. Each iteration keeps one token
(the worst case: the context grows by one and the cache is cropped every time). The autoregressive
step (q = 1: verify one token, no draft) is timed the same way, alternating with the chain
iterations. docs/ARCHITECTURE.md ("Measured cost of each step") quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import SamplingConfig
from dflash_robot.runtime.strategy import ChainStrategy

STEPS = ("1 draft proposal (block, forward, argmax)", "2 snapshot + target verify (q tokens, taps)",
         "3 acceptance + stop scan (device)", "4 device->host transfer (the one sync)",
         "5 rollback (cache crop) + next features")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="shipped")
    ap.add_argument("--block-sizes", default="4,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--draft-precision", default=None, help="the draft's lean forward (default: the runtime's choice)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load(draft=None if args.draft == "shipped" else args.draft, engine=args.engine,
                            precision=args.precision)
    tgt, drafter = rt.target, rt.orchestrator.drafter
    assert drafter is not None and rt.draft is not None
    if args.draft_precision:
        from dflash_robot.runtime.proposer import DFlashProposer

        drafter = DFlashProposer(rt.draft, tgt.input_embedding_weight(), tgt.output_head(),
                                 precision=args.draft_precision)
    chain = ChainStrategy(drafter, tgt.vocab_size)
    taps = drafter.metadata.target_layer_ids
    greedy, gen = SamplingConfig(temperature=0.0), torch.Generator()
    stops = torch.tensor(sorted(set(rt.stop_token_ids())))
    prompt = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    print(f"target: {rt.info.get('target')} (engine {type(tgt).__name__}, precision {rt.info.get('precision')}, "
          f"kernels {rt.info.get('kernels')}); draft: {args.draft} ({len(rt.draft.layers) if rt.draft else 0} "
          f"layers, lean forward {getattr(getattr(drafter, '_lean', None), 'precision', 'none: the module')}); "
          f"context {args.context}, {args.threads} threads, median of {args.iters} (after 5 untimed)")
    for q in block_sizes:
        times: dict[str, list[float]] = {}

        def tick(name: str, t0: float, times: dict[str, list[float]] = times) -> float:
            t1 = time.perf_counter()
            times.setdefault(name, []).append((t1 - t0) * 1e3)
            return t1

        out = tgt.prefill(prompt, taps, 512)
        drafter.reset(prompt)  # as a request does (a prompt_vocab draft's columns)
        feats = out.features
        last = out.logits[-1].argmax().view(1)
        for it in range(args.iters + 5):
            for mode in (("chain", "ar") if it % 2 else ("ar", "chain")):
                if mode == "ar":  # one autoregressive step, then back: same context length
                    snap = tgt.snapshot()
                    t = time.perf_counter()
                    v1 = tgt.verify(last, taps)
                    v1.logits[-1].argmax().tolist()
                    tick("(autoregressive step: verify 1 token + argmax + transfer)", t)
                    tgt.rollback(snap, 0)
                    continue
                t = time.perf_counter()
                proposal = chain.propose(last, feats, q, greedy, gen)
                t = tick(STEPS[0], t)
                snap = tgt.snapshot()
                v = chain.verify(tgt, proposal, taps, False)
                t = tick(STEPS[1], t)
                acc = chain.accept(proposal, v.logits, greedy, gen)
                is_stop = torch.isin(acc.tokens, stops)
                first_stop = torch.where(is_stop.any(), is_stop.to(torch.int64).argmax(), q)
                packed = torch.cat([acc.num_accepted.view(1), first_stop.view(1), acc.tokens])
                t = tick(STEPS[2], t)
                packed.tolist()
                t = tick(STEPS[3], t)
                chain.commit(tgt, snap, None, 1)  # keep one token: the context grows by one
                assert v.features is not None
                feats = v.features[:1]
                last = acc.tokens[:1]
                tick(STEPS[4], t)
        print(f"\nblock size {q}:")
        total = 0.0
        for name, ts in times.items():
            med = statistics.median(ts[5:])
            total += 0.0 if name.startswith("(") else med
            print(f"| {name} | {med:.3f} ms |")
        print(f"| total (steps 1-5) | {total:.3f} ms |")


if __name__ == "__main__":
    main()
