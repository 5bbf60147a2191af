"""Block-size policies: the adaptive policy's decisions on synthetic acceptance histories and
cost curves, and its use inside the decode loop."""

import json
import random

import pytest
import torch
from tiny import plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.errors import ConfigError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.policy import AdaptiveBlockSize, isotonic, load_or_measure_costs, measure_costs

# a verify-cost curve shaped like a CPU forward: a fixed cost plus a per-token one
LINEAR = {q: 0.10 + 0.01 * q for q in range(1, 17)}


def feed(policy, steps):
    """Drive the policy like the orchestrator: committed = steps(q) for each choice.
    Returns every choice made, the one after the last step included."""
    history, choices = [], []
    for _ in range(len(steps)):
        choices.append(policy.next_block_size(history))
        history.append(steps[len(history)](choices[-1]))
    return choices + [policy.next_block_size(history)]


def test_everything_accepted_picks_the_largest_block():
    p = AdaptiveBlockSize(LINEAR)
    choices = feed(p, [lambda q: q] * 10)
    assert choices[-5:] == [16] * 5


def test_nothing_accepted_falls_back_to_block_one():
    """It settles on block 1, re-trying a 2-block now and then as old evidence decays."""
    p = AdaptiveBlockSize(LINEAR)
    last = feed(p, [lambda q: 1] * 30)[-12:]
    assert max(last) <= 2 and last.count(1) >= 8
    assert feed(AdaptiveBlockSize(LINEAR, decay=1.0), [lambda q: 1] * 30)[-5:] == [1] * 5


def test_flat_cost_curve_with_some_acceptance_picks_the_largest_block():
    p = AdaptiveBlockSize({q: 1.0 for q in range(1, 17)})
    assert feed(p, [lambda q: min(q, 2)] * 10)[-1] == 16


def best_q_geometric(alpha, costs):
    return max(costs, key=lambda q: (1 - alpha ** q) / (1 - alpha) / costs[q])


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.85])
def test_matches_the_analytic_optimum_under_geometric_acceptance(alpha):
    """Each draft position is accepted with probability alpha: E[tokens | q] = (1-a^q)/(1-a).
    Steep costs make the optimum interior; the policy, fed many steps, must find it."""
    steep = {q: 0.05 + 0.02 * q ** 1.5 for q in range(1, 17)}
    rng = random.Random(0)

    def step(q):
        n = 1
        while n < q and rng.random() < alpha:
            n += 1
        return n

    p = AdaptiveBlockSize(steep, decay=1.0, prior_weight=0.5)
    # always observe at q=16 so that no position is censored, then ask
    for _ in range(4000):
        p.observe(16, step(16))
    want = best_q_geometric(alpha, steep)
    got = p.best_block_size()
    rate = {q: (1 - alpha ** q) / (1 - alpha) / steep[q] for q in steep}
    assert got == want or rate[got] >= 0.99 * rate[want]


def test_censoring_is_not_a_rejection():
    """Fully accepted blocks of 2 say nothing about position 2 and beyond: a censored
    position is not a failure, so S(2)/S(1) stays as high as the evidence about position 1."""
    p = AdaptiveBlockSize(LINEAR, decay=1.0, prior_accept=0.5)
    for _ in range(20):
        p.observe(2, 2)
    s = p.survival()
    assert s[1] > 0.95 and s[2] / s[1] > 0.9
    q = AdaptiveBlockSize(LINEAR, decay=1.0, prior_accept=0.5)
    for _ in range(20):
        q.observe(3, 2)  # position 2 drafted and rejected every time
    assert q.survival()[2] / q.survival()[1] < 0.2


def test_adapts_when_acceptance_collapses():
    p = AdaptiveBlockSize(LINEAR, decay=0.8)
    history = []
    for _ in range(20):
        history.append(p.next_block_size(history))  # everything accepted
    assert p.next_block_size(history) == 16
    sizes = []
    for _ in range(20):
        q = p.next_block_size(history)
        sizes.append(q)
        history.append(1)  # nothing accepted any more
    assert sizes[0] == 16 and max(sizes[-5:]) <= 2
    assert sizes[:12] == sorted(sizes[:12], reverse=True)  # it backs off steadily


def test_state_carries_over_between_generations():
    p = AdaptiveBlockSize(LINEAR, decay=1.0)
    feed(p, [lambda q: 1] * 30)
    assert p.next_block_size([]) == 1  # a new generation starts from what it learned
    assert AdaptiveBlockSize(LINEAR).next_block_size([]) > 1  # a fresh one does not


@pytest.mark.parametrize("costs", [{}, {0: 1.0}, {1: 0.0}, {1: float("nan")}, {1: -1.0}])
def test_bad_cost_curves(costs):
    with pytest.raises(ConfigError):
        AdaptiveBlockSize(costs)


