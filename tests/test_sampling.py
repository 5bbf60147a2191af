"""Sampling is lossless: the output distribution equals the target's own sampling distribution."""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

import dflash_robot.runtime.strategy as strategy_mod
from dflash_robot.drafts.model import build_draft
from dflash_robot.runtime.acceptance import Acceptance, rejection_accept
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig, SamplingConfig
from dflash_robot.runtime.sampling import sample_from, sampling_probs

V = 6
PROMPT = [0, 3, 1]
DEPTH = 3  # joint distribution of the first 3 generated tokens: 216 cells


def sampling_target():
    """-> (config, target): the seeded V-token Llama whose exact joint distribution is enumerated."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.4,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return cfg, LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_pair():
    cfg, target = sampling_target()
    cfg.initializer_range = 0.4
    draft = build_draft(cfg, 1, 4, mask_token_id=V - 1).eval()
    return target, draft


@torch.no_grad()
def exact_joint(target, scfg: SamplingConfig) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) under the target's processed sampling distribution."""
    joint = np.zeros((V,) * DEPTH)
    for seq in itertools.product(range(V), repeat=DEPTH):
        p = 1.0
        for k in range(DEPTH):
            logits = target(input_ids=torch.tensor([PROMPT + list(seq[:k])])).logits[0, -1]
            p *= float(sampling_probs(logits, scfg)[seq[k]])
            if p == 0:
                break
        joint[seq] = p
    return joint


def empirical_joint(rt, scfg: SamplingConfig, n: int, block_size: int = 4) -> np.ndarray:
    counts = np.zeros((V,) * DEPTH)
    for seed in range(n):
        cfg = GenerationConfig(max_new_tokens=DEPTH, block_size=block_size, sampling=scfg, seed=seed)
        counts[tuple(rt.orchestrator.generate(PROMPT, cfg).token_ids)] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, with cells of expected count < 5 pooled into one."""
    exp = probs.ravel() * counts.sum()
    obs = counts.ravel()
    assert obs[exp == 0].sum() == 0, "sampled a token the target gives probability 0"
    big = exp >= 5
    f_obs = np.append(obs[big], obs[~big].sum())
    f_exp = np.append(exp[big], exp[~big].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return float(chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue)


N_SAMPLES = 2000
CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("scfg,block_size", [(CONFIGS[0], 4), (CONFIGS[1], 4), (CONFIGS[0], 2)],
                         ids=["t1-b4", "t0.8-k4-p0.9-b4", "t1-b2"])
def test_joint_distribution_matches_target(tiny_pair, scfg, block_size):
    """Block 4 exercises rejections deep in a chain; block 2 also the bonus after a fully
    accepted block (with 3 tokens and block 4 the budget always cuts a full block)."""
    target, draft = tiny_pair
    rt = DFlashRuntime.from_models(target, draft)
    counts = empirical_joint(rt, scfg, N_SAMPLES, block_size)
    assert chi2_pvalue(counts, exact_joint(target, scfg)) > 1e-3


def _biased_accept(draft_tokens, draft_probs, target_probs, generator):
    """The classic bug: take the bonus from p instead of the residual after a rejection."""
    res = rejection_accept(draft_tokens, draft_probs, target_probs, generator)
    a = int(res.num_accepted)
    tokens = res.tokens.clone()
    tokens[a] = sample_from(target_probs[a], generator)
    return Acceptance(res.num_accepted, tokens)


def test_statistical_test_detects_a_biased_sampler(tiny_pair, monkeypatch):
    """Negative control: the same test rejects a sampler that skips the residual."""
    target, draft = tiny_pair
    monkeypatch.setattr(strategy_mod, "rejection_accept", _biased_accept)
    rt = DFlashRuntime.from_models(target, draft)
    counts = empirical_joint(rt, CONFIGS[0], 1500)
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) < 1e-3


def test_rejection_accept_single_position_distribution():
    """Direct check of the acceptance rule on fixed p and q, over many draws."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])  # p_0, p_1
    q = torch.tensor([[0.1, 0.1, 0.2, 0.6]])  # q_1 proposes token 3 often, which p_0 forbids
    counts = np.zeros(4)
    n = 20000
    for _ in range(n):
        d = sample_from(q, g)
        res = rejection_accept(d, q, p, g)
        counts[int(res.tokens[0])] += 1
    assert chisquare(counts[:3], p[0, :3].numpy() * n).pvalue > 1e-3 and counts[3] == 0


def test_bonus_after_all_accepted_follows_last_target_row():
    """q == p makes every draft accepted; the bonus must then be a draw from p_{q-1}."""
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.1, 0.3]])
    counts = np.zeros(3)
    for _ in range(20000):
        d = sample_from(p[:1], g)
        res = rejection_accept(d, p[:1], p, g)
        assert int(res.num_accepted) == 1
        counts[int(res.tokens[1])] += 1
    assert chisquare(counts, p[1].numpy() * 20000).pvalue > 1e-3


def test_sample_from_is_exact():
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.05, 0.0, 0.7, 0.25])
    counts = np.bincount(sample_from(p.expand(40000, 4), g).numpy(), minlength=4)
    assert counts[1] == 0 and chisquare(counts[[0, 2, 3]], p[[0, 2, 3]].numpy() * 40000).pvalue > 1e-3


def test_greedy_draft_onehot_is_also_lossless():
    """A one-hot draft distribution (greedy draft) with residual sampling still gives p."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.3, 0.2], [1 / 3] * 3])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    counts = np.zeros(3)
    for _ in range(20000):
        res = rejection_accept(torch.tensor([1]), q, p, g)
        counts[int(res.tokens[0])] += 1
    assert chisquare(counts, p[0].numpy() * 20000).pvalue > 1e-3


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(top_p=0.5)])
def test_sampling_probs_truncation(kw):
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    probs = sampling_probs(logits, SamplingConfig(temperature=1.0, **kw))
    assert probs[:2].sum() == pytest.approx(1.0) if "top_k" in kw else probs[0] == pytest.approx(1.0)
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
