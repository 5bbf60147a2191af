"""`prompt_vocab`: a draft vocabulary extended per request with the prompt's tokens outside it
(the target head's rows for them, appended as extra columns), in training and in decoding.
Decoding stays the target's own: greedy output equals the target's greedy decoding, sampling
follows its exact distribution."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_sampling import CONFIGS, PROMPT, V, chi2_pvalue, empirical_joint, exact_joint, sampling_target
from tiny import MASK, VOCAB, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.drafts.checkpoint import load_draft, save_draft
from dflash_robot.drafts.metadata import DraftMetadata
from dflash_robot.drafts.model import build_draft
from dflash_robot.errors import ConfigError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.training.trainer import DraftTrainer, OptimConfig

BASE = [1, 2, 3, 5]


def _prompt_draft(ids=BASE, prompt_vocab=True, layers=1, block=8, src=None):
    target = taught_target("llama")
    d = build_draft(target.config, layers, block, MASK, draft_vocab_size=len(ids))
    if src is not None:
        d.load_state_dict(src.state_dict(), strict=False)
    d.set_vocab(torch.tensor(ids))
    d.metadata = dataclasses.replace(d.metadata, prompt_vocab=prompt_vocab)
    return target, d


def test_prompt_extra_is_the_prompts_tokens_outside_the_vocabulary():
    _, d = _prompt_draft()
    assert d.prompt_extra(torch.tensor([9, 2, 7, 9, 1, 40])).tolist() == [7, 9, 40]
    assert d.prompt_extra(torch.tensor([1, 2])).numel() == 0
    _, plain = _prompt_draft(prompt_vocab=False)
    assert plain.prompt_extra(torch.tensor([9])) is None


def test_extended_logits_are_the_target_heads_columns():
    target, d = _prompt_draft()
    head = target.get_output_embeddings()
    h = torch.randn(5, target.config.hidden_size)
    extra = torch.tensor([7, 40])
    with torch.no_grad():
        assert torch.allclose(d.logits(h, head, extra), head(h)[:, BASE + [7, 40]], atol=1e-5)


@pytest.mark.parametrize("prompt_vocab", [True, False])
def test_training_scores_response_labels_copied_from_the_prompt(prompt_vocab):
    """Labels outside the vocabulary but in the prompt become columns N.. (sorted by id) and carry
    weight; other labels outside it carry none. The loss is the cross-entropy over the target
    head's rows for exactly those columns (computed here from the full head)."""
    target, d = _prompt_draft(prompt_vocab=prompt_vocab)
    tr = DraftTrainer(target, d, OptimConfig(blocks_per_seq=6))
    tr.shape_quantum = 1
    prompt = [7, 9, 2, 40, 9, 11]
    response = [7, 1, 9, 12, 2, 40, 3, 7, 13, 5, 9, 1, 2, 40, 3, 7]
    ids = torch.tensor(prompt + response)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[len(prompt):] = True
    plan = tr.blocks(ids, mask)
    anchors, block_ids, pos, labels, weights, extra = plan
    cols = BASE + ([7, 9, 11, 40] if prompt_vocab else [])
    assert extra.tolist() == cols[4:]
    true = ids[pos.clamp(max=ids.shape[0] - 1)]
    inside = (pos < ids.shape[0]) & mask[pos.clamp(max=ids.shape[0] - 1)]
    for k in range(pos.numel()):
        if k % 8 == 0 or not inside[k]:
            continue
        t = int(true[k])
        assert (float(weights[k]) > 0) == (t in cols), (t, cols)
        if t in cols:
            assert int(labels[k]) == cols.index(t)
    assert any(int(true[k]) in (7, 9, 40) and float(weights[k]) > 0 for k in range(pos.numel())) == prompt_vocab

    loss, w, _ = tr.sequence_loss(ids, mask, blocks=plan)
    with torch.no_grad():
        feats = tr.features(ids, None)
        hidden = tr.block_states(d, feats, block_ids, pos, anchors, 8)
        full = target.get_output_embeddings()(hidden)[:, cols]
        want = (F.cross_entropy(full, labels, reduction="none") * weights).sum()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-5)
    assert float(w) == pytest.approx(float(weights.sum()))


