"""The CLI on a tiny saved model: JSON output, streaming, and errors."""

import json

import pytest
from tiny import plain_greedy_cached, taught_target, trained_draft

from dflash_robot.checkpoint import save_draft
from dflash_robot.cli import main


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
    assert len(json.loads(cache.read_text())) == 1  # the curve was measured once and cached


def test_adaptive_and_block_size_conflict(model_dirs, capsys, tmp_path):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--input-ids", "1,2",
                 "--adaptive", "--block-size", "4", "--cost-cache", ""]) == 2
    assert "--adaptive" in capsys.readouterr().err
