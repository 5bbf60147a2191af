"""The n-gram lookup branch (`runtime/lookup.py`): its proposals against a brute-force search, the
tree it merges into against the paths it should hold, and lossless decoding with it (the
target's plain greedy decoding; the exact joint sampling distribution)."""

import itertools
import random

import numpy as np
import pytest
import torch
from test_sampling import CONFIGS, DEPTH, PROMPT, V, chi2_pvalue, exact_joint, tiny_pair  # noqa: F401
from tiny import find_stop_inside_run, plain_greedy_cached, random_prompt, taught_target, trained_draft

import dflash_robot.runtime.strategy as strategy_mod
from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.runtime.api import DEFAULT_LOOKUP_TOKENS, DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.lookup import NgramLookup, TokenHistory
from dflash_robot.runtime.sampling import sample_from, sampling_probs
from dflash_robot.runtime.tree import attach_chain, build_tree, chain_tree, tree_accept

N = 40
ENGINES = [("llama", "hf"), ("llama", "lean"), ("qwen3", "lean"), ("gemma3", "hf")]


def runtime(family, engine="hf"):
    return DFlashRuntime.from_models(taught_target(family), trained_draft(family), engine=engine)


# --- the lookup itself -----------------------------------------------------------------------

def brute_lookup(hist: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(hist) < n + 1:
            continue
        suffix = hist[-n:]
        for j in range(len(hist) - n - 1, -1, -1):  # the most recent earlier occurrence
            if hist[j:j + n] == suffix:
                return hist[j + n:j + n + k]
    return []


@pytest.mark.parametrize("lo,hi,k", [(1, 1, 3), (1, 3, 5), (2, 4, 7), (3, 3, 1)])
def test_lookup_matches_a_brute_force_search(lo, hi, k):
    rng = random.Random(lo * 100 + hi * 10 + k)
    lookup = NgramLookup(hi, lo)
    found = 0
    for _ in range(300):
        hist = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        got = lookup.propose(torch.tensor(hist), k).tolist()
        assert got == brute_lookup(hist, k, lo, hi), hist
        found += bool(got)
    assert found > 50  # the comparison covers matches, not only misses


def test_lookup_prefers_the_longest_match_and_the_latest():
    hist = torch.tensor([5, 1, 2, 9, 9, 7, 2, 8, 8, 1, 2])
    assert NgramLookup(2, 1).propose(hist, 2).tolist() == [9, 9]  # "1 2" at 1..2, then 9 9
    assert NgramLookup(1, 1).propose(hist, 2).tolist() == [8, 8]  # "2" last seen at 6, then 8 8
    assert NgramLookup(3, 3).propose(hist, 2).tolist() == []  # "8 1 2" never seen before


def test_token_history_appends_in_place():
    h = TokenHistory(torch.tensor([1, 2]), 5)
    h.extend([3])
    h.extend([4, 5])
    assert h.view().tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("kw", [dict(lookup_tokens=-1), dict(lookup_tokens=1.5), dict(lookup_tokens=True),
                                dict(lookup_tokens=65),
                                dict(lookup_tokens=4, lookup_min_ngram=0),
                                dict(lookup_tokens=4, lookup_min_ngram=3, lookup_max_ngram=2),
                                dict(lookup_tokens=4, verify_mode="sequential")])
def test_bad_lookup_settings(kw):
    with pytest.raises(ConfigError):
        GenerationConfig(**kw)


# --- the merged tree -------------------------------------------------------------------------

def live_paths(tree) -> set[tuple[int, ...]]:
    """Every live node's token path from the root (root excluded), checking the tree's invariants
    on the way: parents precede children, depths follow parents, the ancestor rows are exactly
    the paths, and siblings differ."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    live = [True] * tree.size if tree.live is None else tree.live.tolist()
    paths: dict[int, tuple[int, ...]] = {0: ()}
    anc = tree.ancestors
    for j in range(1, tree.size):
        if not live[j]:
            assert anc[j].tolist() == [i == j for i in range(tree.size)]  # attends to itself only
            continue
        p = parents[j]
        assert p < j and live[p] and depths[j] == depths[p] + 1
        paths[j] = paths[p] + (tokens[j],)
        want = anc[p].clone()
        want[j] = True
        assert torch.equal(anc[j], want)
    children: dict[int, list[int]] = {}
    for j in paths:
        if j:
            children.setdefault(parents[j], []).append(tokens[j])
    assert all(len(c) == len(set(c)) for c in children.values()), "siblings must differ"
    assert tree.max_depth >= max(depths)  # the deepest possible node (a tree may stop short of it)
    return set(paths.values()) - {()}


def prefixes(seq) -> set[tuple[int, ...]]:
    return {tuple(seq[:i]) for i in range(1, len(seq) + 1)}


@pytest.mark.parametrize("drop_dead", [False, True])
def test_attach_to_a_chain_is_the_trie_of_both(drop_dead):
    rng = random.Random(0)
    for _ in range(200):
        q = rng.randint(2, 6)
        draft = [rng.randrange(3) for _ in range(q - 1)]
        branch = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        tree = attach_chain(chain_tree(torch.tensor([7] + draft)), torch.tensor(branch), drop_dead=drop_dead)
        assert live_paths(tree) == prefixes(draft) | prefixes(branch), (draft, branch)
        if drop_dead:
            assert tree.size == 1 + len(live_paths(tree))  # no dead rows


@pytest.mark.parametrize("drop_dead", [False, True])
def test_attach_to_a_draft_tree_is_the_trie_of_both(drop_dead):
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        depth, vocab = 4, 4
        logprobs = torch.log_softmax(torch.randn(depth, vocab, generator=g), dim=-1)
        tree = build_tree(torch.tensor([0]), logprobs, budget=9, topk=3)
        before = live_paths(tree)
        branch = torch.randint(0, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
        merged = attach_chain(tree, branch, drop_dead=drop_dead)
        assert live_paths(merged) == before | prefixes(branch.tolist()), trial


def test_tree_accept_never_follows_a_dead_node():
    tree = attach_chain(chain_tree(torch.tensor([0, 1, 2])), torch.tensor([1, 2, 3]))  # rows 3, 4 dead; 5 live
    assert tree.live.tolist() == [True, True, True, False, False, True]
    choice = torch.tensor([1, 2, 3, 9, 9, 9])  # the target: 1, 2, then 3 (only the branch has it)
    acc = tree_accept(tree, choice)
    assert int(acc.num_accepted) == 3 and acc.path.tolist() == [0, 1, 2, 5]
    assert acc.tokens.tolist() == [1, 2, 3, 9]


# --- lossless greedy -------------------------------------------------------------------------

@pytest.mark.parametrize("family,engine", ENGINES)
@pytest.mark.parametrize("block_size,tree_budget,lookup", [(2, 0, 7), (4, 0, 3), (8, 0, 12), (8, 10, 5)])
def test_lookup_greedy_equals_plain_greedy(family, engine, block_size, tree_budget, lookup):
    rt = runtime(family, engine)
    for seed in (0, 1):
        prompt = random_prompt(20, seed)
        cfg = GenerationConfig(max_new_tokens=N, block_size=block_size, tree_budget=tree_budget,
                               lookup_tokens=lookup, lookup_min_ngram=1, lookup_max_ngram=3)
        res = rt.orchestrator.generate(prompt, cfg)
        assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
        assert sum(res.acceptance_lengths) == N - 1 and res.finish_reason == "length"


@pytest.mark.parametrize("family,engine", [("llama", "lean"), ("gemma3", "hf")])
def test_lookup_accepts_more_than_the_draft_alone(family, engine):
    """The equality tests mean something only if lookup branches are taken, deeper than the draft."""
    rt = runtime(family, engine)
    alone, both = [], []
    for seed in range(4):
        prompt = random_prompt(12, seed)
        prompt = prompt + plain_greedy_cached(family, tuple(prompt), N)[:20] + prompt  # text that repeats
        alone += rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=2)).acceptance_lengths
        both += rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=2, lookup_tokens=8,
                                                                  lookup_min_ngram=2)).acceptance_lengths
    assert max(both) > 2  # deeper than the draft's block: only the branch goes there
    assert sum(both) / len(both) > sum(alone) / len(alone)


@pytest.mark.parametrize("max_new", [1, 2, 3, 9])
def test_lookup_deeper_than_the_budget_stops_exactly(max_new):
    rt = runtime("llama", "lean")
    prompt = random_prompt(9, 5)
    prompt = prompt + plain_greedy_cached("llama", tuple(prompt), N)[:12] + prompt
    cfg = GenerationConfig(max_new_tokens=max_new, block_size=2, lookup_tokens=15, lookup_min_ngram=1)
    res = rt.orchestrator.generate(prompt, cfg)
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), N)[:max_new]


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_stop_token_inside_a_lookup_path(engine):
    rt = runtime("llama", engine)
    prompt, stop, seen = find_stop_inside_run(rt, N)
    cut = seen.index(stop) + 1
    cfg = GenerationConfig(max_new_tokens=N, block_size=4, lookup_tokens=10, lookup_min_ngram=1,
                           stop_token_ids=(stop,))
    res = rt.orchestrator.generate(prompt, cfg)
    assert res.token_ids == seen[:cut] == plain_greedy_cached("llama", tuple(prompt), N)[:cut]
    assert res.finish_reason == "stop"


# --- lossless sampling -----------------------------------------------------------------------

def _joint(rt, scfg, n, block_size, lookup, budget=0):
    counts = np.zeros((V,) * DEPTH)
    for seed in range(n):
        cfg = GenerationConfig(max_new_tokens=DEPTH, block_size=block_size, sampling=scfg, seed=seed,
                               tree_budget=budget, lookup_tokens=lookup, lookup_min_ngram=1, lookup_max_ngram=2)
        counts[tuple(rt.orchestrator.generate(PROMPT, cfg).token_ids)] += 1
    return counts


@pytest.mark.parametrize("scfg,block_size,budget", [(CONFIGS[0], 2, 0), (CONFIGS[1], 3, 0), (CONFIGS[0], 3, 3)],
                         ids=["t1-b2", "t0.8-k4-p0.9-b3", "t1-b3-tree3"])
def test_lookup_sampling_follows_target_distribution(tiny_pair, scfg, block_size, budget):  # noqa: F811
    target, draft = tiny_pair
    rt = DFlashRuntime.from_models(target, draft)
    counts = _joint(rt, scfg, 2000, block_size, 4, budget)
    assert chi2_pvalue(counts, exact_joint(target, scfg)) > 1e-3


def test_lookup_statistical_test_detects_a_biased_branch(tiny_pair, monkeypatch):  # noqa: F811
    """A plausible bug: take the lookup branch's first token whenever the target gives it a fair
    chance (p >= 0.2), instead of only when the target's own draw is that token."""
    target, draft = tiny_pair
    unbiased = strategy_mod.ChainStrategy.accept

    def biased(self, proposal, logits, sampling, gen):
        tree = proposal.tree
        if tree is None or tree.live is None:  # no lookup branch this step
            return unbiased(self, proposal, logits, sampling, gen)
        probs = sampling_probs(logits, sampling)
        choice = sample_from(probs, gen).clone()
        for j in range(tree.size - 1, 0, -1):  # the branch's rows come last
            p = int(tree.parents[j])
            if bool(tree.live[j]) and float(probs[p, tree.tokens[j]]) >= 0.2:
                choice[p] = tree.tokens[j]
        return tree_accept(tree, choice)

    monkeypatch.setattr(strategy_mod.ChainStrategy, "accept", biased)
    rt = DFlashRuntime.from_models(target, draft)
    counts = _joint(rt, CONFIGS[0], 1500, 2, 4)
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) < 1e-3


