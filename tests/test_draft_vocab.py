"""A draft vocabulary (EAGLE-3-style d2t/t2d): the draft's head covers N target tokens, the
target still verifies over its full vocabulary, so output stays the target's own."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sampling import CONFIGS, V, chi2_pvalue, empirical_joint, exact_joint, sampling_target
from tiny import MASK, VOCAB, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.drafts.checkpoint import load_draft, save_draft
from dflash_robot.drafts.model import build_draft
from dflash_robot.errors import DraftLoadError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.training.trainer import DraftTrainer, OptimConfig


def _vocab_draft(n: int, seed: int = 0):
    """The trained tiny draft, restricted to n ids: the n most frequent of its target's greedy outputs."""
    src = trained_draft("llama")
    d = build_draft(taught_target("llama").config, 2, 16, MASK, draft_vocab_size=n)
    d.load_state_dict({k: v for k, v in src.state_dict().items()}, strict=False)
    counts = torch.zeros(VOCAB)
    for s in range(2):
        for t in plain_greedy_cached("llama", tuple(random_prompt(10, 50 + s)), 40):
            counts[t] += 1
    d.set_vocab(counts.argsort(descending=True, stable=True)[:n])
    return d.eval()


@pytest.mark.parametrize("n", [4, 32, VOCAB])
def test_greedy_with_a_draft_vocabulary_is_the_target_greedy(n):
    rt = DFlashRuntime.from_models(taught_target("llama"), _vocab_draft(n))
    for s in range(4):
        prompt = random_prompt(10, 50 + s)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40, block_size=16))
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 40)


@pytest.mark.parametrize("tree_budget", [0, 12])
def test_drafted_tokens_come_from_the_vocabulary(monkeypatch, tree_budget):
    """Chain blocks and tree nodes alike draft only ids of the draft vocabulary."""
    import dflash_robot.runtime.strategy as strategy_mod

    d = _vocab_draft(8)
    rt = DFlashRuntime.from_models(taught_target("llama"), d)
    ids = set(d.vocab_ids.tolist())
    seen = []
    cls = strategy_mod.TreeStrategy if tree_budget else strategy_mod.ChainStrategy
    orig = cls.propose

    def spy(self, *a, **k):
        proposal = orig(self, *a, **k)
        seen.extend(proposal.tokens[1:].tolist())
        return proposal
    monkeypatch.setattr(cls, "propose", spy)
    prompt = random_prompt(10, 3)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=30, block_size=8, tree_budget=tree_budget))
    assert seen and set(seen) <= ids
    assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 30)


def test_a_covering_subset_keeps_acceptance():
    """A head over just the tokens the target emits on these prompts drafts as well as the full head."""
    seen = {t for s in range(2) for t in plain_greedy_cached("llama", tuple(random_prompt(10, 50 + s)), 40)}
    rt_full = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    rt_sub = DFlashRuntime.from_models(taught_target("llama"), _vocab_draft(len(seen)))
    cfg = GenerationConfig(max_new_tokens=40, block_size=16)
    def taus(rt):
        runs = [rt.orchestrator.generate(random_prompt(10, 50 + s), cfg) for s in range(2)]
        return [a for r in runs for a in r.acceptance_lengths]
    full, sub = taus(rt_full), taus(rt_sub)
    assert len(seen) < VOCAB - 8  # a real restriction
    assert sum(sub) / len(sub) >= 0.95 * sum(full) / len(full)


def test_sampling_with_a_draft_vocabulary_follows_the_target():
    from test_sampling import PROMPT  # noqa: F401  (the same prompt as the exact joint)
    cfg, target = sampling_target()
    draft = build_draft(cfg, 1, 4, mask_token_id=V - 1, draft_vocab_size=3).eval()
    draft.set_vocab(torch.tensor([0, 2, 3]))  # tokens 1, 4, 5 are never drafted
    rt = DFlashRuntime.from_models(target, draft)
    counts = empirical_joint(rt, CONFIGS[0], 2000)
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) > 1e-3


def test_vocabulary_round_trips_and_corruption_is_refused(tmp_path):
    d = _vocab_draft(16)
    save_draft(d, tmp_path / "d", dtype=torch.bfloat16)
    back = load_draft(tmp_path / "d")
    assert torch.equal(back.vocab_ids, d.vocab_ids) and back.metadata.draft_vocab_size == 16
    assert back.d2t.dtype == torch.int64 and back.t2d.dtype == torch.bool
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state["t2d"] = torch.zeros_like(state["t2d"])
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="disagree"):
        load_draft(tmp_path / "d")


def test_training_with_a_vocabulary_only_scores_covered_labels():
    target = taught_target("llama")
    d = build_draft(target.config, 1, 8, MASK, draft_vocab_size=4)
    d.set_vocab(torch.tensor([1, 2, 3, 5]))
    tr = DraftTrainer(target, d, OptimConfig(blocks_per_seq=4))
    ids = torch.tensor(random_prompt(24, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    loss, w, _ = tr.sequence_loss(ids, mask)
    covered = torch.isin(ids, torch.tensor([1, 2, 3, 5]))
    assert float(w) > 0 if covered[1:].any() else float(w) == 0
    assert d.logits(torch.randn(3, target.config.hidden_size), target.get_output_embeddings()).shape == (3, 4)


def test_resume_keeps_the_checkpoints_vocabulary(tmp_path):
    """A resumed run whose data now ranks tokens differently must keep scoring labels against the
    checkpoint's vocabulary (the d2t it restores), not the one the new run chose."""
    from dflash_robot.training.run import load_checkpoint

    target = taught_target("llama")

    def trainer(ids):
        torch.manual_seed(0)
        d = build_draft(target.config, 1, 8, MASK, draft_vocab_size=4)
        d.set_vocab(torch.tensor(ids))
        return DraftTrainer(target, d, OptimConfig(blocks_per_seq=4))

    a = trainer([1, 2, 3, 5])
    torch.save({"trainer": a.state_dict()}, tmp_path / "ck.pt")
    b = trainer([2, 4, 6, 7])  # what a grown dataset might rank first
    b.load_state_dict(load_checkpoint(tmp_path / "ck.pt")["trainer"])
    assert torch.equal(b.draft.vocab_ids, torch.tensor([1, 2, 3, 5]))
    assert torch.equal(b.label_index, a.label_index)
    ids = torch.tensor(random_prompt(24, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    a.gen.manual_seed(3)
    b.gen.manual_seed(3)
    torch.testing.assert_close(b.sequence_loss(ids, mask)[:2], a.sequence_loss(ids, mask)[:2])
