"""`dflash-robot bench`: prompt sets, and a --limit 2 smoke run on a tiny model that writes
valid JSON, Markdown and PNG. (Benchmarks are commands; nothing here is timed.)"""

import json

import pytest
from tiny import char_tokenizer, taught_target, trained_draft

from dflash_robot.bench import datasets as bench_data
from dflash_robot.bench.runner import conversations, tau_interval
from dflash_robot.cli import main
from dflash_robot.drafts.checkpoint import save_draft
from dflash_robot.errors import ConfigError


def test_prompt_set_sizes():
    assert len(bench_data.humaneval()) == 164
    assert len(bench_data.gsm8k()) == 1319
    mt = bench_data.mtbench()
    assert len(mt) == 80 and all(len(turns) == 2 for turns in mt)
    assert len(bench_data.aime25()) == 30
    assert len(bench_data.ifbench()) > 0


def test_subsets_are_deterministic_and_formatted():
    a = conversations("gsm8k", 5, seed=0)
    assert a == conversations("gsm8k", 5, seed=0) and a != conversations("gsm8k", 5, seed=1)
    assert all(len(c) == 1 and "step by step" in c[0] for c in a)
    assert [len(c) for c in conversations("mtbench", 3)] == [2, 2, 2]
    with pytest.raises(ConfigError, match="unknown dataset"):
        conversations("mmlu", 1)


def test_single_turn_prompts_are_the_first_turns_of_the_bench_subset():
    """`scripts/compare_drafts.py` and `scripts/acceptance.py` read `formatted_prompts`: every set
    `bench` knows, the same seeded subset, MT-Bench's first turn."""
    mt = conversations("mtbench", 4, seed=1)
    assert bench_data.formatted_prompts("mtbench", 4, seed=1) == [c[0] for c in mt]
    assert bench_data.formatted_prompts("mtbench", 4, seed=1) != [c[1] for c in mt]
    assert bench_data.formatted_prompts("humaneval", 2)[0].startswith("Write a solution")
    assert len(bench_data.formatted_prompts("ifbench", 3)) == 3
    with pytest.raises(ConfigError, match="unknown dataset"):
        bench_data.formatted_prompts("mmlu", 1)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    taught_target("llama").save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    save_draft(trained_draft("llama"), root / "draft")
    return root


def test_bench_smoke_writes_json_markdown_png(tiny_dirs, capsys):
    out = tiny_dirs / "out"
    rc = main(["bench", "--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"),
               "--datasets", "gsm8k,mtbench", "--limit", "2", "--block-sizes", "2,8", "--max-new-tokens", "12",
               "--hf-generate", "--cost-cache", str(tiny_dirs / "costs.json"), "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "bench.json").read_text())
    assert set(report["datasets"]) == {"gsm8k", "mtbench"}
    he = report["datasets"]["gsm8k"]
    assert set(he["dflash"]) == {"q=2", "q=8", "adaptive"}
    assert he["baseline"]["turns"] == 2
    # MT-Bench: one conversation's first turn (1050 characters) does not fit the tiny target's
    # 1024 positions, so that conversation is skipped and reported; the other runs both turns
    mt = report["datasets"]["mtbench"]
    assert mt["turns_skipped_too_long"] == 1 and mt["baseline"]["turns"] == 2
    for s in he["dflash"].values():
        assert s["lossless_mismatches"] == 0 and s["mean_acceptance_length"] >= 1 and s["speedup"] > 0
        assert sum(s["acceptance_histogram"].values()) > 0
        assert s["mean_acceptance_length_se"] >= 0
    assert he["comparisons"]["hf_generate"]["turns"] == 2
    for key in ("date", "cpu", "torch", "transformers", "threads"):
        assert report["meta"][key]
    assert set(report["costs_s"]) == {str(q) for q in range(1, 17)}
    md = (out / "bench.md").read_text()
    assert "| DFlash q=8 |" in md and "| DFlash adaptive |" in md and "hf_generate" in md
    for png in ["speedup_vs_block.png", "acceptance_hist_gsm8k.png", "acceptance_hist_mtbench.png"]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_tree_runs_side_by_side(tiny_dirs, capsys):
    out = tiny_dirs / "out-tree"
    rc = main(["bench", "--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"),
               "--datasets", "gsm8k", "--limit", "2", "--block-sizes", "4", "--max-new-tokens", "16",
               "--tree-budgets", "3,12", "--cost-cache", str(tiny_dirs / "costs-tree.json"), "--out", str(out),
               "--no-progress", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "bench.json").read_text())
    d = report["datasets"]["gsm8k"]
    assert set(d["dflash"]) == {"q=4", "tree=3,q=4", "tree=12,q=13", "adaptive", "adaptive+tree"}
    for s in d["dflash"].values():
        assert s["lossless_mismatches"] == 0 and s["mean_acceptance_length"] >= 1
    assert d["best_tree"] in ("tree=3,q=4", "tree=12,q=13")
    assert set(report["tree_costs_s"]) == {"3", "12"}
    assert "| DFlash tree=12,q=13 |" in (out / "bench.md").read_text()


