"""The lean engine built from a converted snapshot (targets/snapshot.py), without transformers'
model object, computes exactly what the engine built from the transformers model computes."""

import json

import pytest
import torch
from tiny import VOCAB, char_tokenizer, make_config, taught_target
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.snapshot import eligible, open_snapshot
from dflash_robot.targets.tokenizer import MARKER, verify_against


def _snapshot(model, path, tokenizer=True):
    """What loading.py writes: the model, its tokenizer, and the tokenizer check's marker."""
    model.save_pretrained(str(path))
    if tokenizer:
        tok = char_tokenizer()
        tok.save_pretrained(str(path))
        assert verify_against(tok, path)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_snapshot_engine_equals_the_model_engine(family, precision, tmp_path):
    model = taught_target(family)
    snap = _snapshot(model, tmp_path / family)
    assert eligible(snap)
    loads = []
    a = LeanTargetAdapter(model, initial_capacity=16, precision=precision)
    b = LeanTargetAdapter.from_snapshot(snap, precision, load_model=lambda: loads.append(1) or model,
                                        initial_capacity=16)
    ids = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(1))
    taps = (0, 2, 5)
    x, y = a.prefill(ids[:20], taps, 8), b.prefill(ids[:20], taps, 8)
    assert torch.equal(x.logits, y.logits) and torch.equal(x.features, y.features)
    for start, q, keep in [(20, 16, 3), (23, 1, 1), (24, 8, 8)]:
        sa, sb = a.snapshot(), b.snapshot()
        x, y = a.verify(ids[start:start + q], taps), b.verify(ids[start:start + q], taps)
        assert torch.equal(x.logits, y.logits) and torch.equal(x.features, y.features)
        a.rollback(sa, keep)
        b.rollback(sb, keep)
    assert not loads
    assert b.model is model and loads == [1]  # the transformers model only when asked for


def test_eos_ids_come_from_both_configs(tmp_path):
    cfg = LlamaConfig(**{**make_config("llama").to_dict(), "eos_token_id": 3})
    snap = _snapshot(LlamaForCausalLM(cfg).eval(), tmp_path / "m")
    (snap / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert LeanTargetAdapter.from_snapshot(snap).eos_token_ids == {3, 7}


def test_snapshot_tokenizer_matches_transformers_and_the_check_can_fail(tmp_path):
    snap = _snapshot(taught_target("llama"), tmp_path / "m")
    model, ours = open_snapshot(snap)
    ref = char_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, World"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == \
        list(ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ours("abc")["input_ids"] == ref("abc")["input_ids"] and ours.eos_token_id == ref.eos_token_id
    other = char_tokenizer()  # a different template: the check must say no, and the snapshot path step aside
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not verify_against(other, snap) and not eligible(snap)
    assert json.loads((snap / MARKER).read_text())["verified"] is False
    assert verify_against(ref, snap) and eligible(snap)
    (snap / "tokenizer.json").write_text("{not json")  # damaged after the check: step aside, no crash
    assert not eligible(snap)


def test_snapshots_the_path_does_not_cover(tmp_path):
    assert not eligible(_snapshot(taught_target("llama"), tmp_path / "notok", tokenizer=False))
    assert not eligible(_snapshot(taught_target("gemma3"), tmp_path / "gemma"))  # not a lean architecture
    cfg = make_config("llama").to_dict()
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert not eligible(_snapshot(LlamaForCausalLM(LlamaConfig(**cfg)).eval(), tmp_path / "rope"))
    assert not eligible(tmp_path / "missing")
    snap = _snapshot(taught_target("llama"), tmp_path / "partial")
    from safetensors.torch import load_file, save_file

    state = load_file(str(snap / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(snap / "model.safetensors"), metadata={"format": "pt"})
    assert not eligible(snap)  # a missing weight: the transformers path, which reports it


def test_a_bad_rollback_is_refused_before_loading(monkeypatch):
    from dflash_robot.errors import ConfigError
    from dflash_robot.runtime import api

    monkeypatch.setattr(api, "load_draft", lambda *a, **k: pytest.fail("loaded a draft first"))
    with pytest.raises(ConfigError, match="rollback"):
        api.DFlashRuntime.load(rollback="bogus")
