"""oneDNN-packed linears: same products as nn.Linear, and DFlash stays lossless on them."""

import copy

import pytest
import torch
from tiny import plain_greedy, random_prompt, taught_target, trained_draft

from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.targets.fastpath import PackedLinear, pack_linears, supported

pytestmark = pytest.mark.skipif(not supported(), reason="oneDNN linear ops unavailable on this CPU build")


def test_packed_model_matches_and_keeps_ties():
    model = copy.deepcopy(taught_target("llama"))
    x = torch.tensor([random_prompt(30, 0)])
    with torch.no_grad():
        ref = model(input_ids=x).logits
    weights = {n: p for n, p in model.named_parameters()}
    assert pack_linears(model) == 6 * 7 + 1  # q,k,v,o,gate,up,down per layer + lm_head
    assert {n: p for n, p in model.named_parameters()}.keys() == weights.keys()
    with torch.no_grad():
        out = model(input_ids=x).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert isinstance(model.lm_head, PackedLinear)


def test_gradients_fall_back_to_plain_linear():
    lin = torch.nn.Linear(8, 4)
    packed = PackedLinear(lin)
    x = torch.randn(3, 8, requires_grad=True)
    packed(x).sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


def test_non_fp32_linears_are_left_alone():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(m) == 0 and type(m[0]) is torch.nn.Linear


def test_dflash_on_packed_linears_equals_the_packed_target_greedy():
    model = copy.deepcopy(taught_target("llama"))
    draft = copy.deepcopy(trained_draft("llama"))
    rt = DFlashRuntime.from_models(model, draft, fast_linears=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert not isinstance(draft.fc, PackedLinear)  # the draft's lean forward packs its own copies
    for seed in range(2):
        prompt = random_prompt(20, seed)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=30, block_size=8))
        assert res.token_ids == plain_greedy(model, prompt, 30)
