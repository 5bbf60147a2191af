"""A draft placed apart from its target (another dtype here; another device on a GPU box):
the features of newly committed positions are mirrored to it once per step, and the output
is still the target's own."""

import pytest
import torch
from test_sampling import CONFIGS, chi2_pvalue, empirical_joint, exact_joint
from tiny import plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig


def _bf16_draft():
    import copy

    return copy.deepcopy(trained_draft("llama")).to(torch.bfloat16)


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_bf16_draft_for_an_fp32_target_is_lossless(engine):
    rt = DFlashRuntime.from_models(taught_target("llama"), _bf16_draft(), engine=engine)
    mirror = rt.orchestrator.drafter.mirror
    assert mirror.dtype == torch.bfloat16 and rt.target.dtype == torch.float32
    steps = 0
    for s in range(3):
        prompt = random_prompt(12, 60 + s)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=16))
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 40)
        steps += len(res.acceptance_lengths)
    assert mirror.copies == steps  # exactly one copy per drafting step
    assert max(res.acceptance_lengths) >= 2


def test_mirrored_features_are_only_the_new_positions():
    rt = DFlashRuntime.from_models(taught_target("llama"), _bf16_draft())
    drafter = rt.orchestrator.drafter
    sizes = []
    orig = drafter.mirror.__call__

    class Spy:
        device, dtype, copies = drafter.mirror.device, drafter.mirror.dtype, 0

        def __call__(self, x):
            sizes.append(x.shape[0])
            return orig(x)
    drafter.mirror = Spy()
    prompt = random_prompt(12, 61)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=30, block_size=8))
    # the prefill's features once, then each step's committed tokens only
    assert sizes == [len(prompt)] + res.acceptance_lengths[:-1]


def test_sampling_with_a_bf16_draft_follows_the_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_robot.drafts.model import build_draft

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.4,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(cfg).eval()
    draft = build_draft(cfg, 1, 4, mask_token_id=5).eval().to(torch.bfloat16)
    rt = DFlashRuntime.from_models(target, draft)
    counts = empirical_joint(rt, CONFIGS[0], 2000)
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the lent GPU)")
@pytest.mark.parametrize("target_dev,draft_dev", [("cuda", "cpu"), ("cpu", "cuda")])
def test_cross_device_placements(target_dev, draft_dev):
    import copy

    target = copy.deepcopy(taught_target("llama")).to(target_dev)
    draft = copy.deepcopy(trained_draft("llama")).to(draft_dev)
    rt = DFlashRuntime.from_models(target, draft)
    prompt = random_prompt(12, 62)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=16))
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 40)
