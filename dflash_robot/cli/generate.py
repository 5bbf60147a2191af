"""`dflash-robot generate`: one prompt, streamed to stdout; statistics on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from dflash_robot.cli.common import (
    HelpFormatter,
    add_decoding_args,
    add_model_args,
    check_block_size,
    check_paths,
    cost_progress,
    int_at_least,
    int_list,
    load_runtime,
)

DESCRIPTION = """Generate text from a prompt with DFlash speculative decoding.

The output is exactly the target model's own (greedy: its greedy tokens; sampling: its
sampling distribution); the draft only makes it faster. With no --target/--draft this runs
SmolLM2-135M-Instruct with the draft shipped for it.

examples:
  dflash-robot generate "Explain KV caches in two sentences."
  echo "Tell me a story." | dflash-robot generate --temperature 0.8 --top-p 0.95 --seed 1
  dflash-robot generate "Hi" --block-size 1          # plain autoregressive decoding, same loop
  dflash-robot generate "Hi" --block-size 8 --tree-budget 16   # verify a 16-node draft tree per step
  dflash-robot generate "Hi" --lookup 0             # the draft alone, without the n-gram lookup branch
"""


def add_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt", description=DESCRIPTION,
                       formatter_class=HelpFormatter)
    g.add_argument("prompt", nargs="?", help="the user's message (read from stdin when omitted and stdin is "
                                             "not a terminal)")
    add_model_args(g)
    d = g.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=int_at_least(1), default=128, help="tokens to generate at most")
    add_decoding_args(d)
    d.add_argument("--tree-budget", type=int_at_least(0), default=0,
                   help="verify a draft tree (DDTree) of this many drafted nodes per step instead of a chain "
                        "(0 = chain); the tree is at most --block-size - 1 deep. With --adaptive: let the policy "
                        "choose, each step, between this tree and the chain block sizes")
    d.add_argument("--tree-topk", type=int_at_least(1), default=None,
                   help="candidates per depth of the tree (default: the budget)")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    d.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed")
    d.add_argument("--stop-token-ids", type=int_list, default=None,
                   help="extra stop token ids, e.g. 13,42 (the model's EOS always stops)")
    d.add_argument("--input-ids", type=int_list, help="the prompt as token ids, e.g. 1,2,3 (no tokenizer needed)")
    d.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    d.add_argument("--verify-mode", choices=["batched", "sequential"], default="batched",
                   help="sequential verifies one token at a time (a numerics reference, slower)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _validate(args: argparse.Namespace) -> None:
    """Everything that can be checked without loading a model."""
    from dflash_robot.errors import ConfigError
    from dflash_robot.runtime.config import GenerationConfig, SamplingConfig

    SamplingConfig(args.temperature, args.top_p, args.top_k)
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed,  # seed and stop ids, before loading
                     stop_token_ids=tuple(args.stop_token_ids or ()))
    if args.tree_budget and args.block_size == 1:
        raise ConfigError("--tree-budget needs a draft block: --block-size must be >= 2")
    if args.lookup and args.verify_mode == "sequential":
        raise ConfigError("--lookup's branch is verified as a tree, in one batched forward; drop --verify-mode "
                          "sequential (or pass --lookup 0)")
    if args.tree_budget and args.verify_mode == "sequential":
        raise ConfigError("--tree-budget verifies the tree in one batched forward; drop --verify-mode sequential")
    if args.tree_topk is not None and args.adaptive:
        raise ConfigError("--tree-topk is fixed by --adaptive's tree arm (the budget); drop --tree-topk")
    if args.tree_topk is not None and not args.tree_budget:
        raise ConfigError("--tree-topk applies to tree verification; add --tree-budget N")
    if args.input_ids is not None and not args.input_ids:
        raise ConfigError("--input-ids is empty; give at least one token id, e.g. --input-ids 1,2,3")
    if args.input_ids is not None and args.prompt is not None:
        raise ConfigError("give either a prompt or --input-ids, not both")
    if args.prompt is None and args.input_ids is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise ConfigError("no prompt: pass it as an argument, or pipe it on stdin")
        args.prompt = sys.stdin.read()
        if not args.prompt.strip():
            raise ConfigError("the prompt read from stdin is empty")
    check_paths(args)
    check_block_size(args)


def run(args: argparse.Namespace) -> int:
    _validate(args)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    print("loading the target and draft ...", file=sys.stderr, flush=True)
    rt = load_runtime(args, no_draft=args.block_size == 1 and args.draft is None)
    load_s = time.perf_counter() - t_load
    prompt = args.input_ids if args.input_ids is not None else args.prompt
    ids = rt.encode(prompt, chat=not args.no_chat_template)
    cfg = rt.config(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, block_size=args.block_size, seed=args.seed,
                    stop_token_ids=args.stop_token_ids or (), verify_mode=args.verify_mode,
                    tree_budget=args.tree_budget, tree_topk=args.tree_topk)
    policy = None
    if args.adaptive:  # with --tree-budget N the policy also weighs that tree against the chain sizes
        policy = rt.adaptive_policy(args.cost_cache or None, progress=cost_progress,
                                    tree_budgets=[args.tree_budget] if args.tree_budget else [])
        cfg = rt.config(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, block_size=None, seed=args.seed, stop_token_ids=args.stop_token_ids or (),
                        verify_mode=args.verify_mode)
    if args.json:
        return _print_json(rt, ids, cfg, policy, load_s)
    return _stream_text(rt, ids, cfg, policy, load_s)


def _print_json(rt: Any, ids: list[int], cfg: Any, policy: Any, load_s: float) -> int:
    res = rt.orchestrator.generate(ids, cfg, policy)
    text = rt.tokenizer.decode(res.token_ids, skip_special_tokens=True) if rt.tokenizer else None
    print(json.dumps({
        "token_ids": res.token_ids, "text": text, "acceptance_lengths": res.acceptance_lengths,
        "mean_acceptance_length": res.mean_acceptance_length, "block_sizes": res.block_sizes,
        "tokens_per_second": res.tokens_per_second, "time_to_first_token_s": res.time_to_first_token_s,
        "load_s": load_s, "draft_s": res.draft_s, "verify_s": res.verify_s, "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
    }))
    return 0


def _stream_text(rt: Any, ids: list[int], cfg: Any, policy: Any, load_s: float) -> int:
    from dflash_robot.runtime.text import TextStream

    text = TextStream(rt.tokenizer) if rt.tokenizer is not None else None
    n, acc, reason = 0, [], "length"
    t0 = time.perf_counter()
    t_first = None
    for ev in rt.orchestrator.stream(ids, cfg, policy):
        t_first = t_first or time.perf_counter()
        n += len(ev.tokens)
        if ev.acceptance_length is not None:
            acc.append(ev.acceptance_length)
        reason = ev.finish_reason or reason
        sys.stdout.write(text.push(ev.tokens) if text is not None else " ".join(map(str, ev.tokens)) + " ")
        sys.stdout.flush()
    if text is not None:
        sys.stdout.write(text.finish())
    sys.stdout.write("\n")
    sys.stdout.flush()
    end = time.perf_counter()
    tps = (n - 1) / (end - t_first) if t_first and n > 1 and end > t_first else 0.0
    tau = f", mean acceptance {sum(acc) / len(acc):.2f}" if acc and cfg.block_size != 1 else ""
    cut = f"; cut at --max-new-tokens {cfg.max_new_tokens}" if reason == "length" else ""
    print(f"[{n} tokens{cut}; load {load_s:.1f} s, first token {(t_first or end) - t0:.2f} s after load, "
          f"{tps:.1f} tok/s decode{tau}]", file=sys.stderr)
    return 0
