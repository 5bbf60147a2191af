"""The draft's lean inference forward (`drafts/lean.py`) against the module it reimplements
(`DFlashDraft.forward` with its context cache), step by step as decoding uses it; and its
quantized weights leave generation lossless (the target verifies every token)."""

import pytest
import torch
from tiny import MASK, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.drafts.lean import LeanDraftForward
from dflash_robot.drafts.model import build_draft
from dflash_robot.runtime.api import DFlashRuntime, draft_precision
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.proposer import DFlashProposer


def _steps(draft, forward, seed=0):
    """Feed 4 steps of (new context rows c, block size q) like a decode loop; -> the block states."""
    g = torch.Generator().manual_seed(seed)
    h = draft.config.hidden_size
    outs = []
    for c, q in ((9, 4), (1, 16), (3, 2), (16, 16), (40, 4)):  # the last one grows the caches past 64
        feats = torch.randn(c, draft.fc.in_features, generator=g)
        noise = torch.randn(q, h, generator=g)
        outs.append(forward(noise, feats))
    return outs


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lean_forward_equals_the_module(family, kernels):
    """On the fused CPU kernels (`targets/kernels.py`, the default) and on the torch path."""
    from dflash_robot.targets import kernels as fused

    if kernels and fused.load() is None:  # a failed build where a compiler is fails tests/test_kernels.py
        pytest.skip(f"fused kernels unavailable: {fused.unavailable_reason()}")
    draft = trained_draft(family)
    cache = draft.new_cache(capacity=8)  # both caches grow on the way

    def module(noise, feats):
        start, c, q = cache.length, feats.shape[0], noise.shape[0]
        pos = torch.arange(start, start + c + q)[None]
        with torch.inference_mode():
            return draft(noise[None], feats[None], pos[:, c:], pos[:, :c], cache=cache)[0]

    lean = LeanDraftForward(draft, capacity=8, kernels=kernels)
    assert (lean._ops is not None) == kernels
    for ref, got in zip(_steps(draft, module), _steps(draft, lean.forward), strict=True):
        assert (ref - got).abs().max().item() <= 2e-5
    assert lean.length == cache.length == 9 + 1 + 3 + 16 + 40
    lean.reset()
    again = _steps(draft, lean.forward)  # a new sequence after reset: the same states
    assert all(torch.equal(a, b) for a, b in zip(again, _steps(draft, LeanDraftForward(draft, kernels=kernels).forward),
                                                  strict=True))


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_quantized_draft_stays_close_and_lossless(precision):
    draft = trained_draft("llama")
    exact = _steps(draft, LeanDraftForward(draft).forward)
    approx = _steps(draft, LeanDraftForward(draft, precision).forward)
    for a, b in zip(exact, approx, strict=True):
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min().item() > 0.98, cos  # close, not equal: the weights changed
        assert not torch.equal(a, b)
    rt = DFlashRuntime.from_models(taught_target("llama"), draft)
    t = rt.orchestrator.drafter
    rt.orchestrator.drafter = DFlashProposer(draft, t.embedding_weight, t.head, precision=precision)
    accepted = 0
    for s in range(3):
        prompt = random_prompt(12, 70 + s)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=8))
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 40)
        accepted += sum(a - 1 for a in res.acceptance_lengths)
    assert accepted > 0  # the quantized draft still drafts tokens the target keeps


def test_the_runtime_picks_the_draft_precision_from_the_target():
    assert draft_precision("fp32") == "fp32" and draft_precision("bf16") == "bf16"
    assert draft_precision("gguf") == draft_precision("int4") == draft_precision("int8") == "int4"
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"), engine="lean", precision="int8")
    assert rt.orchestrator.drafter._lean.precision == "int4"
    odd = build_draft(taught_target("llama").config, 1, 4, mask_token_id=MASK,
                      intermediate_size=40)  # 40 is not a multiple of int4's group of 32
    assert draft_precision("gguf", trained_draft("llama")) == "int4" and draft_precision("gguf", odd) == "int8"


def test_a_draft_the_lean_forward_does_not_cover_runs_the_module():
    """Attention biases (none in z-lab drafts, allowed by the config): the proposer keeps the
    module's forward, and decoding stays lossless."""
    import copy

    from dflash_robot.drafts.lean import LeanDraftForward

    draft = copy.deepcopy(trained_draft("llama"))
    attn = draft.layers[1].self_attn
    attn.o_proj.bias = torch.nn.Parameter(torch.full((attn.o_proj.out_features,), 0.01))
    assert LeanDraftForward.unsupported_reason(draft) == "attention biases"
    rt = DFlashRuntime.from_models(taught_target("llama"), draft)
    assert rt.orchestrator.drafter._lean is None
    prompt = random_prompt(12, 80)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=30, block_size=8))
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 30)


@pytest.mark.parametrize("extra", [{}, {"num_key_value_heads": None}, {"num_key_value_heads": 2, "head_dim": 16},
                                   {"rope_theta": 5e5}, {"rope_parameters": {"type": "default", "rope_theta": 1e4}}])
def test_draft_config_reads_like_transformers_qwen3_config(extra):
    """`DraftConfig` (read without transformers) gives the fields the draft's shapes and RoPE
    come from exactly as transformers' Qwen3Config does, defaults included."""
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    from dflash_robot.drafts.checkpoint import DraftConfig

    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100, **extra}
    ours, ref = DraftConfig(cfg), Qwen3Config(**cfg)
    for name in ("num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "hidden_act",
                 "max_position_embeddings", "intermediate_size"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
