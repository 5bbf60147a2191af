"""The CLI on a tiny saved model: JSON output, streaming, and errors."""

import json

import pytest
from tiny import plain_greedy_cached, taught_target, trained_draft

from dflash_robot.cli import main
from dflash_robot.drafts.checkpoint import save_draft


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    taught_target("llama").save_pretrained(root / "target")
    save_draft(trained_draft("llama"), root / "draft")
    return root / "target", root / "draft"


def test_generate_json(model_dirs, capsys):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2,3",
                 "--max-new-tokens", "20", "--block-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain_greedy_cached("llama", (1, 2, 3), 40)[:20]
    assert sum(out["acceptance_lengths"]) == 19 and out["text"] is None
    assert out["tokens_per_second"] > 0 and out["finish_reason"] == "length"


def test_generate_streams_ids_without_tokenizer(model_dirs, capsys):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2,3",
                 "--max-new-tokens", "10"]) == 0
    cap = capsys.readouterr()
    assert cap.out.split() == [str(t) for t in plain_greedy_cached("llama", (1, 2, 3), 40)[:10]]
    assert "tok/s" in cap.err


@pytest.mark.parametrize("extra,match", [
    (["--top-p", "0"], "top_p"), (["--temperature", "-1"], "temperature"),
    (["--block-size", "99"], "block size"),
    (["--lookup", "3", "--verify-mode", "sequential"], "lookup"),
])
def test_generate_bad_arguments(model_dirs, capsys, extra, match):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2",
                 *extra]) == 2
    assert match in capsys.readouterr().err


def test_missing_draft_path(model_dirs, capsys):
    target, _ = model_dirs
    assert main(["generate", "--target", str(target), "--draft", "/no/such/draft", "--input-ids", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_no_tokenizer_needs_input_ids(model_dirs, capsys):
    target, draft = model_dirs
    assert main(["generate", "hello", "--target", str(target), "--draft", str(draft)]) == 2
    assert "--input-ids" in capsys.readouterr().err


def test_generate_adaptive(model_dirs, capsys, tmp_path):
    target, draft = model_dirs
    cache = tmp_path / "costs.json"
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2,3",
                 "--max-new-tokens", "20", "--adaptive", "--cost-cache", str(cache), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain_greedy_cached("llama", (1, 2, 3), 40)[:20]
    assert all(1 <= q <= 16 for q in out["block_sizes"])
    entry, = json.loads(cache.read_text()).values()  # the curve was measured once and cached
    assert set(entry["costs"]) == {str(q) for q in range(1, 17)} and entry["measured_at"] > 0


def test_adaptive_and_block_size_conflict(model_dirs, capsys, tmp_path):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2",
                 "--adaptive", "--block-size", "4", "--cost-cache", ""]) == 2
    assert "--adaptive" in capsys.readouterr().err


def _no_model_load(monkeypatch):
    """Make any model load fail loudly: the checks under test must come before it."""
    import dflash_robot.targets.loading as loading

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were validated")
    monkeypatch.setattr(loading, "load_target_model", boom)
    import dflash_robot.runtime.api as api
    monkeypatch.setattr(api, "load_target_model", boom)


@pytest.mark.parametrize("extra,match", [
    (["--block-size", "99"], "1..16"), (["--adaptive", "--block-size", "4"], "--adaptive"),
    (["--draft", "/no/such/draft"], "does not exist"), (["--target", "/no/such/target"], "does not exist"),
    (["--top-k", "-1"], "top_k"), (["--seed", "-1"], "seed must be"), (["--stop-token-ids", "-1"], "stop_token_ids"),
])
def test_arguments_validated_before_any_model_loads(model_dirs, capsys, monkeypatch, extra, match):
    target, draft = model_dirs
    _no_model_load(monkeypatch)
    args = ["generate", "--input-ids", "1,2", "--target", str(target), "--draft", str(draft), *extra]
    assert main(args) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["generate", "x", "--max-new-tokens", "0"], ["generate", "x", "--max-new-tokens", "-5"],
    ["bench", "--max-new-tokens", "0"], ["generate", "x", "--block-size", "0"]])
def test_out_of_range_integers_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("layers,match", [
    ("-1", "distinct non-negative layer indices"), ("3,3", "distinct non-negative layer indices"),
    ("1,99", "the target has layers 0..5"),  # known only once the target's config is read: before generating
])
def test_data_feature_layers_are_checked(model_dirs, tmp_path, capsys, layers, match):
    target, _ = model_dirs
    assert main(["data", "--target", str(target), "--out", str(tmp_path / "d"), "--feature-layers", layers]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from dflash_robot.cli import main\n"
            "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'LIGHT')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("LIGHT"), r.stdout[-500:] + r.stderr[-500:]
    assert "(default: 128)" in r.stdout  # defaults are shown


def test_prompt_from_stdin_and_missing_prompt(model_dirs, capsys, monkeypatch):
    import io

    target, draft = model_dirs
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "--target", str(target), "--draft", str(draft)]) == 2
    assert "stdin is empty" in capsys.readouterr().err


def test_text_output_ends_with_newline_and_says_when_cut(model_dirs, capsys):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2,3",
                 "--max-new-tokens", "10"]) == 0
    cap = capsys.readouterr()
    assert cap.out.endswith("\n")
    assert "cut at --max-new-tokens 10" in cap.err and "load" in cap.err


def test_ctrl_c_exits_130_with_one_line(model_dirs, capsys, monkeypatch):
    import dflash_robot.cli.generate as gen

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(gen, "run", interrupted)
    assert main(["generate", "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "dflash-robot: interrupted"


def test_version_is_the_installed_distributions(capsys):
    """One version: `--version`, `dflash_robot.__version__` and the installed package metadata
    (pyproject reads it from `__version__`) agree. Needs the package installed as it is now
    (`pip install -e .`, as scripts/test.sh does): stale metadata fails here, as it should."""
    from importlib.metadata import version

    import dflash_robot

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"dflash-robot {dflash_robot.__version__}"
    assert version("dflash-robot") == dflash_robot.__version__


@pytest.mark.parametrize("lookup", [[], ["--lookup", "0"], ["--lookup", "5", "--lookup-ngram", "1:2"]])
def test_generate_with_and_without_the_lookup_is_the_targets_greedy(model_dirs, capsys, lookup):
    target, draft = model_dirs
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids",
                 ",".join(map(str, prompt)), "--max-new-tokens", "20", "--block-size", "4", "--json", *lookup]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain_greedy_cached("llama", tuple(prompt), 40)[:20]


@pytest.mark.parametrize("bad", ["0:2", "3:2", "a", "1:2:3"])
def test_bad_lookup_ngram_is_a_usage_error(model_dirs, capsys, bad):
    target, draft = model_dirs
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1", "--lookup-ngram", bad])
    assert e.value.code == 2 and "MIN:MAX" in capsys.readouterr().err
