"""Cost of the two hybrid-target rollback strategies, measured side by side.

Usage: python scripts/profile_hybrid.py [--threads 2] [--reps 7]

A random-weight Qwen3.5 text model (no hub download) of a laptop-class size: hidden 1024,
12 layers (3 linear-attention : 1 full-attention, like Qwen3.5), 16 value heads of 128.
After a prefill of --context tokens, one iteration = snapshot + verify q tokens + rollback
keeping n of them; reported as the median over --reps, for both strategies. Also reports the
gated-delta kernels alone: transformers' chunked rule (pads to 64) against stepping its
recurrent rule token by token, for a block of q tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_robot.targets.stateful import StatefulTargetAdapter


def build(seed: int = 0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_value_heads=16,
        linear_num_key_heads=8, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).eval()


def time_iteration(model, strategy: str, q: int, keep: int, context: int, reps: int) -> float:
    tgt = StatefulTargetAdapter(model, strategy)
    g = torch.Generator().manual_seed(0)
    tgt.prefill(torch.randint(0, 4096, (context,), generator=g), None, 512)
    times = []
    for i in range(reps + 2):
        block = torch.randint(0, 4096, (q,), generator=g)
        t0 = time.perf_counter()
        snap = tgt.snapshot()
        out = tgt.verify(block, None)
        out.logits.argmax(-1).tolist()
        tgt.rollback(snap, keep)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_kernels(model, q: int, reps: int) -> dict[str, float]:
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    chunk = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    step = getattr(m.torch_recurrent_gated_delta_rule, "__wrapped__", m.torch_recurrent_gated_delta_rule)
    c = model.config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    qry, key = torch.randn(1, q, hk, dk), torch.randn(1, q, hk, dk)
    val, g, beta = torch.randn(1, q, hv, dv), -torch.rand(1, q, hv), torch.rand(1, q, hv)
    state = torch.randn(1, hv, dk, dv)
    res = {}
    for name in ("chunked", "stepped"):
        ts = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            if name == "chunked":
                chunk(qry, key, val, g=g, beta=beta, initial_state=state, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
            else:
                s = state
                for t in range(q):
                    _, s = step(qry[:, t:t + 1], key[:, t:t + 1], val[:, t:t + 1], g=g[:, t:t + 1],
                                beta=beta[:, t:t + 1], initial_state=s, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build()
    rows = []
    for q in (4, 8, 16):
        k = time_kernels(model, q, args.reps)
        for keep in sorted({1, q // 2, q}):
            r = {"q": q, "keep": keep}
            for strategy in ("replay", "capture"):
                r[strategy + "_ms"] = round(1e3 * time_iteration(model, strategy, q, keep, args.context, args.reps), 2)
            r["kernel_chunked_ms"] = round(1e3 * k["chunked"], 3)
            r["kernel_stepped_ms"] = round(1e3 * k["stepped"], 3)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(json.dumps({"machine": f"{platform.machine()}, {args.threads} threads, torch {torch.__version__}",
                      "date": time.strftime("%Y-%m-%d"), "context": args.context}))


if __name__ == "__main__":
    main()
