"""Block-size policies: how many tokens the next iteration verifies.

The orchestrator asks `next_block_size(history)` before every iteration; `history` is
the acceptance lengths so far in this generation (empty at the start of a new one). A
policy never exceeds its `max_block_size`.

- `FixedBlockSize(q)`: always q (q = 1 is plain autoregressive decoding).
- `AdaptiveBlockSize(costs)`: picks the q that maximises expected tokens per second,
  `E[tokens | q] / cost(q)`, from a cost curve (seconds per iteration at block size q,
  measured for this target, draft and machine: `measure_costs`) and the acceptance seen
  so far (a survival estimate that handles the censoring a block size imposes). Given
  `tree_costs` (`measure_tree_costs`), it also weighs tree verification (DDTree) for each
  budget n (at block size min(max, n + 1)), from the tokens those steps committed; the
  orchestrator reads the chosen budget from `next_tree_budget()`.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dflash_robot.errors import ConfigError


@runtime_checkable
class BlockSizePolicy(Protocol):
    max_block_size: int

    def next_block_size(self, history: Sequence[int]) -> int: ...


class FixedBlockSize:
    """Always the same block size; block size 1 is plain autoregressive decoding."""

    def __init__(self, block_size: int):
        self.max_block_size = block_size

    def next_block_size(self, history: Sequence[int]) -> int:
        return self.max_block_size


class AdaptiveBlockSize:
    """Chooses each iteration's block size from recent acceptance and a cost curve.

    Acceptance model: after a step at block size q that committed `n` tokens (n - 1 draft
    tokens accepted), draft positions 1..n-1 "survived"; position n "failed" if n < q, else
    the step says nothing beyond q - 1 (censored). Per-position hazards h(k) are estimated
    from exponentially decayed counts (`decay` per step, so the estimate follows the text),
    each shrunk with `prior_weight` pseudo-steps toward the pooled hazard of all positions
    (itself shrunk toward `1 - prior_accept`), so a position never reached borrows the
    draft's overall acceptance;
    S(k) = prod_{j<=k} (1 - h(j)) is the chance that the first k drafts are accepted, and
    E[tokens | q] = 1 + sum_{k<q} S(k). The policy picks argmax_q E[tokens | q] / cost(q).
    Positions never observed keep the prior, so a long block keeps getting tried while the
    prior says it could pay; the decisions are deterministic given the history.

    State persists across generations (history restarting at empty marks a new one), so a
    long-lived server learns once. `costs[q]` is seconds per iteration at block size q (the
    draft plus the verify plus the loop); only the ratios matter. With `monotone` (default)
    the curve is first replaced by its least-squares non-decreasing fit (`isotonic`), since a
    measured dip (a cheaper q = 8 than q = 4) is timing noise.
    """

    def __init__(self, costs: Mapping[int, float], max_block_size: int | None = None,
                 decay: float = 0.9, prior_accept: float = 0.6, prior_weight: float = 2.0,
                 monotone: bool = True, tree_costs: Mapping[int, float] | None = None,
                 tree_prior_gain: float = 1.25):
        if not costs:
            raise ConfigError("the adaptive policy needs a cost curve with at least one block size")
        qs = sorted(int(q) for q in costs)
        if qs[0] < 1 or any(not (float(costs[q]) > 0 and math.isfinite(float(costs[q]))) for q in qs):
            raise ConfigError(f"cost curve must map block sizes >= 1 to positive seconds, got {dict(costs)}")
        if not 0 < decay <= 1 or not 0 < prior_accept < 1 or prior_weight <= 0:
            raise ConfigError("adaptive policy: need 0 < decay <= 1, 0 < prior_accept < 1, prior_weight > 0")
        self.max_block_size = min(max_block_size or qs[-1], qs[-1])
        kept = [q for q in qs if q <= self.max_block_size]
        values = [float(costs[q]) for q in kept]
        # an iteration never gets cheaper with more tokens: a measured dip is timing noise, and
        # the least-squares non-decreasing fit removes it before it can attract the argmax
        self.costs = dict(zip(kept, isotonic(values) if monotone else values, strict=True))
        self.decay, self.prior_accept, self.prior_weight = decay, prior_accept, prior_weight
        n = self.max_block_size
        self._fail = [0.0] * (n + 1)  # decayed failures at draft position k (1-based)
        self._risk = [0.0] * (n + 1)  # decayed steps that reached position k
        self._chosen: list[tuple[int, int]] = []  # (block size, tree budget) of each step
        self._seen = 0
        # tree arms (DDTree at the largest block size): budget -> seconds per iteration, and the
        # decayed (sum of committed tokens, steps) of the steps each arm ran
        self.tree_costs = {int(n): float(c) for n, c in (tree_costs or {}).items()}
        if any(n < 1 or not (c > 0 and math.isfinite(c)) for n, c in self.tree_costs.items()):
            raise ConfigError(f"tree cost curve must map budgets >= 1 to positive seconds, got {tree_costs}")
        self.tree_prior_gain = tree_prior_gain
        self._tree_stats = {n: [0.0, 0.0] for n in self.tree_costs}
        self._budget = 0

    # -- acceptance statistics

    def observe(self, block_size: int, committed: int) -> None:
        """Record one step: `committed` tokens (accepted drafts + 1) at `block_size`."""
        d = self.decay
        self._fail = [f * d for f in self._fail]
        self._risk = [r * d for r in self._risk]
        accepted = max(0, min(committed - 1, block_size - 1))
        for k in range(1, accepted + 1):
            self._risk[k] += 1
        if accepted < block_size - 1:  # position accepted + 1 was drafted and rejected
            self._risk[accepted + 1] += 1
            self._fail[accepted + 1] += 1

    def survival(self) -> list[float]:
        """S(k) for k = 0..max_block_size - 1 (S(0) = 1)."""
        w = self.prior_weight
        # pooled hazard over all positions (itself shrunk toward the prior), the target that each
        # position's own estimate is shrunk toward: positions never reached borrow the draft's
        # overall acceptance rather than a fixed guess
        h0 = (sum(self._fail) + w * (1 - self.prior_accept)) / (sum(self._risk) + w)
        s, out = 1.0, [1.0]
        for k in range(1, self.max_block_size):
            h = (self._fail[k] + w * h0) / (self._risk[k] + w)
            s *= 1 - h
            out.append(s)
        return out

    def expected_tokens(self, q: int) -> float:
        return sum(self.survival()[:q])

    def best_block_size(self) -> int:
        return self.best_plan()[0]

    def tree_block_size(self, budget: int) -> int:
        """A tree arm's block size: deep enough for its budget as one chain (budget + 1)."""
        return min(self.max_block_size, budget + 1)

    def tree_expected_tokens(self, budget: int) -> float:
        """Tokens per step of a tree arm: its decayed mean, shrunk (prior_weight pseudo-steps)
        toward `tree_prior_gain` x the chain's expectation at the same block size, so an arm not
        yet tried is tried when the chain's own acceptance says a tree could pay."""
        total, steps = self._tree_stats[budget]
        q = self.tree_block_size(budget)  # a step never commits more than q tokens
        prior = min(float(q), self.tree_prior_gain * self.expected_tokens(q))
        return (total + self.prior_weight * prior) / (steps + self.prior_weight)

    def best_plan(self) -> tuple[int, int]:
        """(block size, tree budget; 0 = chain) maximising expected tokens per second."""
        surv = self.survival()
        best, best_rate = (1, 0), -1.0
        for q, c in self.costs.items():
            rate = sum(surv[:q]) / c
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = (q, 0), rate
        for n, c in self.tree_costs.items():
            rate = self.tree_expected_tokens(n) / c
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = (self.tree_block_size(n), n), rate
        return best

    def observe_tree(self, budget: int, committed: int) -> None:
        d = self.decay
        for stats in self._tree_stats.values():
            stats[0] *= d
            stats[1] *= d
        self._tree_stats[budget][0] += committed
        self._tree_stats[budget][1] += 1

    # -- the policy interface

    def next_block_size(self, history: Sequence[int]) -> int:
        if not history:
            self._chosen, self._seen = [], 0
        for n in history[self._seen:]:
            if self._seen < len(self._chosen):
                q, budget = self._chosen[self._seen]
                if budget:
                    self.observe_tree(budget, n)
                else:
                    self.observe(q, n)
            self._seen += 1
        q, self._budget = self.best_plan()
        self._chosen.append((q, self._budget))
        return q

    def next_tree_budget(self) -> int:
        """The tree budget of the step `next_block_size` just planned (0 = chain)."""
        return self._budget


