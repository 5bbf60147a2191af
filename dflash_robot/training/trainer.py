"""The training step: frozen target features, the block objective, AdamW with warm-up + cosine.

Target features come from a `FeatureStore` (bf16 on disk, read with pread, written once per
sample by `training.data`) when one is given and holds the sample; otherwise from one no-grad
target forward, optionally kept in memory (`cache_features=True`). With a draft vocabulary
(`DFlashDraft.vocab_ids`) the head and the loss cover only those N tokens: labels outside
it get weight 0 and count as misses in the acceptance estimate. A `prompt_vocab` draft's head
also covers each sequence's prompt tokens outside that vocabulary (`DraftTrainer.columns`), as
decoding covers a request's.

With `distill > 0` the labels are also soft: the target's own next-token distribution at each
position (`TargetTail`, over the draft vocabulary, renormalised, as EAGLE-3 and SpecForge
train), mixed with the hard label as `(1 - distill) * CE(label) + distill * CE(target's p)`.
See docs/TRAINING.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.runtime.lookup import NgramLookup
from dflash_robot.training import objective


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum: int = 1
    blocks_per_seq: int = 64
    seed: int = 0
    bf16_autocast: bool = False
    anchors: str = "uniform"  # or "on-policy": train where chain decoding starts blocks (`blocks`)
    distill: float = 0.0  # weight of the target's soft labels (`TargetTail`); 0: hard labels only
    copy_weight: float = 1.0  # loss weight of labels that continue a bigram of their context (objective.copy_positions)


def target_features(model: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """input_ids [S] -> features [S, n*H] = concat(hidden_states[id + 1]) (no grad)."""
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=[i + 1 for i in layer_ids],
                    use_cache=False, logits_to_keep=1)
        return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


class TargetTail:
    """The distillation teacher: the target's next-token logits at every position of a sequence,
    from its tapped features.

    The draft's deepest tap is the output of target layer t, so the target's layers t+1 .. L-1,
    its final norm and its head turn it into the target's own logits at a fraction of a full
    forward (2 of SmolLM2's 30 layers for the tap at 27). That shortcut is used when those layers
    are plain causal attention, called with the mask the target builds for itself; a tail with
    sliding-window, linear-attention or SSM layers, or a target laid out otherwise, gets the full
    forward instead. The logits go through the draft's head (`DFlashDraft.logits`: the draft
    vocabulary's rows, the target's output multiplier and soft-capping)."""

    def __init__(self, model: Any, layer_ids: Sequence[int]):
        self.model = model
        self.cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.decoder: Any = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.start = max(layer_ids) + 1
        self.tap = list(layer_ids).index(max(layer_ids))
        n = self.cfg.num_hidden_layers
        types = getattr(self.cfg, "layer_types", None)
        plain = (all(t == "full_attention" for t in types[self.start:n]) if types is not None
                 else not getattr(self.cfg, "sliding_window", None))
        self.shortcut = (plain and self.start < n and self.decoder is not None
                         and all(hasattr(self.decoder, a) for a in ("layers", "norm", "rotary_emb")))

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """-> [S, H] the target's final (normed) hidden states, fp32."""
        if not self.shortcut:
            dec = self.decoder if self.decoder is not None else self.model.base_model
            return dec(input_ids=input_ids[None], use_cache=False).last_hidden_state[0].float()
        from transformers.masking_utils import create_causal_mask

        hsz = self.cfg.hidden_size
        h = feats[:, self.tap * hsz:(self.tap + 1) * hsz].float()[None]
        pos = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(self.cfg, h, None, None, position_ids=pos)
        rope = self.decoder.rotary_emb(h, pos)
        for layer in self.decoder.layers[self.start:self.cfg.num_hidden_layers]:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return self.decoder.norm(h)[0]