# --- where it runs, and its defaults ---------------------------------------------------------

def test_hybrid_target_refuses_a_lookup_before_any_work():
    from tiny import HYBRID, MASK

    from dflash_robot.drafts.model import build_draft

    model = taught_target(HYBRID[0])
    rt = DFlashRuntime.from_models(model, build_draft(model.config, 1, 4, mask_token_id=MASK))
    calls = []
    rt.orchestrator.target.prefill = lambda *a, **k: calls.append(1)  # must not be reached
    with pytest.raises(UnsupportedModelError, match="lookup"):
        list(rt.orchestrator.stream([1, 2, 3], GenerationConfig(max_new_tokens=4, block_size=4, lookup_tokens=4)))
    assert not calls
    assert rt.config().lookup_tokens == 0  # the default leaves it off there


def test_runtime_config_turns_the_lookup_on_where_trees_verify():
    rt = runtime("llama", "lean")
    assert rt.config().lookup_tokens == DEFAULT_LOOKUP_TOKENS
    assert rt.config(lookup_tokens=0).lookup_tokens == 0
    assert rt.config(verify_mode="sequential").lookup_tokens == 0
    assert rt.config(temperature=0.8).lookup_tokens == 0  # sampled: off unless asked for
    assert rt.config(temperature=0.8, lookup_tokens=3).lookup_tokens == 3
    rt.lookup_tokens, rt.lookup_ngram = 5, (2, 2)
    cfg = rt.config()
    assert (cfg.lookup_tokens, cfg.lookup_min_ngram, cfg.lookup_max_ngram) == (5, 2, 2)
    assert DFlashRuntime.from_models(taught_target("llama"), None).config().lookup_tokens == 0
    for bad in [(5,), (), (3, 2)]:
        with pytest.raises(ConfigError):
            rt.config(lookup_ngram=bad)