def test_metadata_round_trips_and_is_checked(tmp_path):
    _, d = _prompt_draft()
    save_draft(d, tmp_path / "d", dtype=torch.bfloat16)
    assert load_draft(tmp_path / "d").metadata.prompt_vocab is True
    _, plain = _prompt_draft(prompt_vocab=False)
    save_draft(plain, tmp_path / "p", dtype=torch.bfloat16)
    assert load_draft(tmp_path / "p").metadata.prompt_vocab is False
    cfg = d.metadata.to_config_entries()
    assert DraftMetadata.from_config_dict(cfg).prompt_vocab is True
    with pytest.raises(ConfigError, match="prompt_vocab must be true or false"):
        DraftMetadata.from_config_dict({**cfg, "dflash_config": {**cfg["dflash_config"], "prompt_vocab": "yes"}})
    with pytest.raises(ConfigError, match="needs a draft vocabulary"):
        dataclasses.replace(d.metadata, draft_vocab_size=None)


def test_a_training_steps_loss_is_the_batchs_weighted_mean():
    """`train_step` normalises by the batch's total weight, prompt columns included."""
    target, d = _prompt_draft()
    tr = DraftTrainer(target, d, OptimConfig(blocks_per_seq=4, lr=0.0, warmup_steps=1, total_steps=2))
    batch = []
    for s in range(3):
        p = random_prompt(8, 70 + s)
        ids = torch.tensor(p + p[::-1] + random_prompt(8, 90 + s))
        m = torch.zeros_like(ids, dtype=torch.bool)
        m[8:] = True
        batch.append((ids, m))
    state = tr.gen.get_state()
    plans = [tr.blocks(i, m) for i, m in batch]
    assert all(p[5].numel() for p in plans) and any(float(p[4][p[3] >= 4].sum()) > 0 for p in plans)  # columns N..
    parts = [tr.sequence_loss(i, m, blocks=p) for (i, m), p in zip(batch, plans, strict=True)]
    want = sum(float(lo.detach()) for lo, _, _ in parts) / sum(float(w) for _, w, _ in parts)
    tr.gen.set_state(state)
    assert tr.train_step(batch)["loss"] == pytest.approx(want, rel=1e-5)


# --- decoding -------------------------------------------------------------------------------------

def _vocab_of_outputs(n):
    """The n most frequent ids of the target's greedy outputs on two prompts (not these tests')."""
    counts = torch.zeros(VOCAB)
    for s in range(2):
        for t in plain_greedy_cached("llama", tuple(random_prompt(10, 50 + s)), 40):
            counts[t] += 1
    return counts.argsort(descending=True, stable=True)[:n].tolist()