def test_bench_without_matplotlib_fails_before_the_run(tiny_dirs, capsys, monkeypatch):
    import importlib.util

    from dflash_robot.runtime import api

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(api.DFlashRuntime, "load", lambda *a, **k: pytest.fail("loaded before the check"))
    rc = main(["bench", "--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"),
               "--out", str(tiny_dirs / "bad"), "--no-adaptive", "--limit", "1"])
    assert rc == 2 and "plots need matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    (["--datasets", "nope"], "unknown dataset"),
    (["--tree-budgets", "0"], "--tree-budgets must be"),
    (["--tree-block-size", "4"], "needs --tree-budgets"),
    (["--block-sizes", "2,32"], "this draft supports 1..16"),
    (["--llama-cpp", "/nonexistent.gguf"], "does not exist"),
    (["--engine", "executorch", "--hf-generate"], "--hf-generate runs transformers' generate"),
])
def test_bench_bad_arguments(tiny_dirs, capsys, extra, match):
    rc = main(["bench", "--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"),
               "--out", str(tiny_dirs / "bad"), "--no-adaptive", "--no-plots", "--limit", "1", *extra])
    assert rc == 2 and match in capsys.readouterr().err


def _synthetic_prompts(n: int, seed: int, shift: float = 0.0) -> tuple[list[list[int]], list[list[int]]]:
    """Two drafts' acceptance lengths on the same n prompts: each prompt has its own difficulty, which
    both drafts share; the second accepts `shift` more on average."""
    import random
    rng = random.Random(seed)
    a, b = [], []
    for _ in range(n):
        easy = rng.uniform(1.0, 4.0)
        steps = rng.randint(10, 60)
        a.append([max(1, round(rng.gauss(easy, 0.7))) for _ in range(steps)])
        b.append([max(1, round(rng.gauss(easy + shift, 0.7))) for _ in range(steps)])
    return a, b


def test_tau_interval_value_is_the_pooled_mean():
    a, b = _synthetic_prompts(30, 0, shift=0.5)
    pooled = lambda runs: sum(map(sum, runs)) / sum(map(len, runs))  # noqa: E731
    assert tau_interval(a)["value"] == pytest.approx(pooled(a))
    d = tau_interval(b, a)
    assert d["value"] == pytest.approx(pooled(b) - pooled(a))
    assert d["lo"] < d["value"] < d["hi"]
    same = tau_interval(a, a)  # a draft against itself: no difference, and no doubt about it
    assert same["value"] == 0 and same["se"] == 0 and same["lo"] == same["hi"] == 0


def test_tau_interval_se_matches_the_ratio_estimator():
    """Independent truth: the delta-method standard error of a ratio of sums over n clusters,
    sqrt(sum((A_i - R S_i)^2) / (n (n-1))) * n / sum(S_i), which the bootstrap approximates."""
    a, _ = _synthetic_prompts(400, 1)
    acc = [sum(x) for x in a]
    steps = [len(x) for x in a]
    n, r = len(a), sum(acc) / sum(steps)
    se = (sum((x - r * s) ** 2 for x, s in zip(acc, steps, strict=True)) / (n * (n - 1))) ** 0.5 * n / sum(steps)
    ci = tau_interval(a, resamples=4000)
    assert ci["se"] == pytest.approx(se, rel=0.1)
    assert ci["hi"] - ci["lo"] == pytest.approx(2 * 1.96 * se, rel=0.15)  # a 95% interval, not 68% or 90%


def test_tau_interval_pairing_cancels_what_prompts_share():
    a, b = _synthetic_prompts(40, 2, shift=0.1)
    paired = tau_interval(b, a)["se"]
    unpaired = (tau_interval(a)["se"] ** 2 + tau_interval(b)["se"] ** 2) ** 0.5
    assert paired < 0.5 * unpaired


def test_tau_interval_bad_input():
    with pytest.raises(ValueError, match="same prompts"):
        tau_interval([[1, 2]], [[1], [2]])
    with pytest.raises(ValueError, match="no prompts"):
        tau_interval([])
    with pytest.raises(ValueError, match="no verify steps"):
        tau_interval([[], []])
    with pytest.raises(ValueError, match="no verify steps"):
        tau_interval([[2, 1], [3]], [[], []])


def test_tau_interval_one_prompt_and_empty_prompts():
    one = tau_interval([[1, 2, 3]])
    assert one["value"] == 2 and one["se"] is None and one["lo"] is None  # nothing to resample
    # a prompt that made no verify step weighs nothing in the pooled mean, and no resample is NaN
    ci = tau_interval([[2, 2], [], [4, 4]], resamples=500)
    assert ci["value"] == 3 and 2 <= ci["lo"] <= ci["hi"] <= 4
