"""Tree verification (DDTree): lossless greedy and sampling, checked against independent truths
(the target's plain greedy decoding, an exact joint distribution, a heap-based slow tree
builder, and no-cache target forwards of every node's own context)."""

import heapq
import itertools

import numpy as np
import pytest
import torch
from test_sampling import CONFIGS, DEPTH, PROMPT, V, chi2_pvalue, exact_joint, tiny_pair  # noqa: F401
from tiny import (
    find_stop_inside_run,
    plain_greedy_cached,
    random_prompt,
    taught_target,
    trained_draft,
)

import dflash_robot.runtime.strategy as strategy_mod
from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.sampling import sample_from, sampling_probs
from dflash_robot.runtime.tree import build_tree, tree_accept
from dflash_robot.targets.factory import make_target_adapter

N = 40
ENGINES = [("llama", "hf"), ("llama", "lean"), ("qwen3", "hf"), ("qwen3", "lean"), ("gemma3", "hf")]


def runtime(family, engine="hf"):
    return DFlashRuntime.from_models(taught_target(family), trained_draft(family), engine=engine)


# --- lossless greedy -------------------------------------------------------------------------

@pytest.mark.parametrize("family,engine", ENGINES)
@pytest.mark.parametrize("budget,block_size", [(1, 4), (5, 4), (12, 8), (40, 16)])
def test_tree_greedy_equals_plain_greedy(family, engine, budget, block_size):
    rt = runtime(family, engine)
    for seed in (0, 1):
        prompt = random_prompt(20, seed)  # Gemma 3: longer than its sliding window
        cfg = GenerationConfig(max_new_tokens=N, block_size=block_size, tree_budget=budget)
        res = rt.orchestrator.generate(prompt, cfg)
        assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
        assert sum(res.acceptance_lengths) == N - 1 and res.finish_reason == "length"


@pytest.mark.parametrize("family,engine", [("llama", "lean"), ("gemma3", "hf")])
def test_tree_accepts_more_than_chain(family, engine):
    """The equality tests mean something only if trees accept deep, off-argmax paths."""
    rt = runtime(family, engine)
    chain, tree = [], []
    for seed in range(3):
        prompt = random_prompt(20, seed)
        chain += rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8)).acceptance_lengths
        tree += rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8,
                                                                  tree_budget=32)).acceptance_lengths
    assert max(tree) >= 3
    assert sum(tree) / len(tree) > sum(chain) / len(chain)


@pytest.mark.parametrize("family,engine", [("llama", "hf"), ("llama", "lean"), ("gemma3", "hf")])
@pytest.mark.parametrize("block_size", [4, 8])
def test_topk_one_is_the_chain(family, engine, block_size):
    """top-k 1 with budget q - 1 is exactly the chain: same tokens, same acceptance per step."""
    rt = runtime(family, engine)
    for seed in range(2):
        prompt = random_prompt(20, seed)
        chain = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=block_size))
        tree = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=block_size,
                                                                 tree_budget=block_size - 1, tree_topk=1))
        assert tree.token_ids == chain.token_ids
        assert tree.acceptance_lengths == chain.acceptance_lengths


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_stop_token_inside_accepted_tree_path(engine):
    rt = runtime("llama", engine)
    prompt, stop, seen = find_stop_inside_run(rt, N)
    cut = seen.index(stop) + 1
    cfg = GenerationConfig(max_new_tokens=N, block_size=16, tree_budget=24, stop_token_ids=(stop,))
    res = rt.orchestrator.generate(prompt, cfg)
    assert res.token_ids == seen[:cut] == plain_greedy_cached("llama", tuple(prompt), N)[:cut]
    assert res.finish_reason == "stop"
    again = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=16, tree_budget=24))
    assert again.token_ids == plain_greedy_cached("llama", tuple(prompt), N)


@pytest.mark.parametrize("max_new", [0, 1, 2, 3, 17])
def test_tree_max_new_tokens_exact(max_new):
    rt = runtime("llama", "lean")
    prompt = random_prompt(9, 5)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=max_new, block_size=16, tree_budget=20))
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)[:max_new]


# --- lossless sampling -----------------------------------------------------------------------

def _joint(rt, scfg, n, block_size, budget):
    counts = np.zeros((V,) * DEPTH)
    for seed in range(n):
        cfg = GenerationConfig(max_new_tokens=DEPTH, block_size=block_size, sampling=scfg, seed=seed,
                               tree_budget=budget)
        counts[tuple(rt.orchestrator.generate(PROMPT, cfg).token_ids)] += 1
    return counts


@pytest.mark.parametrize("scfg,block_size,budget", [(CONFIGS[0], 4, 6), (CONFIGS[1], 3, 4)],
                         ids=["t1-b4-n6", "t0.8-k4-p0.9-b3-n4"])
