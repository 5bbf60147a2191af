"""The lean engine built from a converted snapshot (targets/snapshot.py), without transformers'
model object, computes exactly what the engine built from the transformers model computes."""

import json

import pytest
import torch
from tiny import VOCAB, make_config, taught_target
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.snapshot import eligible


def _snapshot(model, path, tokenizer=True):
    model.save_pretrained(str(path))
    if tokenizer:  # eligible() wants a tokenizer.json; its content is not read here
        (path / "tokenizer.json").write_text("{}")
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


def test_snapshots_the_path_does_not_cover(tmp_path):
    assert not eligible(_snapshot(taught_target("llama"), tmp_path / "notok", tokenizer=False))
    assert not eligible(_snapshot(taught_target("gemma3"), tmp_path / "gemma"))  # not a lean architecture
    cfg = make_config("llama").to_dict()
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert not eligible(_snapshot(LlamaForCausalLM(LlamaConfig(**cfg)).eval(), tmp_path / "rope"))
    assert not eligible(tmp_path / "missing")