def test_every_small_lookup_setting_is_lossless():
    rt = runtime("llama", "lean")
    prompt = random_prompt(15, 9)
    ref = plain_greedy_cached("llama", tuple(prompt), N)
    for lookup, (lo, hi), q in itertools.product([1, 2, 6], [(1, 1), (1, 3), (2, 2)], [2, 5]):
        cfg = GenerationConfig(max_new_tokens=N, block_size=q, lookup_tokens=lookup, lookup_min_ngram=lo,
                               lookup_max_ngram=hi)
        assert rt.orchestrator.generate(prompt, cfg).token_ids == ref, (lookup, lo, hi, q)


def test_dead_rows_decode_like_dropped_ones(monkeypatch):
    """The device path (all branch rows appended, the shared ones dead) decodes exactly as the
    CPU path that drops them: the same tokens and the same acceptance per step."""
    rt = runtime("llama", "lean")
    prompt = random_prompt(12, 3)
    prompt = prompt + plain_greedy_cached("llama", tuple(prompt), N)[:20] + prompt
    cfg = GenerationConfig(max_new_tokens=N, block_size=4, lookup_tokens=8, lookup_min_ngram=1)
    dropped = rt.orchestrator.generate(prompt, cfg)
    attach = strategy_mod.attach_chain
    dead = []

    def keep_dead(tree, chain, drop_dead=False):
        out = attach(tree, chain, drop_dead=False)
        dead.append(int((~out.live).sum()))
        return out

    monkeypatch.setattr(strategy_mod, "attach_chain", keep_dead)
    kept = rt.orchestrator.generate(prompt, cfg)
    assert kept.token_ids == dropped.token_ids == plain_greedy_cached("llama", tuple(prompt), N)
    assert kept.acceptance_lengths == dropped.acceptance_lengths
    assert sum(dead) > 0  # some steps really carried dead rows


def test_a_layer_layout_trees_cannot_mask_is_refused_when_the_adapter_is_built():
    """Mixed sliding/full layers that `layer_types` does not name (or types whose windows differ)
    are found from the config at construction, so a default lookup never meets them mid-generation."""
    from types import SimpleNamespace

    from dflash_robot.targets.hf import HFTargetAdapter

    def problem(types, kinds):
        return HFTargetAdapter._layer_kinds_problem(SimpleNamespace(config=SimpleNamespace(layer_types=types)), kinds)

    assert problem(None, [None, None]) is None and problem(None, [8, 8]) is None
    assert "layer_types" in problem(None, [8, None])
    assert "differ" in problem(["sliding_attention", "sliding_attention", "full_attention"], [8, 4, None])
    assert problem(["sliding_attention", "full_attention"], [8, None]) is None
    assert make_target_adapter_for("gemma3").tree_unsupported is None


def make_target_adapter_for(family):
    from dflash_robot.targets.factory import make_target_adapter

    return make_target_adapter(taught_target(family), engine="hf")