def test_tree_sampling_follows_target_distribution(tiny_pair, scfg, block_size, budget):  # noqa: F811
    target, draft = tiny_pair
    rt = DFlashRuntime.from_models(target, draft)
    counts = _joint(rt, scfg, 2000, block_size, budget)
    assert chi2_pvalue(counts, exact_joint(target, scfg)) > 1e-3


def _biased_accept(self, proposal, logits, sampling, gen):
    """A plausible bug: follow a child whenever the target gives it a fair chance (p >= 0.2),
    instead of only when the target's own draw is that child."""
    tree = proposal.tree
    if tree is None:
        return strategy_mod.ChainStrategy.accept(self, proposal, logits, sampling, gen)
    probs = sampling_probs(logits, sampling)
    choice = sample_from(probs, gen)
    p_child = probs[tree.parents, tree.tokens]
    choice = choice.clone()
    choice[tree.parents[p_child >= 0.2]] = tree.tokens[p_child >= 0.2]
    return tree_accept(tree, choice)


def test_tree_statistical_test_detects_a_biased_walk(tiny_pair, monkeypatch):  # noqa: F811
    target, draft = tiny_pair
    monkeypatch.setattr(strategy_mod.TreeStrategy, "accept", _biased_accept)
    rt = DFlashRuntime.from_models(target, draft)
    counts = _joint(rt, CONFIGS[0], 1500, 4, 6)
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) < 1e-3


# --- the tree itself, against a slow heap (DDTree's own procedure) -----------------------------

def heap_tree(logprobs: torch.Tensor, budget: int, topk: int) -> list[tuple[int, ...]]:
    """Best-first growth with a heap: each popped node pushes its next sibling and its first
    child. -> the popped nodes as rank paths, in pop order."""
    depth_max = logprobs.shape[0]
    vals, _ = logprobs.topk(min(topk, logprobs.shape[1]), dim=-1)
    k = vals.shape[1]
    heap = [(-float(vals[0, 0]), (0,))]
    popped = []
    while heap and len(popped) < budget:
        neg, path = heapq.heappop(heap)
        popped.append(path)
        d, r = len(path), path[-1]
        if r + 1 < k:
            sib = path[:-1] + (r + 1,)
            heapq.heappush(heap, (neg + float(vals[d - 1, r]) - float(vals[d - 1, r + 1]), sib))
        if d < depth_max:
            heapq.heappush(heap, (neg - float(vals[d, 0]), path + (0,)))
    return popped