def pad_rows(x: torch.Tensor, quantum: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, ...] -> [n rounded up to a multiple of `quantum`, ...], the new rows zero (or `fill`
    repeated, fill [1, ...]); x itself when nothing is added or x is empty."""
    extra = -x.shape[0] % quantum
    if extra == 0 or x.shape[0] == 0:
        return x
    tail = fill.expand(extra, *x.shape[1:]) if fill is not None else x.new_zeros(extra, *x.shape[1:])
    return torch.cat([x, tail])


def lr_lambda(cfg: OptimConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


class DraftTrainer:
    """Trains `draft` against a frozen `target` (a transformers causal LM)."""

    def __init__(self, target: Any, draft: DFlashDraft, cfg: OptimConfig,
                 ddp_module: nn.Module | None = None, cache_features: bool = False, store: Any = None):
        self.target = target.eval().requires_grad_(False)
        self.draft = draft.train()
        self.module = ddp_module or draft  # the module whose forward is called (DDP wrapper or draft)
        self.cfg = cfg
        self.embed = target.get_input_embeddings().weight
        self.head = target.get_output_embeddings()
        self.opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.response_tokens_seen = 0  # loss-masked tokens of every batch so far, kept by checkpoints
        self.cache_features = cache_features
        self.feature_cache: dict[object, torch.Tensor] = {}
        self.store = store  # training.data.FeatureStore or None
        # The draft's matmul shapes follow each sequence's length and its count of weighted rows.
        # oneDNN compiles a kernel per shape and caches 1,024 (ONEDNN_PRIMITIVE_CACHE_CAPACITY);
        # sequences of ~300 distinct lengths overflow it, and recompiling cost ~0.3 s of a 1.5 s step
        # on the CPU box (docs/TRAINING.md, session 14). So both are padded to a multiple of this:
        # context rows past the sequence (no block sees them) and repeated rows weighted 0. (The
        # block rows are not: a sequence has fewer than `blocks_per_seq` anchors only when its
        # response is that short.)
        self.shape_quantum = 64
        self.label_index: torch.Tensor | None = None  # [V] -> draft-vocab column, -1 outside it
        self._drawn = [0, 0]  # anchors drawn on-policy, all anchors drawn (this step)
        self.teacher = TargetTail(target, draft.metadata.target_layer_ids) if cfg.distill > 0 else None
        self._index_labels()

    def _index_labels(self) -> None:
        """Label -> column of the draft's vocabulary (its d2t), whenever that vocabulary is set."""
        ids = self.draft.vocab_ids
        self.label_index = None
        if ids is not None:
            dev = self.device
            self.label_index = torch.full((self.embed.shape[0],), -1, dtype=torch.long, device=dev)
            self.label_index[ids.to(dev)] = torch.arange(ids.shape[0], device=dev)

    @property
    def hints(self) -> NgramLookup | None:
        """The lookup whose proposal fills the blocks' masks, for a draft marked so
        (`DraftMetadata.hint_ngram`), in training and in the chain replay as in decoding."""
        h = self.draft.metadata.hint_ngram
        return None if h is None else NgramLookup(h[1], h[0])

    @property
    def device(self) -> torch.device:
        """Where the draft (and the target, which `train` loads first) computes."""
        return self.draft.fc.weight.device

    def _on_device(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples are read into CPU tensors; every entry point moves them (a no-op on the CPU)."""
        return input_ids.to(self.device), loss_mask.to(self.device)

    def features(self, input_ids: torch.Tensor, key: object | None) -> torch.Tensor:
        """Target features of a sequence, from the in-memory cache when `key` was seen before."""
        if key is not None and key in self.feature_cache:
            return self.feature_cache[key]
        if self.store is not None and isinstance(key, tuple) and len(key) == 3:
            stored = self.store.get(*key)
            if stored is not None:
                return stored.to(self.device, self.draft.fc.weight.dtype)
        feats = target_features(self.target, input_ids, self.draft.metadata.target_layer_ids)
        if key is not None and self.cache_features:
            self.feature_cache[key] = feats
        return feats

    def columns(self, input_ids: torch.Tensor, loss_mask: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One sequence's head columns -> (label -> column map [V] or None for the full
        vocabulary, extra ids [E] or None). With a draft vocabulary a label outside it maps to -1
        (no loss); a `prompt_vocab` draft also gets the sequence's prompt tokens (those before its
        first response token) outside that vocabulary as columns N.., as decoding appends them
        to the head for a request (`DFlashProposer.reset`)."""
        extra = None
        if self.label_index is None or not self.draft.metadata.prompt_vocab:
            return self.label_index, extra
        resp = torch.nonzero(loss_mask, as_tuple=True)[0]
        extra = self.draft.prompt_extra(input_ids[:int(resp[0]) if resp.numel() else input_ids.shape[0]])
        assert extra is not None
        index = self.label_index.clone()
        index[extra.to(index.device)] = torch.arange(extra.numel(), device=index.device) + self.draft.d2t.shape[0]
        return index, extra

    def blocks(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, key: object | None = None
               ) -> tuple[torch.Tensor, ...]:
        """Anchors for one sequence and its blocks: (anchors, block ids, positions, labels as
        head columns, weights (zero for a label outside them), the extra ids of `columns`, an
        empty tensor if none).

        Anchors are drawn uniformly from the response; with `cfg.anchors == "on-policy"` they are
        replaced by where decoding would go next from them (`objective.successor_anchors`: one
        no-grad draft forward over the uniform anchors' blocks), topped up with uniform ones to
        `blocks_per_seq`. Decoding starts its blocks right after a miss, positions the uniform
        draw under-represents."""
        meta = self.draft.metadata
        input_ids, loss_mask = self._on_device(input_ids, loss_mask)
        anchors = objective.sample_anchors(loss_mask, self.cfg.blocks_per_seq, self.gen).to(input_ids.device)
        if self.cfg.anchors == "on-policy" and anchors.numel():
            nxt = self.successors(input_ids, loss_mask, anchors, key)
            extra = objective.sample_anchors(loss_mask, self.cfg.blocks_per_seq, self.gen).to(input_ids.device)
            extra = extra[~torch.isin(extra, nxt)][:max(0, self.cfg.blocks_per_seq - nxt.numel())]
            anchors = torch.cat([nxt, extra]).sort().values
            self._drawn[0] += nxt.numel()
        self._drawn[1] += anchors.numel()
        ids, pos, labels, weights = objective.block_inputs(
            input_ids, loss_mask, anchors, meta.training_block_size, meta.mask_token_id, meta.loss_decay,
            self.cfg.copy_weight, self.hints)
        index, prompt_cols = self.columns(input_ids, loss_mask)
        if index is not None:  # columns of the draft vocabulary (and prompt); outside them: no loss
            cols = index[labels]
            weights = weights * (cols >= 0)
            labels = cols.clamp(min=0)
        return anchors, ids, pos, labels, weights, prompt_cols if prompt_cols is not None else labels.new_zeros(0)

    def sequence_loss(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, key: object | None = None,
                      blocks: tuple[torch.Tensor, ...] | None = None, soft_labels: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence -> (weighted CE sum, weight sum, expected acceptance); `blocks` from
        `self.blocks` (default: drawn now). `soft_labels=False` skips the distillation teacher
        (the loss is then the hard-label one): for callers that want only the acceptance."""
        meta = self.draft.metadata
        q = meta.training_block_size
        input_ids, loss_mask = self._on_device(input_ids, loss_mask)
        anchors, ids, pos, labels, weights, cols = blocks if blocks is not None else self.blocks(
            input_ids, loss_mask, key)
        extra = cols if cols.numel() else None
        if anchors.numel() == 0:
            zero = self.draft.fc.weight.sum() * 0
            return zero, zero.detach(), torch.tensor(float("nan"))
        feats = self.features(input_ids, key)
        kept = torch.nonzero(weights > 0, as_tuple=True)[0]
        n_kept = kept.numel()
        rows = pad_rows(kept, self.shape_quantum, fill=kept[:1])  # repeats of a kept row, weighted 0
        row_w = torch.cat([weights[kept], weights.new_zeros(rows.numel() - n_kept)])
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            hidden = self.block_states(self.module, feats, ids, pos, anchors, q)
            logits = self.draft.logits(hidden[rows], self.head, extra)
        if self.teacher is not None and soft_labels:
            with torch.no_grad():  # the target's distribution for position p comes from its state at p - 1
                t_hidden = self.teacher.hidden(input_ids, feats)
                t_logits = self.draft.logits(t_hidden[pos[rows] - 1], self.head, extra)
            loss_sum, w_sum = objective.distill_cross_entropy(logits, t_logits, labels[rows], row_w, self.cfg.distill)
        else:
            loss_sum, w_sum = objective.weighted_cross_entropy(logits, labels[rows], row_w)
        with torch.no_grad():
            top1 = torch.zeros_like(labels, dtype=torch.bool)
            top1[kept] = logits[:n_kept].argmax(-1) == labels[kept]
            correct = (top1 | ~(pos < input_ids.shape[0])).view(-1, q)[:, 1:]
            acc = objective.expected_acceptance(correct)
        return loss_sum, w_sum, acc

    def block_states(self, module: nn.Module, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                     anchors: torch.Tensor, q: int) -> torch.Tensor:
        """The draft (`module`: itself or its DDP wrapper) on one sequence's blocks (ids, pos [N*q])
        over its features [S, ...] with `objective.block_mask` -> final-normed states [N*q, H]. The
        context is padded to a multiple of `shape_quantum` rows; they come after every anchor, so
        no block sees them."""
        ctx = pad_rows(feats, self.shape_quantum)
        mask = objective.block_mask(anchors, ctx.shape[0], q)[None, None]
        noise = F.embedding(ids, self.embed)[None] * self.draft.metadata.input_embedding_scale
        ctx_pos = torch.arange(ctx.shape[0], device=ctx.device)[None]
        return module(noise, ctx[None], pos[None], ctx_pos, mask=mask)[0]

    @torch.no_grad()
    def chain_acceptance(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, key: object | None = None,
                         chunk: int = 64, block_size: int | None = None) -> list[int]:
        """Greedy chain decoding replayed on one held-out sequence -> tokens gained per verify step.

        The sequence is the target's own greedy output, so a replay is what decoding it would do:
        the first response token comes from the prefill; then from anchor a the draft proposes
        a+1 .. a+q-1, the target keeps the leading run that matches the sequence plus one token
        of its own, and the next anchor is a + run + 1, until the sequence ends (no credit past
        it). The list is what `generate --json` reports as `acceptance_lengths`. Every anchor's run
        is computed in parallel (it depends only on the true prefix), then the walk picks the
        anchors decoding would visit. `block_size` is the decoding block size (default: the
        training block size); a draft may decode at any size, like the runtime's `--block-size`."""
        out = self.response_runs(input_ids, loss_mask, key, chunk, block_size)
        if out is None:
            return []
        runs, first = out
        n = runs.shape[0]
        a, gains = first, []
        while a < n - 1:
            gains.append(min(int(runs[a]) + 1, n - 1 - a))
            a += gains[-1]
        return gains

    @torch.no_grad()
    def response_runs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, key: object | None = None,
                      chunk: int = 64, block_size: int | None = None) -> tuple[torch.Tensor, int] | None:
        """The draft's run (`block_runs`) at every anchor of a sequence's response, in chunks of
        `chunk` blocks -> (runs [n], first) with n the response's end (no credit past it) and first
        its start (runs before it are 0); None when the response has fewer than 2 tokens."""
        meta = self.draft.metadata
        q = block_size or meta.training_block_size
        if not 2 <= q <= meta.training_block_size:
            raise ValueError(f"block size {q}: from 2 to the training block size ({meta.training_block_size})")
        input_ids, loss_mask = self._on_device(input_ids, loss_mask)
        resp = torch.nonzero(loss_mask, as_tuple=True)[0]
        if resp.numel() < 2:
            return None
        first, n = int(resp[0]), int(resp[-1]) + 1  # the response's span: no credit for tokens after it
        feats = self.features(input_ids, key)[:n]
        input_ids, loss_mask = input_ids[:n], loss_mask[:n]
        runs = torch.zeros(n, dtype=torch.long)
        candidates = torch.arange(first, n - 1, device=input_ids.device)
        for i in range(0, candidates.numel(), chunk):
            anchors = candidates[i:i + chunk]
            runs[anchors.cpu()] = self.block_runs(input_ids, loss_mask, feats, anchors, q).cpu()
        return runs, first

    def successors(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                   key: object | None = None) -> torch.Tensor:
        """Where greedy chain decoding with this draft starts its next block after a block at each
        of `anchors` (sorted, distinct; `objective.successor_anchors`)."""
        input_ids, loss_mask = self._on_device(input_ids, loss_mask)
        runs = self.block_runs(input_ids, loss_mask, self.features(input_ids, key), anchors,
                               self.draft.metadata.training_block_size)
        return objective.successor_anchors(anchors, runs, loss_mask)

    @torch.no_grad()
    def block_runs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, feats: torch.Tensor,
                   anchors: torch.Tensor, q: int) -> torch.Tensor:
        """-> [N] how many tokens after each anchor the draft's block-q proposal gets right in a
        row (greedy, against the sequence; a non-response token or the sequence end stops it)."""
        meta, n, n_a = self.draft.metadata, input_ids.shape[0], anchors.numel()
        # padded shapes, as in `sequence_loss`: repeats of the last anchor (blocks never see each
        # other; their runs are dropped)
        anchors = pad_rows(anchors, max(1, self.shape_quantum // 4), fill=anchors[-1:])
        ids, pos, labels, _ = objective.block_inputs(input_ids, loss_mask, anchors, q, meta.mask_token_id,
                                                     meta.loss_decay, hints=self.hints)
        index, extra = self.columns(input_ids, loss_mask)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            hidden = self.block_states(self.draft, feats, ids, pos, anchors, q)  # not the DDP wrapper
            pred = self.draft.logits(hidden, self.head, extra).argmax(-1)
        if index is not None:  # head columns; a label outside them never matches
            labels = index[labels]
        inside = pos < n
        ok = (pred == labels) & inside & loss_mask[pos.clamp(max=n - 1)]
        return ok.view(-1, q)[:n_a, 1:].to(torch.long).cumprod(dim=1).sum(dim=1)

    def train_step(self, batch: Iterable[tuple[torch.Tensor, torch.Tensor]],
                   keys: Sequence[object] | None = None) -> dict[str, float]:
        """One optimiser step over `batch` (a list of (input_ids [S], loss_mask [S])).

        `keys` (one per sequence) enable the in-memory feature cache."""
        self.opt.zero_grad(set_to_none=True)
        batch = [self._on_device(ids, m) for ids, m in batch]  # once: `blocks` and `sequence_loss` reuse them
        self._drawn = [0, 0]
        # the loss is the batch's weighted mean CE: its normaliser is known before any forward
        plans = [self.blocks(ids, m, None if keys is None else keys[k]) for k, (ids, m) in enumerate(batch)]
        total_w = sum(float(p[4].sum()) for p in plans) or 1.0
        loss, accs = 0.0, []
        for k, (ids, m) in enumerate(batch):
            loss_sum, _, acc = self.sequence_loss(ids, m, None if keys is None else keys[k], plans[k])
            (loss_sum / total_w).backward()
            loss += float(loss_sum.detach()) / total_w
            if not math.isnan(float(acc)):
                accs.append(float(acc))
        gnorm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.response_tokens_seen += sum(int(m.sum()) for _, m in batch)
        stats = {"loss": loss, "tau_est": sum(accs) / len(accs) if accs else float("nan"),
                 "grad_norm": float(gnorm), "lr": float(self.sched.get_last_lr()[0])}
        if self.cfg.anchors == "on-policy":
            stats["on_policy_share"] = self._drawn[0] / max(1, self._drawn[1])
        return stats

    def state_dict(self) -> dict:
        return {"draft": self.draft.state_dict(), "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict(), "gen": self.gen.get_state(), "step": self.step,
                "response_tokens_seen": self.response_tokens_seen, "cfg": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        self.draft.load_state_dict(state["draft"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        # The schedule is this run's (`--lr`, `--warmup-steps`, `--steps`), continued from the saved
        # step: the scheduler's saved state would otherwise bring back the first run's peak rate.
        self.sched.base_lrs = [self.cfg.lr for _ in self.opt.param_groups]
        for g, f in zip(self.opt.param_groups, self.sched.lr_lambdas, strict=True):
            g["initial_lr"] = self.cfg.lr
            g["lr"] = self.cfg.lr * f(self.sched.last_epoch)
        self.gen.set_state(state["gen"])
        self.step = int(state["step"])
        self.response_tokens_seen = int(state.get("response_tokens_seen", 0))  # 0: a checkpoint from before 2026-12-03
        self._index_labels()  # the checkpoint's draft vocabulary (d2t), not the one this run chose
