"""Hinted drafts (`DraftMetadata.hint_ngram`): the block's masks start with an n-gram lookup's
proposal, in training (`objective.hint_blocks`) exactly as in decoding (the orchestrator). Checked:
the training blocks against a brute-force lookup of each anchor's own prefix; the decoding blocks
against the same search over the request's history; the metadata through config.json and GGUF;
lossless greedy (the target's plain greedy decoding) and sampling (the
exact joint distribution) with hints; and `train --block-hints`."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from test_lookup import brute_lookup
from test_sampling import CONFIGS, DEPTH, PROMPT, V, chi2_pvalue, exact_joint, tiny_pair  # noqa: F401
from tiny import MASK, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.drafts.checkpoint import load_draft, save_draft
from dflash_robot.drafts.metadata import DraftMetadata
from dflash_robot.errors import ConfigError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.lookup import NgramLookup
from dflash_robot.training import objective
from dflash_robot.training.trainer import DraftTrainer, OptimConfig

N = 40


def hinted(draft, lo=1, hi=2):
    """A copy of `draft` marked as hinted (the weights are unchanged: the runtime's loop, not the
    draft's skill, is under test)."""
    import copy

    d = copy.deepcopy(draft)
    d.metadata = dataclasses.replace(d.metadata, hint_ngram=(lo, hi))
    return d


# --- training blocks -------------------------------------------------------------------------

@pytest.mark.parametrize("lo,hi,q", [(1, 1, 4), (1, 3, 6), (3, 4, 16), (2, 2, 2)])
def test_training_blocks_hold_each_anchors_own_lookup(lo, hi, q):
    rng = random.Random(lo * 100 + hi * 10 + q)
    filled = 0
    for _ in range(60):
        s = rng.randint(4, 40)
        ids = torch.tensor([rng.randrange(5) for _ in range(s)])
        mask = torch.arange(s) >= rng.randint(1, 3)
        anchors = objective.sample_anchors(mask, 8, torch.Generator().manual_seed(rng.randrange(1000)))
        plain, pos, labels, w = objective.block_inputs(ids, mask, anchors, q, 99, 7.0)
        got, pos2, labels2, w2 = objective.block_inputs(ids, mask, anchors, q, 99, 7.0, hints=NgramLookup(hi, lo))
        assert torch.equal(pos, pos2) and torch.equal(labels, labels2) and torch.equal(w, w2)
        for j, a in enumerate(anchors.tolist()):
            hint = brute_lookup(ids[:a + 1].tolist(), q - 1, lo, hi)  # the prefix decoding has: x_0 .. x_a
            want = [int(ids[a])] + hint + [99] * (q - 1 - len(hint))
            assert got[j * q:(j + 1) * q].tolist() == want, (ids.tolist(), a)
            assert plain[j * q:(j + 1) * q].tolist() == [int(ids[a])] + [99] * (q - 1)
            filled += bool(hint)
    assert filled > 30  # the comparison covers hints, not only empty lookups


def test_a_hint_never_reads_past_its_anchor():
    """Changing every token after the anchor changes the labels, never the block's inputs."""
    ids = torch.tensor([4, 1, 2, 3, 1, 2, 3, 1, 2, 0, 0, 0])
    mask = torch.ones(12, dtype=torch.bool)
    anchors = torch.tensor([5])
    a, *_ = objective.block_inputs(ids, mask, anchors, 6, 99, 7.0, hints=NgramLookup(2, 2))
    other = ids.clone()
    other[6:] = 4
    b, _, labels, _ = objective.block_inputs(other, mask, anchors, 6, 99, 7.0, hints=NgramLookup(2, 2))
    assert a.tolist() == b.tolist() == [2, 3, 1, 2, 99, 99]  # "1 2" last ended at 2: then 3 1 2, to x_5
    assert labels.tolist()[1:] == [4, 4, 4, 4, 4]


def test_the_trainer_fills_hints_for_a_hinted_draft_only():
    model = taught_target("llama")
    draft = trained_draft("llama", block_size=8)
    ids = torch.tensor(random_prompt(6, 1) * 4)
    mask = torch.arange(ids.numel()) >= 6
    for d, want in ((draft, False), (hinted(draft), True)):
        tr = DraftTrainer(model, d, OptimConfig(blocks_per_seq=8))
        anchors, block, *_ = tr.blocks(ids, mask)
        assert bool((block.view(-1, 8)[:, 1:] != MASK).any()) is want


# --- decoding blocks -------------------------------------------------------------------------

class Spy:
    """Wraps a drafter and records every block it is given."""

    def __init__(self, inner):
        self.inner, self.blocks = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, features, block_ids):
        self.blocks.append(block_ids.tolist())
        return self.inner.propose(features, block_ids)


@pytest.mark.parametrize("lookup_tokens", [0, 5])
def test_decoding_blocks_hold_the_requests_own_lookup(lookup_tokens):
    target = taught_target("llama")
    rt = DFlashRuntime.from_models(target, hinted(trained_draft("llama"), 1, 3))
    spy = Spy(rt.orchestrator.drafter)
    rt.orchestrator.drafter = spy
    for strategy in ("chain", "tree"):
        prompt = random_prompt(10, 4)
        prompt = prompt + plain_greedy_cached("llama", tuple(prompt), N)[:12] + prompt
        q = 6
        spy.blocks.clear()
        cfg = GenerationConfig(max_new_tokens=N, block_size=q, tree_budget=8 if strategy == "tree" else 0,
                               lookup_tokens=lookup_tokens, lookup_min_ngram=1)
        res = rt.orchestrator.generate(prompt, cfg)
        committed, filled = 1, 0  # the prefill's token, then each step's
        for block, produced in zip(spy.blocks, res.acceptance_lengths, strict=True):
            hist = list(prompt) + res.token_ids[:committed]
            hint = brute_lookup(hist, len(block) - 1, 1, 3)
            assert block == [hist[-1]] + hint + [MASK] * (len(block) - 1 - len(hint))
            filled += bool(hint)
            committed += produced
        assert filled > 3