@pytest.mark.parametrize("budget,topk,depth", [(1, 4, 3), (7, 1, 7), (10, 3, 4), (30, 30, 6), (64, 5, 15)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_tree_matches_heap(budget, topk, depth, seed):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(depth, 50, generator=g) * 3, dim=-1)
    ranks = logprobs.argsort(dim=-1, descending=True)
    tree = build_tree(torch.tensor([7]), logprobs, budget, topk)
    m = tree.size
    assert m == 1 + min(budget, sum(min(topk, 50) ** d for d in range(1, depth + 1)))
    # every node: its token path from the root, by parents (checked against the mask below)
    paths = {}
    for j in range(1, m):
        p = int(tree.parents[j])
        assert p < j and int(tree.depths[j]) == int(tree.depths[p]) + 1
        paths[j] = paths.get(p, ()) + (int(tree.tokens[j]),)
    expected = heap_tree(logprobs, budget, topk)
    as_tokens = {tuple(int(ranks[d, r]) for d, r in enumerate(path)) for path in expected}
    assert set(paths.values()) == as_tokens
    assert int(tree.tokens[0]) == 7
    # ancestor mask, slow: walk the parents
    for j in range(m):
        anc, x = {j}, j
        while x != 0:
            x = int(tree.parents[x])
            anc.add(x)
        assert set(torch.nonzero(tree.ancestors[j]).flatten().tolist()) == anc


def test_build_tree_maps_draft_vocabulary():
    logprobs = torch.log_softmax(torch.randn(3, 5), dim=-1)
    vocab_ids = torch.tensor([10, 20, 30, 40, 50])
    plain = build_tree(torch.tensor([1]), logprobs, 6, 3)
    mapped = build_tree(torch.tensor([1]), logprobs, 6, 3, vocab_ids)
    assert torch.equal(mapped.tokens[1:], vocab_ids[plain.tokens[1:]])
    assert torch.equal(mapped.parents, plain.parents)


def test_tree_accept_walks_the_target_choice():
    # root 0 -> {1: tok 5, 2: tok 6}; 1 -> {3: tok 7}; 2 -> {4: tok 8}; 3 -> {5: tok 9}
    from dflash_robot.runtime.tree import DraftTree

    parents = torch.tensor([0, 0, 0, 1, 2, 3])
    tokens = torch.tensor([1, 5, 6, 7, 8, 9])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    anc = torch.eye(6, dtype=torch.bool)
    for _ in range(3):
        anc = torch.eye(6, dtype=torch.bool) | anc[parents]
    tree = DraftTree(tokens, parents, depths, anc, max_depth=3)
    # the target picks 6 at the root, then 8 at node 2, then 11 at node 4 (no child)
    choice = torch.tensor([6, 0, 8, 0, 11, 0])
    acc = tree_accept(tree, choice)
    assert int(acc.num_accepted) == 2
    assert acc.tokens[:3].tolist() == [6, 8, 11] and acc.path[:3].tolist() == [0, 2, 4]
    # a choice that matches no child: nothing accepted, the bonus is the root's choice
    acc = tree_accept(tree, torch.tensor([3, 0, 0, 0, 0, 0]))
    assert int(acc.num_accepted) == 0 and int(acc.tokens[0]) == 3


# --- mask, positions and compaction, against no-cache forwards --------------------------------

@pytest.mark.parametrize("family,engine", ENGINES)
def test_verify_tree_and_compact_against_slow_reference(family, engine):
    model = taught_target(family)
    tgt = make_target_adapter(model, None, engine)
    prompt = random_prompt(20, 3)
    tgt.prefill(torch.tensor(prompt[:-1]), None, 512)
    g = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(5, model.config.vocab_size, generator=g), dim=-1)
    tree = build_tree(torch.tensor(prompt[-1:]), logprobs, 12, 3)
    snap = tgt.snapshot()
    out = tgt.verify_tree(tree.tokens, tree.depths, tree.ancestors, None)
    with torch.no_grad():
        for j in range(tree.size):  # node j's own context: prompt[:-1] + the tokens of its ancestors
            chain = torch.nonzero(tree.ancestors[j]).flatten()
            ctx = prompt[:-1] + tree.tokens[chain].tolist()
            ref = model(input_ids=torch.tensor([ctx]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(out.logits[j], ref, atol=2e-4, rtol=1e-4)
    # keep the deepest path, then decode one more token: equal to a cache built from scratch
    deepest = int(tree.depths.argmax())
    path = torch.nonzero(tree.ancestors[deepest]).flatten().tolist()
    tgt.compact(snap, path)
    assert tgt.seq_len == len(prompt) - 1 + len(path)
    nxt = torch.tensor([3])
    got = tgt.verify(nxt, None).logits[0]
    ctx = prompt[:-1] + tree.tokens[path].tolist() + [3]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ctx]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


# --- refusals and settings -------------------------------------------------------------------

def test_hybrid_target_refuses_a_tree_before_any_work():
    from tiny import HYBRID, MASK

    from dflash_robot.drafts.model import build_draft

    fam = HYBRID[0]
    model = taught_target(fam)
    rt = DFlashRuntime.from_models(model, build_draft(model.config, 1, 4, mask_token_id=MASK))
    calls = []
    rt.orchestrator.target.prefill = lambda *a, **k: calls.append(1)  # must not be reached
    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        list(rt.orchestrator.stream([1, 2, 3], GenerationConfig(max_new_tokens=4, block_size=4, tree_budget=4)))
    assert not calls


@pytest.mark.parametrize("kw", [dict(tree_budget=-1), dict(tree_budget=2.5), dict(tree_topk=0),
                                dict(tree_budget=4, verify_mode="sequential")])
def test_bad_tree_settings(kw):
    with pytest.raises(ConfigError):
        GenerationConfig(**kw)


def test_tree_without_draft_is_refused():
    rt = DFlashRuntime.from_models(taught_target("llama"), None)
    with pytest.raises(ConfigError, match="draft"):
        list(rt.orchestrator.stream([1, 2], GenerationConfig(max_new_tokens=3, tree_budget=4)))


def test_every_budget_and_topk_combination_small_is_lossless():
    """A sweep over small settings on one prompt (cheap): trees of every shape stay lossless."""
    rt = runtime("llama", "lean")
    prompt = random_prompt(15, 9)
    ref = plain_greedy_cached("llama", tuple(prompt), N)
    for budget, topk, q in itertools.product([2, 3, 9], [1, 2, 4], [2, 5]):
        cfg = GenerationConfig(max_new_tokens=N, block_size=q, tree_budget=budget, tree_topk=topk)
        assert rt.orchestrator.generate(prompt, cfg).token_ids == ref, (budget, topk, q)


# --- the adaptive policy's tree arms ---------------------------------------------------------

def test_adaptive_policy_weighs_tree_arms():
    from dflash_robot.runtime.policy import AdaptiveBlockSize

    costs = {q: 1.0 + 0.05 * q for q in range(1, 9)}
    pol = AdaptiveBlockSize(costs, 8, tree_costs={16: 1.6})
    # steps that accept nothing, whichever arm: the tree may be tried while its prior (1.25 x
    # the chain's expectation) looks worth its cost, then the policy settles on the chain
    hist: list[int] = []
    tried = []
    for _ in range(20):
        pol.next_block_size(hist)
        tried.append(pol.next_tree_budget())
        hist.append(1)
    assert tried[-5:] == [0] * 5 and tried.count(16) <= 3
    # a policy whose tree steps commit many tokens comes to prefer the tree
    pol2 = AdaptiveBlockSize(costs, 8, tree_costs={16: 1.6})
    for _ in range(5):
        pol2.observe_tree(16, 6)
    assert pol2.best_plan() == (8, 16)
    # and one whose tree steps commit one token each returns to the chain
    for _ in range(30):
        pol2.observe_tree(16, 1)
    assert pol2.best_plan()[1] == 0


def test_adaptive_with_trees_is_lossless_and_uses_both():
    from dflash_robot.runtime.policy import AdaptiveBlockSize

    rt = runtime("llama", "lean")
    costs = {q: 1.0 + 0.02 * q for q in range(1, 17)}
    pol = AdaptiveBlockSize(costs, 16, tree_costs={24: 1.1})
    budgets = []
    orig = pol.next_tree_budget

    def spy():
        budgets.append(orig())
        return budgets[-1]

    pol.next_tree_budget = spy
    for seed in range(3):
        prompt = random_prompt(20, seed)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N), policy=pol)
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)
    assert 24 in budgets


