"""Parity with the reference package, PyPI `dflash` 0.1.0 (z-lab), on the same weights."""

import time

import dflash.model as zm  # test dependency (scripts/test.sh): pip install --no-deps dflash==0.1.0
import pytest
import torch
from tiny import random_prompt, taught_target, trained_draft

from dflash_robot.drafts.checkpoint import load_draft, save_draft
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig

zm._cuda_time = time.perf_counter  # the reference times with torch.cuda.synchronize


@pytest.fixture(scope="module", params=["qwen3", "llama", "gemma3"])
def pair(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    save_draft(trained_draft(family), path)
    ref = zm.DFlashDraftModel.from_pretrained(str(path)).eval()
    return family, taught_target(family), ref, load_draft(path), path


def test_reference_writes_a_checkpoint_we_load_unchanged(pair, tmp_path):
    _, _, ref, ours, _ = pair
    ref.save_pretrained(str(tmp_path))
    again = load_draft(tmp_path)
    assert again.metadata == ours.metadata
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_draft_logits_agree(pair):
    family, target, ref, ours, _ = pair
    torch.manual_seed(0)
    c, q = 11, 16
    feats = torch.randn(1, c, ours.fc.in_features)
    block = torch.tensor([[5] + [ours.metadata.mask_token_id] * (q - 1)])
    noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
    pos = torch.arange(c + q)[None]
    head = target.get_output_embeddings()
    with torch.no_grad():
        ref_logits = ref.compute_logits(ref(position_ids=pos, noise_embedding=noise, target_hidden=feats), head)
        our_logits = ours.logits(ours(noise, feats, pos[:, c:], pos[:, :c]), head)
    assert (ref_logits - our_logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_tokens_and_acceptance_lengths_agree(pair, block_size):
    family, target, ref, ours, _ = pair
    rt = DFlashRuntime.from_models(target, ours)
    total_acc = []
    for seed in range(3):
        prompt = random_prompt(20, seed)
        ref_out = zm.dflash_generate(ref, target, torch.tensor([prompt]), 40, None,
                                     block_size=block_size, return_stats=True)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=block_size))
        assert res.token_ids == ref_out.output_ids[0, len(prompt):].tolist()
        assert res.acceptance_lengths == ref_out.acceptance_lengths
        total_acc += res.acceptance_lengths
    assert max(total_acc) >= 2  # drafts were really accepted


def test_stop_tokens_agree(pair):
    family, target, ref, ours, _ = pair
    rt = DFlashRuntime.from_models(target, ours)
    prompt = random_prompt(20, 4)
    full = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=16)).token_ids
    stop = full[len(full) // 2]
    ref_out = zm.dflash_generate(ref, target, torch.tensor([prompt]), 40, [stop], block_size=16,
                                 return_stats=True)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=16,
                                                            stop_token_ids=(stop,)))
    assert res.token_ids == ref_out.output_ids[0, len(prompt):].tolist()
    assert res.acceptance_lengths == ref_out.acceptance_lengths