# --- cost curves -------------------------------------------------------------------------

def isotonic(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def measure_costs(runtime: Any, block_sizes: Sequence[int], context: int = 256, budget_s: float = 20.0,
                  min_reps: int = 3, max_reps: int = 15, progress: Callable[[int, int], None] | None = None
                  ) -> dict[int, float]:
    """Median seconds of one decode iteration (draft + verify + rollback) at each block size,
    at about `context` tokens of context, for this runtime's target, draft and machine.

    One prefill of `context` random tokens, then rounds over all block sizes (interleaved, so drift
    on a busy machine hits every q alike) until `budget_s` is spent, with at least `min_reps` rounds.
    The draft is reset with that prompt, as a request resets it, so a `prompt_vocab` draft drafts
    over its extra columns; random tokens leave more of them outside the vocabulary than text does,
    so its measured draft step is an upper bound for prompts of that length.
    `progress(done_rounds, max_reps)` is called after each round."""
    import torch

    from dflash_robot.runtime.config import SamplingConfig
    from dflash_robot.runtime.strategy import ChainStrategy

    orch = runtime.orchestrator
    tgt, drafter = orch.target, orch.drafter
    if drafter is None and any(q > 1 for q in block_sizes):
        raise ConfigError("measuring block sizes > 1 needs a draft")
    context = _measuring_context(tgt, context, (max_reps + 1) * len(block_sizes) + max(block_sizes))
    vocab = tgt.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=g).to(tgt.device)
    tap = drafter.metadata.target_layer_ids if drafter is not None else None
    out = tgt.prefill(prompt, tap, orch.prefill_chunk_size)
    feats = out.features
    if drafter is not None:
        drafter.reset(prompt)  # as a request does: a `prompt_vocab` draft's columns are in the cost

    chain, greedy = ChainStrategy(drafter, vocab), SamplingConfig()

    def iteration(q: int) -> None:
        nonlocal feats
        last = torch.randint(0, vocab, (1,), generator=g).to(tgt.device)
        # a request's draft step (none at q = 1); steady state: the draft projects only the newly
        # committed features
        block = chain.propose(last, feats, q, greedy, g).tokens
        snap = tgt.snapshot()
        v = tgt.verify(block, tap)
        v.logits.argmax(-1).tolist()  # the iteration's one host sync
        tgt.rollback(snap, 1)
        feats = v.features[:1] if v.features is not None else None

    return _median_rounds(block_sizes, iteration, budget_s, min_reps, max_reps, progress)