def test_measure_tree_costs_runs_and_keeps_the_cache_consistent():
    from dflash_robot.runtime.policy import measure_tree_costs

    rt = runtime("llama", "lean")
    costs = measure_tree_costs(rt, [4, 12], 8, context=16, budget_s=0.0, min_reps=1, max_reps=2)
    assert set(costs) == {4, 12} and all(c > 0 for c in costs.values())
    prompt = random_prompt(20, 1)  # the runtime decodes correctly afterwards
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8, tree_budget=12))
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)


# --- review fixes: sliding windows without layer_types, eager attention, settings ----------------

def test_tree_on_a_model_that_slides_every_layer_without_layer_types():
    """Mistral-style: a sliding window in the config and no `layer_types`; the cache slides every
    layer, so the tree mask must be the sliding one (prompt longer than the window)."""
    from tiny import _COMMON, MASK
    from transformers import MistralConfig, MistralForCausalLM

    from dflash_robot.drafts.model import build_draft

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=8)).eval()
    torch.manual_seed(1)
    rt = DFlashRuntime.from_models(model, build_draft(model.config, 1, 8, mask_token_id=MASK))
    from tiny import plain_greedy

    prompt = random_prompt(20, 4)
    ref = plain_greedy(model, prompt, 24)
    for budget in (4, 12):
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=24, block_size=8, tree_budget=budget))
        assert res.token_ids == ref


def test_tree_with_eager_attention_uses_an_additive_mask():
    model = taught_target("llama")
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        rt = DFlashRuntime.from_models(model, trained_draft("llama"), engine="hf")
        prompt = random_prompt(20, 6)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8, tree_budget=16))
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)
    finally:
        model.config._attn_implementation = before


def test_flash_style_attention_refuses_trees():
    model = taught_target("llama")
    before = model.config._attn_implementation
    model.config._attn_implementation = "flex_attention"
    try:
        rt = DFlashRuntime.from_models(model, trained_draft("llama"), engine="hf")
        with pytest.raises(UnsupportedModelError, match="attention implementation"):
            rt.orchestrator.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, block_size=4, tree_budget=4))
    finally:
        model.config._attn_implementation = before


def test_adaptive_tree_policy_refuses_a_fixed_tree_budget():
    from dflash_robot.runtime.policy import AdaptiveBlockSize

    rt = runtime("llama", "lean")
    pol = AdaptiveBlockSize({q: 1.0 for q in range(1, 17)}, 16, tree_costs={8: 1.0})
    with pytest.raises(ConfigError, match="chooses the tree budget"):
        rt.orchestrator.generate([1, 2], GenerationConfig(max_new_tokens=4, tree_budget=8), policy=pol)


def test_tree_prior_never_exceeds_what_a_step_can_commit():
    from dflash_robot.runtime.policy import AdaptiveBlockSize

    pol = AdaptiveBlockSize({q: 1.0 for q in range(1, 17)}, 16, tree_costs={2: 1.0}, prior_accept=0.95)
    assert pol.tree_expected_tokens(2) <= 3.0
