"""The decode loop (paper Sec. 3.1): prefill, then draft -> verify -> accept -> roll back.

`RuntimeOrchestrator.stream` is the one step generator; `generate`, the CLI, the
benchmark and the server are thin layers over it. Block size 1 skips the draft, so the
autoregressive baseline is this same loop.

One iteration, with q the block size and `last` the last committed token:
1. block = [last, mask * (q-1)]; the draft turns the features committed since the last
   iteration plus the block into logits for positions 1..q-1 and drafts tokens.
2. The target verifies the block in one forward (logits [q, V], features [q, n*H]).
3. Acceptance (pure tensors, `acceptance.py`) gives a and tokens [q]; stop tokens and the
   token budget are folded in on the device.
4. ONE device->host transfer reads [a, first_stop, tokens...] back.  <- the only sync
5. The target cache keeps `produced` block tokens; their features feed the next draft.
A `TreeStrategy` (`strategy.py`, DDTree) replaces steps 1-3 and 5 with a draft tree verified under
an ancestor mask, acceptance along the target's own choices, and a compaction of the accepted
path's cache entries; the transfer in step 4 then also carries the path.
With `lookup_tokens`, step 1 also looks the last committed n-gram up in the request's own tokens
(on the host, where step 4 brought them; `lookup.py`) and adds what followed it as one more tree
branch, so that iteration verifies and commits as a tree.
A hinted draft (`DraftMetadata.hint_ngram`, trained so: `train --block-hints`) has the block's
masks in step 1 start with its own n-gram lookup's proposal, looked up the same way.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.runtime.lookup import NgramLookup, TokenHistory
from dflash_robot.runtime.policy import BlockSizePolicy, FixedBlockSize
from dflash_robot.runtime.proposer import DraftAdapter
from dflash_robot.runtime.sampling import next_token
from dflash_robot.runtime.strategy import ChainStrategy, TreeStrategy
from dflash_robot.targets.base import TargetAdapter


@dataclass
class StepEvent:
    """What one step committed. The prefill step has acceptance_length None."""

    tokens: list[int]
    acceptance_length: int | None  # accepted drafts + bonus, after the budget cap and stop cut
    block_size: int
    draft_s: float  # host wall time; on an asynchronous device (CUDA) the draft/verify split is
    verify_s: float  # approximate, since the loop adds no sync to measure it
    finish_reason: str | None = None  # "stop" | "length" | None while running


@dataclass
class GenerationResult:
    token_ids: list[int]
    acceptance_lengths: list[int]
    block_sizes: list[int]
    finish_reason: str
    prompt_tokens: int
    time_to_first_token_s: float
    decode_s: float  # after the first token
    draft_s: float
    verify_s: float
    extra: dict = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first over the time after the first."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class RuntimeOrchestrator:
    def __init__(self, target: TargetAdapter, drafter: DraftAdapter | None = None,
                 prefill_chunk_size: int = 512):
        if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise ConfigError(f"prefill_chunk_size must be an integer >= 1, got {prefill_chunk_size!r}")
        self.target = target
        self.drafter = drafter
        self.prefill_chunk_size = prefill_chunk_size

    def _policy(self, cfg: GenerationConfig, policy: BlockSizePolicy | None) -> BlockSizePolicy:
        if self.drafter is None:
            if (cfg.block_size or 1) != 1:
                raise ConfigError("block size > 1 needs a draft")
            return FixedBlockSize(1)
        meta = self.drafter.metadata
        if policy is not None:
            meta.check_block_size(policy.max_block_size)
            return policy
        return FixedBlockSize(meta.check_block_size(cfg.block_size or meta.block_size))

    def stream(self, prompt_ids: Sequence[int] | torch.Tensor, cfg: GenerationConfig,
               policy: BlockSizePolicy | None = None) -> Generator[StepEvent, None, None]:
        """Yield one StepEvent per step until a stop token or max_new_tokens."""
        policy = self._policy(cfg, policy)
        plans_trees = bool(getattr(policy, "tree_costs", None))  # an adaptive policy that may pick trees
        if plans_trees and (cfg.tree_budget or cfg.verify_mode != "batched"):
            raise ConfigError("this adaptive policy chooses the tree budget itself and verifies in one batched "
                              "forward; leave tree_budget at 0 and verify_mode 'batched'")
        # refuses a tree the target cannot verify, before any work
        strategies = {0: self._strategy(cfg.tree_budget, cfg.tree_topk)}
        lookup = self._lookup(cfg)
        if plans_trees:
            strategies.update({n: self._strategy(n) for n in policy.tree_costs})  # type: ignore[attr-defined]
        tgt = self.target
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=tgt.device).flatten()
        if ids.numel() == 0:
            raise ConfigError("the prompt is empty; at least one token is needed")
        if int(ids.max()) >= tgt.vocab_size or int(ids.min()) < 0:
            raise ConfigError(f"prompt token ids must be in [0, {tgt.vocab_size})")
        limit = getattr(tgt, "max_length", None)
        # the last position ever verified is P + max_new_tokens - 1 (q <= remaining + 1)
        if limit is not None and ids.numel() + cfg.max_new_tokens > limit:
            raise ConfigError(f"request too long: {ids.numel()} prompt + {cfg.max_new_tokens} new tokens "
                              f"exceeds the target's {limit} positions")
        if cfg.max_new_tokens == 0:
            return
        gen = torch.Generator(device=tgt.device)
        gen.manual_seed(cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**63))
        sampling = cfg.sampling
        tap = self.drafter.metadata.target_layer_ids if self.drafter is not None and policy.max_block_size > 1 \
            else None
        stops = torch.tensor(sorted(set(cfg.stop_token_ids)) or [-1], device=tgt.device)

        t0 = time.perf_counter()
        out = tgt.prefill(ids, tap, self.prefill_chunk_size)
        first = next_token(out.logits[-1], sampling, gen)
        last = first.view(1)
        first_id = int(first)  # sync: the first token is emitted now (TTFT)
        generated = 1
        done = "stop" if first_id in cfg.stop_token_ids else ("length" if cfg.max_new_tokens == 1 else None)
        yield StepEvent([first_id], None, 1, 0.0, time.perf_counter() - t0, done)
        if done:
            return
        tokens = None
        hinter = None
        if tap is not None and self.drafter is not None and self.drafter.metadata.hint_ngram is not None:
            lo, hi = self.drafter.metadata.hint_ngram
            hinter = NgramLookup(hi, lo)
        if lookup is not None or hinter is not None:
            tokens = TokenHistory(ids, cfg.max_new_tokens)
            tokens.extend([first_id])
        features = out.features
        if self.drafter is not None and tap is not None:
            self.drafter.reset(ids)
        history: list[int] = []
        while True:
            remaining = cfg.max_new_tokens - generated
            q = min(self._checked_block_size(policy, history), remaining + 1)
            strategy = strategies[policy.next_tree_budget()] if plans_trees else strategies[0]  # type: ignore[attr-defined]
            t_start = time.perf_counter()
            branch = hint = None
            if lookup is not None and q > 1:  # on the host: the committed tokens came back last step
                # a branch may be deeper than the draft's block, not than the token budget
                found = lookup.propose(tokens.view(), min(cfg.lookup_tokens, remaining))  # type: ignore[union-attr]
                branch = found.to(tgt.device, non_blocking=True) if found.numel() else None
            if hinter is not None and q > 1:
                found = hinter.propose(tokens.view(), q - 1)  # type: ignore[union-attr]
                hint = found if found.numel() else None
            proposal = strategy.propose(last, features, q, sampling, gen, branch, hint)
            t_draft = time.perf_counter()
            snap = tgt.snapshot()
            vout = strategy.verify(tgt, proposal, tap, cfg.verify_mode == "sequential")
            acc = strategy.accept(proposal, vout.logits, sampling, gen)
            # one transfer: [a, first stop index within the committed run, tokens..., (tree) path...]
            width = acc.tokens.shape[0]  # q, or a tree's depth + 1 (a lookup branch may be deeper)
            is_stop = torch.isin(acc.tokens, stops)
            first_stop = torch.where(is_stop.any(), is_stop.to(torch.int64).argmax(), width)
            path = getattr(acc, "path", None)
            parts = [acc.num_accepted.view(1), first_stop.view(1), acc.tokens]
            host = torch.cat(parts if path is None else parts + [path]).tolist()
            a, stop_at, toks = host[0], host[1], host[2:2 + width]
            path_host = None if path is None else host[2 + width:]
            produced = min(a + 1, remaining)
            reason = "length" if produced == remaining else None
            if stop_at < produced:
                produced, reason = stop_at + 1, "stop"
            strategy.commit(tgt, snap, path_host, produced)
            generated += produced
            history.append(produced)
            if tokens is not None:
                tokens.extend(toks[:produced])
            if tap is not None:
                new = vout.features[:produced] if path is None else vout.features[path[:produced]]  # type: ignore[index]
                # at q == 1 the draft did not run: keep the features it has not consumed yet
                features = new if q > 1 else torch.cat([features, new])  # type: ignore[list-item]
            last = acc.tokens[produced - 1:produced]
            yield StepEvent(toks[:produced], produced, q, t_draft - t_start,
                            time.perf_counter() - t_draft, reason)
            if reason:
                return

    def _lookup(self, cfg: GenerationConfig) -> NgramLookup | None:
        """The request's n-gram lookup, or None; refused before any work where the target cannot
        verify the tree it makes."""
        if not cfg.lookup_tokens or self.drafter is None:
            return None
        reason = getattr(self.target, "tree_unsupported", "this target adapter has no tree verification")
        if reason is not None:
            raise UnsupportedModelError(f"an n-gram lookup branch (verified as a tree) on "
                                        f"{type(self.target).__name__}: {reason}")
        return NgramLookup(cfg.lookup_max_ngram, cfg.lookup_min_ngram)

    def _strategy(self, tree_budget: int, tree_topk: int | None = None) -> ChainStrategy:
        if not tree_budget:
            return ChainStrategy(self.drafter, self.target.vocab_size)
        reason = getattr(self.target, "tree_unsupported", "this target adapter has no tree verification")
        if reason is not None:
            raise UnsupportedModelError(f"tree verification (tree budget {tree_budget}) on "
                                        f"{type(self.target).__name__}: {reason}")
        return TreeStrategy(self.drafter, self.target.vocab_size, tree_budget, tree_topk)

    @staticmethod
    def _checked_block_size(policy: BlockSizePolicy, history: list[int]) -> int:
        q = policy.next_block_size(history)
        if not isinstance(q, int) or not 1 <= q <= policy.max_block_size:
            raise ConfigError(f"block-size policy {type(policy).__name__} returned {q!r}, outside "
                              f"1..{policy.max_block_size}")
        return q

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, cfg: GenerationConfig,
                 policy: BlockSizePolicy | None = None,
                 should_stop: Callable[[list[int]], bool] | None = None) -> GenerationResult:
        """Decode to the end and collect the events' tokens and statistics. `should_stop(new_tokens)`
        is called with each event's tokens; True ends the generation there (finish reason "stop")."""
        t0 = time.perf_counter()
        tokens: list[int] = []
        acc: list[int] = []
        sizes: list[int] = []
        ttft = draft_s = verify_s = 0.0
        reason = "length"
        n_prompt = int(torch.as_tensor(prompt_ids).numel())
        gen = self.stream(prompt_ids, cfg, policy)
        try:
            for ev in gen:
                if ev.acceptance_length is None:
                    ttft = time.perf_counter() - t0
                else:
                    acc.append(ev.acceptance_length)
                    sizes.append(ev.block_size)
                    draft_s += ev.draft_s
                    verify_s += ev.verify_s
                tokens.extend(ev.tokens)
                reason = ev.finish_reason or reason
                if should_stop is not None and should_stop(ev.tokens):
                    reason = "stop"
                    break
        finally:
            gen.close()  # frees the engine at once, also when stopped early
        total = time.perf_counter() - t0
        return GenerationResult(tokens, acc, sizes, reason, n_prompt, ttft,
                                max(total - ttft, 0.0), draft_s, verify_s)
