"""The lean engine's weight precisions (targets/quant.py): their kernels, the GGUF block
decoding, and lossless DFlash against the same engine's own autoregressive greedy output."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tiny import random_prompt, taught_target, trained_draft

from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.targets import quant


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_blocks_decode_like_the_gguf_library(qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[qtype])
    w4 = quant.gguf_int4(raw, qtype, 48, 96)
    ref = dequantize(raw, GGMLQuantizationType[qtype])
    np.testing.assert_allclose(w4.dequantize().numpy(), ref, rtol=0, atol=1e-6)
    assert quant.gguf_int4(raw, "Q8_0", 48, 96) is None


def test_q8_0_blocks_decode_like_the_gguf_library():
    w = np.random.default_rng(1).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    w8 = quant.gguf_q8_0(raw, "Q8_0", 48, 96)
    np.testing.assert_array_equal(w8.dequantize().numpy(), dequantize(raw, GGMLQuantizationType.Q8_0))
    np.testing.assert_array_equal(w8.dequantize(slice(3, 5)).numpy(), w8.dequantize()[3:5].numpy())
    assert quant.gguf_q8_0(raw, "Q4_1", 48, 96) is None


def test_unpermute_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(4 * 2 * 3, 64)
    w4 = quant.quantize_int4(w)
    ours = quant.unpermute_rows(w4, 4).dequantize()
    theirs = LlamaTensorProcessor()._reverse_permute_weights(w4.dequantize().numpy(), 4, 4)
    np.testing.assert_array_equal(ours.numpy(), theirs)


def test_int4_quantization_error_is_within_half_a_step():
    w = torch.randn(64, 128)
    w4 = quant.quantize_int4(w)
    step = w4.scale.repeat_interleave(quant.GROUP, dim=1)
    assert bool(((w4.dequantize() - w).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_products_approximate_the_fp32_product(precision):
    w, x = torch.randn(96, 64) / 8, torch.randn(5, 64)
    y = quant.make_linear(w, None, precision)(x)
    rel = float((y - x @ w.t()).norm() / (x @ w.t()).norm())
    assert y.dtype == torch.float32 and rel < {"fp32": 1e-5, "bf16": 1e-2, "int8": 2e-2, "int4": 0.15}[precision]


# "int4-torch": int4 on torch's kernel where this CPU would run the AMX one (DFLASH_ROBOT_AMX=0), so
# both int4 products stay covered on a machine with AMX
ROW_PRECISIONS = ["fp32", "bf16", "int8", "int4", "int4-torch"]


def _precision(precision, monkeypatch):
    if precision == "int4-torch":
        monkeypatch.setenv("DFLASH_ROBOT_AMX", "0")
        return "int4"
    return precision


@pytest.mark.parametrize("precision", ROW_PRECISIONS)
def test_products_are_row_invariant(precision, monkeypatch):
    """The lossless claim rests on this: a row's result does not depend on how many rows are
    multiplied with it (a 16-token verify vs single-token steps); K = 1536 is SmolLM2's MLP
    down projection, where oneDNN's fp32/bf16 products needed the K-split."""
    precision = _precision(precision, monkeypatch)
    w, x = torch.randn(1536, 576) / 20, torch.randn(16, 576)
    f = quant.make_linear(w, None, precision)
    assert torch.equal(f(x), torch.cat([f(x[i:i + 1]) for i in range(16)]))


@pytest.mark.parametrize("precision", ROW_PRECISIONS)
def test_batched_verify_is_bit_identical_to_single_steps(precision, monkeypatch):
    """The whole lean forward, not only its products: logits and features of a 16-token verify
    equal those of 16 single-token steps exactly (float64 attention, K-split products)."""
    precision = _precision(precision, monkeypatch)
    rt = DFlashRuntime.from_models(taught_target("qwen3"), None, engine="lean", precision=precision)
    eng, taps = rt.target, (1, 3)
    eng.prefill(torch.tensor(random_prompt(40, 7)), taps, 512)
    block = torch.tensor(random_prompt(16, 8))
    snap = eng.snapshot()
    batched = eng.verify(block, taps)
    eng.rollback(snap, 0)
    single = eng.verify(block, taps, sequential=True)
    assert torch.equal(batched.logits, single.logits) and torch.equal(batched.features, single.features)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("precision", ROW_PRECISIONS)
def test_dflash_equals_the_same_engines_greedy(family, precision, monkeypatch):
    precision = _precision(precision, monkeypatch)
    rt = DFlashRuntime.from_models(taught_target(family), trained_draft(family), engine="lean", precision=precision)
    assert rt.target.precision == precision
    for s in range(2):
        prompt = random_prompt(12, 40 + s)
        ar = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=1)).token_ids
        for block in (4, 16):
            res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=block))
            assert res.token_ids == ar, (family, precision, block)
        assert max(res.acceptance_lengths) >= 2  # the draft still gets tokens accepted


def test_precision_refusals():
    with pytest.raises(ConfigError, match="precision"):
        DFlashRuntime.from_models(taught_target("llama"), None, engine="lean", precision="int3")
    with pytest.raises(UnsupportedModelError, match="lean engine"):
        DFlashRuntime.from_models(taught_target("llama"), None, engine="hf", precision="int4")
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        DFlashRuntime.from_models(taught_target("llama"), None, engine="lean", precision="gguf")
    with pytest.raises(UnsupportedModelError, match="lean engine"):
        DFlashRuntime.from_models(taught_target("gemma3"), None, engine="auto", precision="int8")


def test_cli_default_precision_matches_the_library():
    from dflash_robot.cli.common import DEFAULT_PRECISION as CLI
    from dflash_robot.runtime.api import DEFAULT_PRECISION as LIB

    assert CLI == LIB
