"""Bad input gets a clear error that names the problem, and nothing is lost."""

import json

import pytest
import torch
from tiny import MASK, taught_target, trained_draft

from dflash_robot.drafts.checkpoint import load_draft, save_draft
from dflash_robot.drafts.metadata import DraftMetadata
from dflash_robot.drafts.model import build_draft
from dflash_robot.errors import (
    ConfigError,
    DraftLoadError,
    IncompatibleDraftError,
    TargetLoadError,
    UnsupportedModelError,
)
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig, SamplingConfig
from dflash_robot.targets.loading import load_target_model


@pytest.fixture
def saved_draft(tmp_path):
    save_draft(trained_draft("llama"), tmp_path / "d")
    return tmp_path / "d"


def test_hidden_size_mismatch():
    cfg = taught_target("llama").config
    cfg2 = type(cfg)(**{**cfg.to_dict(), "hidden_size": 48, "head_dim": 12})
    with pytest.raises(IncompatibleDraftError, match="hidden size: draft 48, target 32"):
        DFlashRuntime.from_models(taught_target("llama"), build_draft(cfg2, 1, 8, MASK))


def test_vocab_mismatch():
    cfg = taught_target("llama").config
    cfg2 = type(cfg)(**{**cfg.to_dict(), "vocab_size": 100})
    with pytest.raises(IncompatibleDraftError, match="vocabulary: draft 100, target 64"):
        DFlashRuntime.from_models(taught_target("llama"), build_draft(cfg2, 1, 8, MASK))


def test_layer_ids_beyond_depth():
    draft = build_draft(taught_target("llama").config, 2, 8, MASK)
    draft.metadata = DraftMetadata(**{**draft.metadata.__dict__, "target_layer_ids": (1, 9)})
    with pytest.raises(IncompatibleDraftError, match=r"target_layer_ids \[9\] are beyond the target's depth"):
        DFlashRuntime.from_models(taught_target("llama"), draft)


def test_mask_token_outside_vocab():
    draft = build_draft(taught_target("llama").config, 1, 8, 64)
    with pytest.raises(IncompatibleDraftError, match="mask_token_id 64 is outside"):
        DFlashRuntime.from_models(taught_target("llama"), draft)


@pytest.mark.parametrize("bs", [0, 17, -1])
def test_block_size_out_of_range(bs):
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    with pytest.raises(ConfigError, match="block size|block_size"):
        list(rt.orchestrator.stream([1, 2], GenerationConfig(max_new_tokens=4, block_size=bs)))


def test_corrupt_safetensors(saved_draft):
    (saved_draft / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DraftLoadError, match="corrupt or truncated"):
        load_draft(saved_draft)


def test_truncated_safetensors(saved_draft):
    w = saved_draft / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftLoadError, match="corrupt or truncated"):
        load_draft(saved_draft)
    assert w.stat().st_size == len(data) // 2  # the file is left as it was


def test_missing_mask_token_id(saved_draft):
    cfg = json.loads((saved_draft / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (saved_draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match="mask_token_id is missing"):
        load_draft(saved_draft)


def test_bad_json_and_missing_paths(saved_draft, tmp_path):
    with pytest.raises(DraftLoadError, match="does not exist"):
        load_draft(tmp_path / "nope")
    (saved_draft / "config.json").write_text("{not json")
    with pytest.raises(DraftLoadError, match="not valid JSON"):
        load_draft(saved_draft)
    with pytest.raises(TargetLoadError, match="does not exist"):
        load_target_model(tmp_path / "no-model")


def test_wrong_tensor_shape(saved_draft):
    cfg = json.loads((saved_draft / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (saved_draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match="has shape"):
        load_draft(saved_draft)


def test_dflash2_draft_refused(saved_draft):
    cfg = json.loads((saved_draft / "config.json").read_text())
    cfg["dflash_config"]["conv_kernel_size"] = 4
    (saved_draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="DFlash-2"):
        load_draft(saved_draft)


@pytest.mark.parametrize("kw,match", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(temperature=float("nan")), "temperature"),
])
def test_sampling_parameters_out_of_range(kw, match):
    with pytest.raises(ConfigError, match=match):
        SamplingConfig(**kw)


def test_bad_prompts_and_budgets():
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=-1)
    with pytest.raises(ConfigError, match="empty"):
        list(rt.orchestrator.stream([], GenerationConfig(max_new_tokens=4)))
    with pytest.raises(ConfigError, match="prompt token ids"):
        list(rt.orchestrator.stream([1, 64], GenerationConfig(max_new_tokens=4)))


def test_oversized_request():
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    with pytest.raises(ConfigError, match="request too long"):
        list(rt.orchestrator.stream([1] * 1000, GenerationConfig(max_new_tokens=100, block_size=8)))


def test_policy_out_of_range_is_refused():
    class Bad:
        max_block_size = 8

        def next_block_size(self, history):
            return 0

    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    with pytest.raises(ConfigError, match="returned 0"):
        list(rt.orchestrator.stream([1, 2], GenerationConfig(max_new_tokens=4), policy=Bad()))


@pytest.mark.parametrize("kw,match", [(dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(seed=-5), "seed")])
def test_generation_config_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(**kw)


def test_unavailable_device():
    from dflash_robot.targets.loading import check_device

    with pytest.raises(ConfigError, match="not available|unknown device"):
        check_device("cuda:0" if not torch.cuda.is_available() else "bogus")