def test_proposer_logits_are_the_full_heads_columns_for_the_request():
    """With a prompt, the proposer's logits are the full-vocabulary draft's logits at the
    vocabulary's ids followed by the prompt's others (its `vocab_ids`), on the lean forward and on
    the module; without one (or after a reset without one) only the vocabulary's."""
    from dflash_robot.runtime.proposer import DFlashProposer

    src = trained_draft("llama")
    target, d = _prompt_draft(ids=_vocab_of_outputs(8), layers=2, block=16, src=src)
    head, emb = target.get_output_embeddings(), target.get_input_embeddings().weight
    prompt = torch.tensor(random_prompt(12, 7))
    feats = torch.randn(12, d.fc.in_features)
    block = torch.tensor([int(prompt[-1])] + [MASK] * 7)
    for lean in (True, False):
        full, ext = DFlashProposer(src.eval(), emb, head, lean=lean), DFlashProposer(d.eval(), emb, head, lean=lean)
        full.reset()
        want = full.propose(feats, block)
        ext.reset(prompt)
        extra = d.prompt_extra(prompt)
        assert extra.numel() > 0 and torch.equal(ext.vocab_ids, torch.cat([d.vocab_ids, extra]))
        torch.testing.assert_close(ext.propose(feats, block), want[:, ext.vocab_ids], rtol=1e-4, atol=1e-4)
        ext.reset()
        assert torch.equal(ext.vocab_ids, d.vocab_ids)
        torch.testing.assert_close(ext.propose(feats, block), want[:, d.vocab_ids], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree_budget", [0, 12])
def test_greedy_is_the_target_greedy_and_prompt_tokens_are_drafted(monkeypatch, tree_budget):
    import dflash_robot.runtime.strategy as strategy_mod

    target, d = _prompt_draft(ids=_vocab_of_outputs(8), layers=2, block=16, src=trained_draft("llama"))
    rt = DFlashRuntime.from_models(target, d.eval())
    cls = strategy_mod.TreeStrategy if tree_budget else strategy_mod.ChainStrategy
    seen, orig = [], cls.propose

    def spy(self, *a, **k):
        proposal = orig(self, *a, **k)
        seen.append(proposal.tokens[1:].tolist())
        return proposal
    monkeypatch.setattr(cls, "propose", spy)
    base, copied = set(d.vocab_ids.tolist()), 0
    for s in range(4):
        prompt = random_prompt(10, 300 + s)
        seen.clear()
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=30, block_size=8,
                                                                tree_budget=tree_budget))
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 30)
        drafted = {t for block in seen for t in block}
        assert drafted <= base | set(prompt)  # the vocabulary and this request's prompt only
        copied += len(drafted - base)
    assert copied > 0  # the prompt's columns were drafted


def test_sampling_with_prompt_columns_follows_the_target():
    cfg, target = sampling_target()
    draft = build_draft(cfg, 1, 4, mask_token_id=V - 1, draft_vocab_size=2).eval()
    draft.set_vocab(torch.tensor([0, 2]))
    draft.metadata = dataclasses.replace(draft.metadata, prompt_vocab=True)
    rt = DFlashRuntime.from_models(target, draft)
    assert set(PROMPT) - {0, 2}  # the prompt adds columns
    counts = empirical_joint(rt, CONFIGS[0], 2000)
    assert sorted(rt.orchestrator.drafter.vocab_ids.tolist()) == sorted({0, 2} | set(PROMPT))
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) > 1e-3


def test_gguf_round_trip_keeps_prompt_vocab(tmp_path):
    from dflash_robot.drafts.gguf import save_gguf_draft

    _, d = _prompt_draft()
    save_gguf_draft(d, tmp_path / "d.gguf")
    assert load_draft(tmp_path / "d.gguf").metadata.prompt_vocab is True


@pytest.mark.parametrize("tree", [False, True])
def test_measured_costs_draft_over_the_prompt_columns(monkeypatch, tree):
    """The adaptive policy's cost curve times the draft step a request runs: a `prompt_vocab`
    draft is reset with the measuring prompt, so its extra columns are in every timed propose."""
    from dflash_robot.runtime.policy import measure_costs, measure_tree_costs
    from dflash_robot.runtime.proposer import DFlashProposer

    target, d = _prompt_draft(ids=_vocab_of_outputs(8), layers=2, block=16, src=trained_draft("llama"))
    rt = DFlashRuntime.from_models(target, d.eval())
    widths, orig = [], DFlashProposer.propose

    def spy(self, *a, **k):
        logits = orig(self, *a, **k)
        widths.append(logits.shape[-1])
        return logits
    monkeypatch.setattr(DFlashProposer, "propose", spy)
    if tree:
        measure_tree_costs(rt, [4], 8, context=32, min_reps=1, max_reps=1)
    else:
        measure_costs(rt, [1, 4], context=32, min_reps=1, max_reps=1)
    assert widths and all(w > len(d.vocab_ids) for w in widths)