def test_adaptive_decoding_is_lossless_and_varies_the_block():
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    policy = AdaptiveBlockSize(LINEAR)
    for seed in range(3):
        prompt = random_prompt(20, seed)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=40), policy=policy)
        assert res.token_ids == plain_greedy_cached("llama", tuple(prompt), 40)
    assert len(set(res.block_sizes)) > 1


def test_measured_costs_are_cached(tmp_path, monkeypatch):
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    costs = measure_costs(rt, [1, 4, 16], context=32, min_reps=2, max_reps=2)
    assert set(costs) == {1, 4, 16} and all(c > 0 for c in costs.values())
    cache = tmp_path / "costs.json"
    first = load_or_measure_costs(rt, [1, 2], cache, "k", context=16, min_reps=1, max_reps=1)
    assert json.loads(cache.read_text())["k"]["costs"].keys() == {"1", "2"}
    import dflash_robot.runtime.policy as pol

    monkeypatch.setattr(pol, "measure_costs", lambda *a, **k: pytest.fail("re-measured a cached curve"))
    assert load_or_measure_costs(rt, [1, 2], cache, "k") == first


def test_an_unusable_cost_cache_loses_no_measurement(tmp_path):
    """A cache that holds other JSON, or cannot be written, costs a warning, never the curve."""
    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"))
    fake = lambda runtime, qs, **k: {q: 0.01 * q for q in qs}  # noqa: E731 - a stand-in measurement
    other = tmp_path / "list.json"
    other.write_text("[1, 2]")
    assert load_or_measure_costs(rt, [1, 2], other, "k", measure=fake) == {1: 0.01, 2: 0.02}
    assert json.loads(other.read_text())["k"]["costs"] == {"1": 0.01, "2": 0.02}
    with pytest.warns(UserWarning, match="not written"):
        got = load_or_measure_costs(rt, [1, 2], tmp_path, "k", measure=fake)  # a directory, not a file
    assert got == {1: 0.01, 2: 0.02}


def _isotonic_minmax(v):
    """Independent truth: the isotonic fit at i is max_{j<=i} min_{k>=i} mean(v[j..k])."""
    n = len(v)
    return [max(min(sum(v[j:k + 1]) / (k + 1 - j) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


def test_isotonic_fit_matches_the_min_max_formula():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = (torch.rand(int(torch.randint(1, 12, (1,), generator=g)), generator=g) * 10).tolist()
        fit = isotonic(v)
        assert all(a <= b + 1e-12 for a, b in zip(fit, fit[1:], strict=False))
        assert fit == pytest.approx(_isotonic_minmax(v))
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]


def test_a_noisy_dip_in_the_cost_curve_does_not_attract_the_policy():
    costs = {q: 1 + 0.1 * q for q in range(2, 17)}
    costs[1] = 0.55
    costs[8] = 0.9  # a spuriously cheap measurement
    assert AdaptiveBlockSize(costs, monotone=False).next_block_size([]) == 8
    smoothed = AdaptiveBlockSize(costs)
    assert smoothed.next_block_size([]) == 1  # the prior's rate at the pooled q=8 cost loses to q=1
    assert [smoothed.costs[q] for q in (4, 5, 8, 9)] == pytest.approx([1.4, 1.425, 1.425, 1.9])  # q=5..8 pooled


def test_implausible_curves_are_remeasured_and_entries_expire(tmp_path, monkeypatch):
    import dflash_robot.runtime.policy as pol

    assert pol.implausible({1: 0.1, 2: 0.12, 3: 0.05}) == [3]  # q=3 far cheaper than q=1
    assert pol.implausible({1: 0.1, 2: 0.095, 3: 0.2}) == []  # within noise
    readings = iter([{1: 0.1, 2: 0.02}, {1: 0.09, 2: 0.11}, {1: 0.5, 2: 0.6}])
    calls = []

    def fake(*a, **k):
        calls.append(1)
        return next(readings)
    monkeypatch.setattr(pol, "measure_costs", fake)
    cache = tmp_path / "c.json"
    got = pol.load_or_measure_costs(None, [1, 2], cache, "k")
    assert len(calls) == 2 and got == {1: 0.09, 2: 0.02}  # measured twice, cheaper reading kept
    assert pol.load_or_measure_costs(None, [1, 2], cache, "k") == got and len(calls) == 2  # cached
    assert pol.load_or_measure_costs(None, [1, 2], cache, "k", ttl_s=0) == {1: 0.5, 2: 0.6}  # expired


def test_cost_key_names_version_engine_precision_and_machine():
    import dflash_robot

    rt = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"), engine="lean", precision="int8")
    key = rt.cost_key()
    assert dflash_robot.__version__ in key and "LeanTargetAdapter" in key and "int8" in key
    other = DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama")).cost_key()
    assert "threads" in key and key != other
