"""ExecuTorch export (`dflash-robot export executorch`): the two programs run through ExecuTorch's
Python runtime with the same orchestrator, and decode exactly what the eager engine decodes."""

import json

import pytest
from tiny import plain_greedy_cached, random_prompt, taught_target, trained_draft

pytest.importorskip("executorch.runtime", reason="the executorch extra is part of the test install")

from dflash_robot.cli import main  # noqa: E402
from dflash_robot.errors import ConfigError  # noqa: E402
from dflash_robot.export.executorch import export_executorch  # noqa: E402
from dflash_robot.runtime.api import DFlashRuntime  # noqa: E402
from dflash_robot.runtime.config import GenerationConfig  # noqa: E402

N = 40
BLOCK = 8


_EXPORTS: dict = {}


def _export(family, tmp_path_factory):
    if family not in _EXPORTS:
        out = tmp_path_factory.mktemp(f"et-{family}")
        export_executorch(taught_target(family), trained_draft(family), out, block_size=BLOCK, max_context=160)
        _EXPORTS[family] = out
    return family, _EXPORTS[family]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def exported(request, tmp_path_factory):
    return _export(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def exported_llama(tmp_path_factory):
    return _export("llama", tmp_path_factory)


@pytest.mark.parametrize("block_size", [1, 4, BLOCK])
def test_executorch_greedy_equals_plain_greedy(exported, block_size):
    family, out = exported
    rt = DFlashRuntime.load_executorch(out)
    for seed in (0, 1):
        prompt = random_prompt(20, seed)  # 20 > BLOCK: a chunked, padded prefill
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=block_size))
        assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
        if block_size > 1:
            assert max(res.acceptance_lengths) >= 2


def test_executorch_matches_the_eager_engine_step_for_step(exported):
    """Same draft, same target: the exported pair accepts what the eager pair accepts."""
    family, out = exported
    et = DFlashRuntime.load_executorch(out)
    eager = DFlashRuntime.from_models(taught_target(family), trained_draft(family), engine="lean")
    prompt = random_prompt(20, 2)
    cfg = GenerationConfig(max_new_tokens=N, block_size=BLOCK)
    a, b = et.orchestrator.generate(prompt, cfg), eager.orchestrator.generate(prompt, cfg)
    assert a.token_ids == b.token_ids
    assert a.acceptance_lengths == b.acceptance_lengths


def test_executorch_manifest_and_limits(exported):
    family, out = exported
    m = json.loads((out / "manifest.json").read_text())
    assert m["block_size"] == BLOCK and m["max_context"] == 160
    assert m["pte_bytes"]["target"] == (out / "target.pte").stat().st_size > 0
    rt = DFlashRuntime.load_executorch(out)
    with pytest.raises(ConfigError, match="too long"):  # 160 - BLOCK + 1 positions usable
        rt.orchestrator.generate(random_prompt(100, 0), GenerationConfig(max_new_tokens=60, block_size=BLOCK))
    with pytest.raises(ConfigError, match="out of range"):
        rt.orchestrator.generate([1, 2], GenerationConfig(max_new_tokens=4, block_size=BLOCK + 1))
    from dflash_robot.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="tree"):
        rt.orchestrator.generate([1, 2], GenerationConfig(max_new_tokens=4, block_size=4, tree_budget=4))


def test_cli_refuses_bad_executorch_use(tmp_path, capsys):
    assert main(["generate", "hi", "--engine", "executorch", "--target", str(tmp_path)]) == 2
    assert "not an ExecuTorch export" in capsys.readouterr().err
    assert main(["generate", "hi", "--engine", "executorch"]) == 2
    assert "needs --target" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text("{")
    assert main(["generate", "hi", "--engine", "executorch", "--target", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_export_and_generate_on_a_tiny_model(tmp_path, capsys):
    """The CLI path: a saved tiny target and draft -> export -> generate --engine executorch."""
    from tiny import char_tokenizer

    from dflash_robot.drafts.checkpoint import save_draft

    model = taught_target("llama")
    tdir, ddir, out = tmp_path / "target", tmp_path / "draft", tmp_path / "et"
    model.save_pretrained(tdir)
    char_tokenizer().save_pretrained(tdir)
    save_draft(trained_draft("llama"), ddir)
    assert main(["export", "executorch", "--target", str(tdir), "--draft", str(ddir), "--out", str(out),
                 "--block-size", "4", "--max-context", "96"]) == 0
    capsys.readouterr()
    ids = random_prompt(10, 4)
    assert main(["generate", "--engine", "executorch", "--target", str(out), "--input-ids",
                 ",".join(map(str, ids)), "--max-new-tokens", "20", "--block-size", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == plain_greedy_cached("llama", tuple(ids), 20)[:len(got["token_ids"])]
    assert len(got["token_ids"]) == 20 or got["finish_reason"] == "stop"  # the tiny tokenizer's EOS may stop it
    # a block size above the export's is refused from its manifest, before anything loads
    from dflash_robot.cli import build_parser, serve
    from dflash_robot.cli import generate as generate_cli

    for cmd in (["generate", "--input-ids", "1,2"], ["serve"]):
        args = build_parser().parse_args(cmd + ["--engine", "executorch", "--target", str(out), "--block-size", "5"])
        with pytest.raises(ConfigError, match="--block-size 5 is out of range: this draft supports 1..4"):
            (generate_cli._validate if cmd[0] == "generate" else serve._validate)(args)


def test_adaptive_measures_within_the_exported_context(exported):
    """The cost measurement fits a small export's fixed context (it used to overrun it)."""
    family, out = exported
    rt = DFlashRuntime.load_executorch(out)
    pol = rt.adaptive_policy(cost_cache=None)
    assert set(pol.costs) == set(range(1, BLOCK + 1))
    prompt = random_prompt(20, 5)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N), policy=pol)
    assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)


def test_bench_times_an_export(exported_llama, tmp_path, capsys):
    family, out = exported_llama
    from tiny import char_tokenizer

    char_tokenizer().save_pretrained(out)  # bench applies a chat template
    rc = main(["bench", "--engine", "executorch", "--target", str(out), "--datasets", "gsm8k", "--limit", "2",
               "--block-sizes", "2,4", "--max-new-tokens", "12", "--no-adaptive", "--no-plots", "--no-progress",
               "--out", str(tmp_path / "b")])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    d = report["datasets"]["gsm8k"]
    assert report["meta"]["engine"] == "ExecuTorchTarget"
    assert all(s["lossless_mismatches"] == 0 for s in d["dflash"].values())
    assert main(["bench", "--engine", "executorch", "--target", str(out), "--tree-budgets", "4",
                 "--out", str(tmp_path / "c")]) == 2
    assert "causal blocks only" in capsys.readouterr().err


def test_missing_executorch_says_how_to_install(monkeypatch):
    import builtins

    from dflash_robot.export.manifest import require_executorch

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("executorch"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ConfigError, match=r"pip install 'dflash-robot\[executorch\]'"):
        require_executorch()