def _median_rounds(keys: Sequence[int], iteration: Callable[[int], None], budget_s: float, min_reps: int,
                   max_reps: int, progress: Callable[[int, int], None] | None) -> dict[int, float]:
    """Median seconds of `iteration(key)` per key, over rounds that interleave all keys (so drift
    on a busy machine hits every key alike): round 0 is warm-up, then at least `min_reps` rounds
    and more until `budget_s` is spent, at most `max_reps`."""
    times: dict[int, list[float]] = {k: [] for k in keys}
    start = time.perf_counter()
    for rnd in range(max_reps + 1):
        for k in keys:
            t0 = time.perf_counter()
            iteration(k)
            if rnd > 0:
                times[k].append(time.perf_counter() - t0)
        if progress is not None and rnd > 0:
            progress(rnd, max_reps)
        if rnd >= min_reps and time.perf_counter() - start > budget_s:
            break
    return {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}


def measure_tree_costs(runtime: Any, budgets: Sequence[int], max_block_size: int, context: int = 256,
                       budget_s: float = 10.0, min_reps: int = 3, max_reps: int = 15,
                       progress: Callable[[int, int], None] | None = None) -> dict[int, float]:
    """Median seconds of one tree iteration (draft at block size min(max, budget + 1), as
    `AdaptiveBlockSize.tree_block_size`; `build_tree`, one tree verify, acceptance, compaction)
    per node budget, measured like `measure_costs`."""
    import torch

    from dflash_robot.runtime.config import SamplingConfig
    from dflash_robot.runtime.strategy import TreeStrategy

    orch = runtime.orchestrator
    tgt, drafter = orch.target, orch.drafter
    if drafter is None:
        raise ConfigError("measuring tree costs needs a draft")
    context = _measuring_context(tgt, context, (max_reps + 1) * len(budgets) + max(budgets) + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tgt.vocab_size, (context,), generator=g).to(tgt.device)
    tap = drafter.metadata.target_layer_ids
    feats = tgt.prefill(prompt, tap, orch.prefill_chunk_size).features
    drafter.reset(prompt)
    strategies = {n: TreeStrategy(drafter, tgt.vocab_size, n) for n in budgets}
    greedy = SamplingConfig()
    last = prompt[-1:]

    def iteration(n: int) -> None:
        nonlocal feats
        strat = strategies[n]
        prop = strat.propose(last, feats, min(max_block_size, n + 1), greedy, g)
        snap = tgt.snapshot()
        v = strat.verify(tgt, prop, tap, False)
        acc = strat.accept(prop, v.logits, greedy, g)
        torch.cat([acc.num_accepted.view(1), acc.tokens, acc.path]).tolist()  # type: ignore[attr-defined]
        strat.commit(tgt, snap, [0], 1)  # the iteration's one sync above; keep the root, like measure_costs
        feats = v.features[:1] if v.features is not None else None

    return _median_rounds(budgets, iteration, budget_s, min_reps, max_reps, progress)


