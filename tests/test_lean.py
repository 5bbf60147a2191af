"""The lean engine (lean.py) computes what transformers' forward computes, and DFlash on it
is lossless against the target's own greedy decoding."""

import copy

import pytest
import torch
from tiny import (
    VOCAB,
    check_stop_inside_run,
    make_config,
    plain_greedy_cached,
    random_prompt,
    taught_target,
    trained_draft,
)
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.targets.factory import make_target_adapter
from dflash_robot.targets.hf import HFTargetAdapter
from dflash_robot.targets.lean import LeanTargetAdapter, supports, unsupported_reason

LEAN = ["llama", "qwen2", "qwen3"]
N = 40


def _close(a, b, tol=1e-4):
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max())


def _compare(model, taps, initial_capacity=16):
    """HF and lean adapters through chunked prefill, verify, crop and regrowth of the cache."""
    hf, lean = HFTargetAdapter(model), LeanTargetAdapter(model, initial_capacity=initial_capacity)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (60,), generator=g)
    a, b = hf.prefill(ids[:21], taps, 8), lean.prefill(ids[:21], taps, 8)
    _close(b.logits, a.logits)
    _close(b.features, a.features)
    for start, q, keep in [(21, 16, 3), (24, 1, 1), (25, 8, 8), (33, 16, 0), (33, 5, 2)]:
        sa, sb = hf.snapshot(), lean.snapshot()
        a, b = hf.verify(ids[start:start + q], taps), lean.verify(ids[start:start + q], taps)
        assert b.logits.shape == a.logits.shape == (q, VOCAB)
        _close(b.logits, a.logits)
        _close(b.features, a.features)
        hf.rollback(sa, keep)
        lean.rollback(sb, keep)
        assert hf.seq_len == lean.seq_len
    assert lean._capacity >= 32  # the 16-slot cache was regrown, contents carried over


@pytest.mark.parametrize("family", LEAN)
def test_logits_and_features_match_transformers(family):
    model = taught_target(family)
    _compare(model, (0, 2, 5))  # 5 = last layer: its feature comes after the final norm


def test_attention_bias_and_llama3_rope_match():
    """Biases on q/k/v/o and Llama 3 RoPE scaling, on a random model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                      attention_bias=True, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16})
    model = LlamaForCausalLM(cfg).eval()
    assert supports(model)
    _compare(model, (1, 2))


@pytest.mark.parametrize("family", LEAN)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_lean_greedy_equals_plain_greedy(family, block_size):
    rt = DFlashRuntime.from_models(taught_target(family), trained_draft(family), engine="lean")
    assert isinstance(rt.target, LeanTargetAdapter)
    for seed, plen in [(1, 1), (2, 20)]:
        prompt = random_prompt(plen, seed)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=block_size))
        assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
        if block_size == 16 and plen == 20:
            assert max(res.acceptance_lengths) >= 3  # multi-token acceptance really happened


def test_lean_sequential_verify_and_chunked_prefill():
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"), engine="lean",
                                   prefill_chunk_size=5)
    prompt = random_prompt(33, 11)
    for mode in ("batched", "sequential"):
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8, verify_mode=mode))
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)


def test_lean_stop_token_inside_accepted_run():
    check_stop_inside_run(DFlashRuntime.from_models(taught_target("qwen3"), trained_draft("qwen3"), engine="lean"),
                          "qwen3", N)


def test_engine_selection_and_refusals():
    llama, gemma = taught_target("llama"), taught_target("gemma3")
    assert isinstance(make_target_adapter(llama, engine="auto"), LeanTargetAdapter)
    assert type(make_target_adapter(llama)) is HFTargetAdapter  # "hf" is the default for caller models
    assert type(make_target_adapter(gemma, engine="auto")) is HFTargetAdapter  # sliding window: HF
    assert "model type 'gemma3_text'" in (unsupported_reason(gemma) or "")
    with pytest.raises(UnsupportedModelError, match="lean engine cannot run"):
        make_target_adapter(gemma, engine="lean")
    with pytest.raises(ConfigError, match="engine must be one of"):
        make_target_adapter(llama, engine="fast")
    hybrid = taught_target("qwen3_5")
    with pytest.raises(UnsupportedModelError, match="stateful"):
        make_target_adapter(hybrid, engine="lean")
    yarn = LlamaForCausalLM(LlamaConfig(**{**make_config("llama").to_dict(),
                                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                               "factor": 4.0,
                                                               "original_max_position_embeddings": 64}}))
    assert "RoPE type 'yarn'" in (unsupported_reason(yarn) or "")


def test_lean_leaves_the_callers_model_alone_and_respects_max_length():
    model = taught_target("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    draft = copy.deepcopy(trained_draft("llama"))  # fast_linears packs the draft in place: not the cached one
    rt = DFlashRuntime.from_models(model, draft, engine="lean", fast_linears=True)
    assert all(type(m).__name__ != "PackedLinear" for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="request too long"):
        rt.orchestrator.generate([1] * 1000, GenerationConfig(max_new_tokens=100, block_size=4))
    assert rt.target._capacity <= 1024  # never beyond max_position_embeddings