ENGINES = [("llama", "hf"), ("llama", "lean"), ("qwen3", "lean"), ("gemma3", "hf")]


@pytest.mark.parametrize("family,engine", ENGINES)
@pytest.mark.parametrize("block_size,tree_budget,lookup", [(2, 0, 0), (4, 0, 0), (8, 0, 6), (8, 10, 0)])
def test_hinted_greedy_equals_plain_greedy(family, engine, block_size, tree_budget, lookup):
    rt = DFlashRuntime.from_models(taught_target(family), hinted(trained_draft(family)), engine=engine)
    for seed in (0, 1):
        prompt = random_prompt(14, seed)
        prompt = prompt + plain_greedy_cached(family, tuple(prompt), N)[:10] + prompt  # text that repeats
        cfg = GenerationConfig(max_new_tokens=N, block_size=block_size, tree_budget=tree_budget, lookup_tokens=lookup,
                               lookup_min_ngram=1)
        res = rt.orchestrator.generate(prompt, cfg)
        assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
        assert sum(res.acceptance_lengths) == N - 1


@pytest.mark.parametrize("scfg,block_size,budget", [(CONFIGS[0], 3, 0), (CONFIGS[1], 4, 0), (CONFIGS[0], 3, 3)],
                         ids=["t1-b3", "t0.8-k4-p0.9-b4", "t1-b3-tree3"])
def test_hinted_sampling_follows_target_distribution(tiny_pair, scfg, block_size, budget):  # noqa: F811
    target, draft = tiny_pair
    rt = DFlashRuntime.from_models(target, hinted(draft, 1, 1))
    counts = np.zeros((V,) * DEPTH)
    for seed in range(2000):
        cfg = GenerationConfig(max_new_tokens=DEPTH, block_size=block_size, sampling=scfg, seed=seed,
                               tree_budget=budget)
        counts[tuple(rt.orchestrator.generate(PROMPT, cfg).token_ids)] += 1
    assert chi2_pvalue(counts, exact_joint(target, scfg)) > 1e-3


# --- the metadata ----------------------------------------------------------------------------

def test_hint_ngram_goes_through_config_gguf_and_back(tmp_path):
    from dflash_robot.cli import main

    draft = hinted(trained_draft("llama"), 3, 4)
    save_draft(draft, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["hint_ngram"] == [3, 4]
    assert load_draft(tmp_path / "d").metadata.hint_ngram == (3, 4)
    assert main(["convert", str(tmp_path / "d"), str(tmp_path / "d.gguf"), "--outtype", "f32"]) == 0
    assert load_draft(tmp_path / "d.gguf").metadata == draft.metadata
    save_draft(trained_draft("llama"), tmp_path / "plain")  # a draft without hints writes no key
    assert "hint_ngram" not in json.loads((tmp_path / "plain" / "config.json").read_text())["dflash_config"]
    assert load_draft(tmp_path / "plain").metadata.hint_ngram is None


@pytest.mark.parametrize("bad", [[3, 2], [0, 1], [3], [3, 4, 5], "3,4", [1.5, 2], [True, 2]])
def test_bad_hint_ngram_is_refused(bad):
    cfg = {"num_hidden_layers": 1, "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1],
                                                     "hint_ngram": bad}}
    with pytest.raises(ConfigError, match="hint_ngram"):
        DraftMetadata.from_config_dict(cfg)


# --- train --block-hints ---------------------------------------------------------------------

def test_block_hints_are_set_inherited_and_dropped(tmp_path):
    from tiny import char_tokenizer

    from dflash_robot.drafts.model import build_draft
    from dflash_robot.training.run import TrainRun, _make_draft

    model, tok = taught_target("llama"), char_tokenizer()
    src = build_draft(model.config, 1, 8, MASK)
    save_draft(src, tmp_path / "plain")
    save_draft(hinted(src, 3, 4), tmp_path / "hinted")
    pool = [(torch.tensor([1, 5, 6, 7]), torch.arange(4) > 0, ("shard-00000", 0, 4))]
    for init, flag, want in (("plain", None, None), ("plain", "2,3", (2, 3)), ("hinted", None, (3, 4)),
                             ("hinted", "none", None), ("hinted", "1,1", (1, 1))):
        run = TrainRun(out=str(tmp_path / "run"), data="unused", init=f"draft:{tmp_path / init}", layers=1,
                       block_size=8, mask_token_id=MASK, block_hints=flag)
        assert _make_draft(run, model, tok, pool, pool)[0].metadata.hint_ngram == want, (init, flag)


@pytest.mark.parametrize("spec,msg", [("3", "expected MIN,MAX"), ("4,3", "1 <= MIN <= MAX"), ("0,2", "1 <= MIN <= MAX"),
                                      ("a,b", "expected MIN,MAX")])
def test_bad_block_hints_are_refused_before_any_slow_work(tmp_path, spec, msg):
    from dflash_robot.training.run import TrainRun, train

    run = TrainRun(out=str(tmp_path / "run"), data=str(tmp_path / "no-data"), target="/nonexistent-target",
                   block_hints=spec)
    with pytest.raises(ConfigError, match=msg):
        train(run)
    assert not (tmp_path / "run").exists()