def _measuring_context(target: Any, context: int, growth: int) -> int:
    """The prefill length for a measurement that then grows the cache by up to `growth` slots,
    capped to fit a target with a fixed maximum length (an ExecuTorch export)."""
    limit = getattr(target, "max_length", None)
    if limit is None or context + growth <= limit:
        return context
    fitted = limit - growth
    if fitted < 16:
        raise ConfigError(f"the target holds {limit} positions, too few to measure the iteration costs "
                          f"({growth} positions beyond a prompt); use a fixed block size")
    return fitted


def implausible(costs: Mapping[int, float], tolerance: float = 0.15) -> list[int]:
    """Block sizes whose cost is more than `tolerance` below a smaller block size's: a
    verify of more tokens cannot be that much cheaper, so such a curve was measured under load."""
    qs = sorted(costs)
    return [q for i, q in enumerate(qs) if any(costs[q] < costs[p] * (1 - tolerance) for p in qs[:i])]


COST_TTL_S = 7 * 24 * 3600


def load_or_measure_costs(runtime: Any, block_sizes: Sequence[int], cache_file: str | Path | None,
                          key: str, ttl_s: float = COST_TTL_S, measure: Callable[..., dict[int, float]] | None = None,
                          **kw: Any) -> dict[int, float]:
    """`measure_costs`, cached in a JSON file under `key` (package version, engine, precision,
    machine, threads, target, draft), for `ttl_s` seconds. A curve that `implausible` flags
    is measured once more and the cheaper reading of each q kept; the policy then fits the
    non-decreasing curve (`isotonic`) to whatever remains. `measure` (default `measure_costs`)
    takes (runtime, keys, **kw); tree budgets use `measure_tree_costs` under their own key."""
    path = Path(cache_file) if cache_file else None
    table: dict[str, Any] = {}
    if path is not None and path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        if not isinstance(table, dict):  # valid JSON, but not this cache's table: measured anew
            table = {}
    entry = table.get(key, {})
    cached = entry.get("costs", {}) if isinstance(entry, dict) else {}
    fresh = isinstance(entry, dict) and time.time() - float(entry.get("measured_at", 0)) < ttl_s
    if fresh and all(str(q) in cached for q in block_sizes):
        return {q: float(cached[str(q)]) for q in block_sizes}
    measure = measure or measure_costs
    costs = measure(runtime, block_sizes, **kw)
    if implausible(costs):
        again = measure(runtime, block_sizes, **kw)
        costs = {q: min(costs[q], again[q]) for q in block_sizes}
    if path is not None:
        table[key] = {"measured_at": time.time(), "costs": {str(q): c for q, c in costs.items()}}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
        except OSError as e:  # the curve is measured and used; only the caching is lost
            warnings.warn(f"cost cache {path} not written ({e}); the curve will be measured again next time",
                          stacklevel=2)
    return costs
