"""Speculative greedy decoding equals the target's own plain greedy decoding, token for token."""

import pytest
from tiny import check_stop_inside_run, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig

N = 40


def runtime(family, **kw):
    return DFlashRuntime.from_models(taught_target(family), trained_draft(family), **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("prompt_len", [1, 20])
def test_greedy_equals_plain_greedy(family, block_size, prompt_len):
    rt = runtime(family)
    prompt = random_prompt(prompt_len, seed=prompt_len)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=block_size))
    assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
    assert len(res.acceptance_lengths) == len(res.block_sizes)
    assert sum(res.acceptance_lengths) == N - 1  # the first token comes from prefill
    assert res.finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_drafts_really_get_accepted(family):
    """The equality tests above are only meaningful if multi-token acceptance happens."""
    rt = runtime(family)
    acc = []
    for seed in range(3):
        prompt = random_prompt(20, seed)
        acc += rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=16)).acceptance_lengths
    assert max(acc) >= 3 and sum(acc) / len(acc) > 1.2


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_more_families(family):
    rt = runtime(family)
    prompt = random_prompt(12, 3)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8))
    assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sequential_verify_matches(family):
    rt = runtime(family)
    prompt = random_prompt(20, 7)
    cfg = GenerationConfig(max_new_tokens=N, block_size=8, verify_mode="sequential")
    assert rt.orchestrator.generate(prompt, cfg).token_ids == plain_greedy_cached(family, tuple(prompt), N)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_chunked_prefill_long_prompt(family):
    rt = runtime(family, prefill_chunk_size=5)
    prompt = random_prompt(33, 11)  # 7 chunks, and beyond Gemma 3's sliding window
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=16))
    assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stop_token_inside_accepted_run(family):
    check_stop_inside_run(runtime(family), family, N)


@pytest.mark.parametrize("max_new", [0, 1, 2, 3, 17])
@pytest.mark.parametrize("block_size", [1, 16])
def test_max_new_tokens_exact(max_new, block_size):
    rt = runtime("llama")
    prompt = random_prompt(9, 5)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=max_new, block_size=block_size))
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)[:max_new]


def test_stop_on_first_token():
    rt = runtime("llama")
    prompt = random_prompt(9, 5)
    first = plain_greedy_cached("llama", tuple(prompt), N)[0]
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=10, stop_token_ids=(first,)))
    assert res.token_ids == [first] and res.finish_reason == "stop" and res.acceptance_lengths == []


def test_runtime_is_reusable_across_requests():
    rt = runtime("gemma3")
    a, b = random_prompt(20, 1), random_prompt(3, 2)
    for prompt in (a, b, a):
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8))
        assert res.token_ids == plain_greedy_cached("gemma3", tuple(prompt), N)


def test_policy_switching_block_sizes_stays_lossless_and_keeps_context():
    """A policy that alternates 1 and 16: the draft must still see every committed feature."""

    class Alternate:
        max_block_size = 16

        def next_block_size(self, history):
            return 1 if len(history) % 2 else 16

    rt = runtime("llama")
    drafter = rt.orchestrator.drafter
    propose = drafter.propose
    checked = []

    def checking_propose(features, block):
        # the block's first token sits right after everything the draft has seen as context
        checked.append(drafter.context_length + features.shape[0] == rt.target.seq_len)
        return propose(features, block)

    drafter.propose = checking_propose
    prompt = random_prompt(20, 1)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N), policy=Alternate())
    drafter.propose = propose
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)
    assert {1, 16} <= set(res.block_sizes) and len(checked) > 3 and all(checked)
