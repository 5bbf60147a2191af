"""One training run: data and features on disk -> a draft, resumable, DDP-ready.

    train(TrainRun(out="runs/d", data="data/smollm2-selfdistill", steps=2000, init="draft:PATH"))

The target is loaded only for what the draft borrows from it (embedding table, lm_head) and
for features that are not on disk yet (`ensure_features`, run once per shard). Each step costs
only the draft. With `online_features` nothing is cached: each step runs the target on its
sequences (`DraftTrainer.features`), which suits a GPU, where that forward is cheap and the cache
of a large data set (~110 MB a shard for SmolLM2's 5 taps) would not fit the disk.
The checkpoint (`checkpoint.pt`) holds tensors and plain values only and is read with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dflash_robot.drafts.checkpoint import ensure_writable_dir, load_draft, save_draft
from dflash_robot.drafts.model import DFlashDraft, build_draft
from dflash_robot.errors import ConfigError, DFlashError
from dflash_robot.targets.base import TargetAdapter
from dflash_robot.training.data import (
    FeatureStore,
    Shard,
    _save_features,
    check_data_target,
    iter_samples,
    shard_paths,
    taps_dir,
    target_identity,
    token_key,
)
from dflash_robot.training.init import initialise
from dflash_robot.training.trainer import DraftTrainer, OptimConfig

CKPT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainRun:
    out: str
    data: str
    target: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    layers: int = 3
    target_layers: str | None = None  # comma-separated taps; None: the --init draft's, else z-lab's formula
    block_size: int = 16
    loss_decay: float | None = None  # None: the paper's value for the block size
    init: str = "random"
    mask_token_id: int | None = None
    draft_vocab: int | None = None  # None: keep --init draft's (or full); 0: full vocabulary
    prompt_vocab: bool | None = None  # the head also covers each prompt's tokens outside it; None: the --init draft's
    steps: int = 2000
    batch_size: int = 4
    lr: float = 6e-4
    warmup_steps: int = 50
    blocks_per_seq: int = 32
    anchors: str = "uniform"  # or "on-policy" (DraftTrainer.blocks)
    distill: float = 0.0  # weight of the target's soft labels (trainer.TargetTail); 0: hard labels only
    copy_weight: float = 1.0  # loss weight of labels that continue a bigram of their context
    block_hints: str | None = None  # "MIN,MAX": masks start with a lookup's proposal; "none"; None: the --init draft's
    max_len: int = 512
    bf16_autocast: bool = True
    cache_features: bool = False
    online_features: bool = False  # taps from one no-grad target forward per sequence and step; none on disk
    save_every: int = 100
    eval_every: int = 100
    holdout: int = 48
    holdout_shards: str = "shard-v1-00000,shard-00000,shard-00001,shard-00002"
    train_shards: str = ""  # train on these shards only (`shard_selection`); "": all but the held-out samples
    eval_block_sizes: str = ""  # extra decoding block sizes for the chain replay, e.g. "4,16"
    seed: int = 0
    threads: int | None = None
    log: str | None = None  # extra copy of the log (e.g. under docs/logs/)


def choose_mask_token(tokenizer: Any) -> int:
    """The tokenizer's mask token, else the highest-id special token the chat does not use."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    chat: Any = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                              tokenize=True) if getattr(tokenizer, "chat_template", None) else []
    if hasattr(chat, "keys"):
        chat = chat["input_ids"]
    used |= set(chat)
    special = sorted(i for i in tokenizer.all_special_ids if i not in used)
    added = sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in used)
    cands = special or added
    if not cands:
        raise ConfigError("no unused special token to serve as the mask token; pass --mask-token-id")
    return cands[-1]


def load_checkpoint(path: Path) -> dict:
    """A training checkpoint, read without unpickling arbitrary objects."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DFlashError(f"{path}: corrupt, truncated or unsafe training checkpoint ({type(e).__name__}: "
                          f"{first[:200]}); delete it to start over") from e
    if not isinstance(state, dict) or "trainer" not in state:
        raise DFlashError(f"{path}: not a dflash-robot training checkpoint")
    return state


def save_checkpoint(trainer: DraftTrainer, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"trainer": trainer.state_dict()}, tmp)
    tmp.replace(path)


def batch_indices(step: int, n: int, batch: int, seed: int, rank: int, world: int) -> list[int]:
    """Deterministic epoch-shuffled indices for `step` on `rank`: a resume on the same data
    replays the same order; on grown data (another `n`) every epoch is shuffled anew."""
    per_step = batch * world
    start = step * per_step
    out = []
    for k in range(start + rank * batch, start + rank * batch + batch):
        epoch, pos = divmod(k, n)
        out.append(int(_epoch_order(n, seed, epoch)[pos]))
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def token_coverage(samples: list, sizes: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
                   ) -> tuple[list[int], dict[int, float]]:
    """-> (response token ids by descending frequency, {N: share of response tokens in the top N})."""
    counts: Counter[int] = Counter()
    for ids, mask, *_ in samples:
        counts.update(ids[mask].tolist())
    order = [t for t, _ in counts.most_common()]
    total = sum(counts.values()) or 1
    cum = np.cumsum([counts[t] for t in order]) / total
    return order, {n: float(cum[min(n, len(cum)) - 1]) for n in sizes}


@torch.no_grad()
def ensure_features(make_target: Callable[[], TargetAdapter], data_dir: Path, layer_ids: tuple[int, ...],
                    only: set[str] | None = None) -> int:
    """Compute (once) the tapped features of shards that lack them (of the shards named in `only`,
    when given), into the first stored tap set that covers `layer_ids` (else one for exactly
    `layer_ids`). Every row of every sample is computed, whatever `--max-len` (a later run may read
    further), by the prefill of the adapter `make_target()` builds (only when a shard lacks them):
    `train` passes the runtime's own (`runtime.api.runtime_target_adapter`), so a draft trains on
    the features it is fed when it runs. Returns shards computed."""
    existing = [d for d in sorted((data_dir / "features").glob("taps-*"))
                if all(i in [int(x) for x in d.name[5:].split("-")] for i in layer_ids)]
    fdir = existing[0] if existing else taps_dir(data_dir, layer_ids)
    ids_stored = tuple(int(x) for x in fdir.name[5:].split("-"))
    todo = [p for p in shard_paths(data_dir) if (only is None or p.stem in only)
            and not any((d / f"{p.stem}.npy").exists() for d in existing)]
    if not todo:
        return 0
    target = make_target()
    device = target.input_embedding_weight().device
    for p in tqdm(todo, desc="target features", unit="shard"):
        shard = Shard.load(p)
        rows = []
        for i in range(len(shard)):
            ids, _ = shard.sample(i)
            feats = target.prefill(ids.to(device), ids_stored, 512).features  # the runtime's default chunk
            if feats is None:
                raise DFlashError(f"{type(target).__name__}.prefill returned no features for layers {ids_stored}; "
                                  "training needs an adapter that taps them")
            rows.append(feats.to(torch.bfloat16).cpu())
        _save_features(fdir / f"{p.stem}.npy", torch.cat(rows))
    return len(todo)


def shard_selection(spec: str, available: list[str] | None = None) -> Any:
    """`--train-shards` -> a predicate on shard names. Comma-separated items: a shard number
    (`214` = shard-00214), an inclusive range of them (`214-287`), or a shard's full name
    (`shard-v1-00000`), which must be one of `available` when that is given (a mistyped name would
    otherwise select nothing, silently). The held-out samples come from `--holdout-shards`
    whatever is selected."""
    names: set[str] = set()
    ranges: list[tuple[int, int]] = []
    for item in (x.strip() for x in spec.split(",")):
        lo, sep, hi = item.partition("-")
        if item.startswith("shard-"):
            if available is not None and item not in available:
                raise ConfigError(f"--train-shards {spec!r}: there is no shard named {item!r}")
            names.add(item)
        elif lo.isdigit() and (not sep or hi.isdigit()) and int(lo) <= int(hi or lo):
            ranges.append((int(lo), int(hi or lo)))
        else:
            raise ConfigError(f"--train-shards {spec!r}: {item!r} is not a shard number, an inclusive range "
                              "A-B of them, or a shard name such as shard-v1-00000")

    def selected(name: str) -> bool:
        num = name[len("shard-"):]
        return name in names or (num.isdigit() and any(a <= int(num) <= b for a, b in ranges))
    return selected


def split_holdout(samples: list, run: TrainRun) -> tuple[list, list]:
    """Held-out samples: taken round-robin from `holdout_shards` (a fixed set, so estimates stay
    comparable as data grows); they, and any other sample with the same prompt, are left out of
    training."""
    names = [s for s in run.holdout_shards.split(",") if s]
    pools = {n: [s for s in samples if s[2][0] == n] for n in names}
    hold: list = []
    k = 0
    while len(hold) < run.holdout and any(k < len(v) for v in pools.values()):
        hold += [v[k] for v in pools.values() if k < len(v)][:run.holdout - len(hold)]
        k += 1
    held = {s[2] for s in hold}
    prompts = {prompt_key(s) for s in hold}  # a prompt drawn twice (the prompt pools are finite) stays out too
    return hold, [s for s in samples if s[2] not in held and prompt_key(s) not in prompts]


def prompt_key(sample: tuple) -> bytes:
    """The tokens before a sample's first response token."""
    ids, mask = sample[0], sample[1]
    first = int(mask.nonzero()[0]) if mask.any() else ids.shape[0]
    return token_key(ids[:first])


def evaluation_samples(data: str, train_samples: int, seed: int = 0) -> tuple[list, list]:
    """The held-out samples `train` uses by default (the same fixed shards), and `train_samples`
    training samples drawn at random: what the draft-diagnosis scripts evaluate on."""
    import random

    run = TrainRun(data=data, out="unused")
    hold, train = split_holdout(iter_samples(Path(data), run.max_len), run)
    return hold, random.Random(seed).sample(train, min(train_samples, len(train)))


def _make_draft(run: TrainRun, model: Any, tok: Any, train: list, pool: list) -> tuple[DFlashDraft, dict]:
    """The draft a run starts from. A draft vocabulary is chosen by response-token frequency over
    `pool` (every sample not held out, whatever `--train-shards` selects: the frequencies are the
    target's, not a stage's); the logged coverage is of `train`. Grown from an --init draft's smaller
    vocabulary, it keeps all of that draft's tokens and adds the most frequent others: the rows the
    draft was trained on stay, and the head (the target's own rows) gains those it could never
    propose."""
    from dflash_robot.targets.loading import parse_dtype

    mask = run.mask_token_id if run.mask_token_id is not None else choose_mask_token(tok)
    src = load_draft(run.init.split(":", 1)[1]) if run.init.startswith("draft:") else None
    vocab_n = run.draft_vocab if run.draft_vocab is not None else (
        src.metadata.draft_vocab_size if src is not None else None)
    vocab_n = vocab_n or None  # 0 -> the full vocabulary
    order, coverage = token_coverage(train)
    info: dict[str, Any] = {"response_token_coverage": coverage}
    torch.manual_seed(run.seed)
    taps = [int(x) for x in run.target_layers.split(",")] if run.target_layers else (
        list(src.metadata.target_layer_ids) if src is not None else None)
    depth = (model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
             ).num_hidden_layers
    if taps is not None and (min(taps) < 0 or max(taps) >= depth):
        raise ConfigError(f"--target-layers {taps}: the target has layers 0..{depth - 1}")
    draft = build_draft(model.config, run.layers, run.block_size, mask, loss_decay=run.loss_decay,
                        draft_vocab_size=vocab_n, target_layer_ids=taps).to(parse_dtype(run.dtype))
    if vocab_n is not None:
        src_ids = src.vocab_ids if src is not None else None
        if src_ids is not None and src_ids.numel() == vocab_n:
            ids = src_ids
        else:  # the most frequent response tokens (after the --init draft's own when it grows),
            # topped up with the lowest unused ids
            if pool is not train:  # counted only when a vocabulary is chosen (`order` is train's)
                order = token_coverage(pool)[0]
            kept = src_ids.tolist() if src_ids is not None and src_ids.numel() < vocab_n else []
            have = set(kept)
            ranked = kept + [t for t in order if t not in have]
            top = set(ranked[:vocab_n])
            extra = [t for t in range(model.config.vocab_size) if t not in top]
            ids = torch.tensor((ranked[:vocab_n] + extra)[:vocab_n])
            if kept:
                info["draft_vocab_grown_from"] = len(kept)
        draft.set_vocab(ids)
        info["draft_vocab_coverage"] = _covered(train, draft)
    # inherited only where this run keeps a vocabulary (`--draft-vocab 0` drops both)
    prompt_vocab = run.prompt_vocab if run.prompt_vocab is not None else bool(
        src is not None and src.metadata.prompt_vocab and vocab_n is not None)
    if prompt_vocab:
        if vocab_n is None:
            raise ConfigError("--prompt-vocab needs a draft vocabulary (--draft-vocab N, or an --init draft with one)")
        draft.metadata = replace(draft.metadata, prompt_vocab=True)
        info["prompt_vocab_coverage"] = _covered(train, draft, with_prompt=True)
    hint = parse_block_hints(run.block_hints) if run.block_hints is not None else (
        src.metadata.hint_ngram if src is not None else None)
    if hint is not None:
        draft.metadata = replace(draft.metadata, hint_ngram=hint)
    notes = initialise(draft, model, run.init)
    if notes:
        info["grown_from_init" if run.init.startswith("draft:") else "kept_random_init"] = notes
    return draft, info


def parse_block_hints(spec: str) -> tuple[int, int] | None:
    """`--block-hints`: "MIN,MAX" n-gram sizes (e.g. "3,4") -> (min, max); "none" -> None."""
    if spec.strip().lower() == "none":
        return None
    try:
        lo, hi = (int(x) for x in spec.split(","))
    except ValueError:
        raise ConfigError(f"--block-hints: expected MIN,MAX n-gram sizes (e.g. 3,4) or none, got {spec!r}") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"--block-hints {spec}: the sizes need 1 <= MIN <= MAX")
    return lo, hi


def _covered(samples: list, draft: DFlashDraft, with_prompt: bool = False) -> float:
    """The share of the samples' response tokens the draft's vocabulary holds (`with_prompt`: or
    the sample's prompt, the tokens before its first response token, as `--prompt-vocab` adds)."""
    t2d = draft.t2d.cpu()
    hit = tot = 0
    for ids, mask, *_ in samples:
        r = ids[mask]
        ok = t2d[r]
        if with_prompt and r.numel():
            ok = ok | torch.isin(r, ids[:int(mask.nonzero()[0])])
        hit += int(ok.sum())
        tot += r.numel()
    return hit / max(tot, 1)


def train(run: TrainRun) -> Path:
    """Run (or resume) training; returns the directory of the final draft."""
    from dflash_robot.runtime.api import gguf_file_path, runtime_target_adapter
    from dflash_robot.targets.loading import default_target_path, load_target_model

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo" if run.device == "cpu" else "nccl")
    if run.threads:
        torch.set_num_threads(run.threads)
    out, data_dir = Path(run.out), Path(run.data)
    eval_block_sizes(run)  # a bad list fails before any slow work
    check_run(run)
    ensure_writable_dir(out)
    samples = iter_samples(data_dir, run.max_len)  # fails fast on missing or corrupt data
    model, tok = load_target_model(run.target or default_target_path(), run.gguf_file, run.dtype, run.device)
    check_data_target(data_dir, model, tok)  # data of another target: refused before any feature is computed
    vocab = target_identity(model, None)["vocab_size"]
    top = max(int(s[0].max()) for s in samples)
    if top >= vocab:
        raise ConfigError(f"{data_dir}: token id {top} is outside this target's vocabulary ({vocab}); the data "
                          "was generated with another tokenizer")
    from dflash_robot.targets.fastpath import pack_linears

    pack_linears(model)  # the target is frozen: its no-grad forwards use packed linears
    holdout, train_set = split_holdout(samples, run)
    pool = train_set  # every sample not held out: what a new draft vocabulary is chosen over
    if run.train_shards:
        selected = shard_selection(run.train_shards, [p.stem for p in shard_paths(data_dir)])
        train_set = [s for s in train_set if selected(s[2][0])]
        if not train_set:
            raise ConfigError(f"--train-shards {run.train_shards!r}: no training sample in {data_dir} is in those "
                              "shards (held-out samples excluded)")
    if not train_set:
        raise ConfigError(f"{data_dir}: no training samples left after holding out {len(holdout)}")
    draft, info = _make_draft(run, model, tok, train_set, pool)
    draft = draft.to(model.device)  # built on the CPU; the trainer computes where the target does
    store = None  # online: DraftTrainer.features runs the target on each sequence as it steps
    if not run.online_features:
        if rank == 0:
            gguf_path = gguf_file_path(Path(run.target) if run.target else default_target_path(), run.gguf_file)
            ensure_features(lambda: runtime_target_adapter(model, gguf_path), data_dir, draft.metadata.target_layer_ids,
                            only={s[2][0] for s in train_set + holdout})
        if world > 1:
            dist.barrier()
        store = FeatureStore(data_dir, draft.metadata.target_layer_ids, model.config.hidden_size)
    cfg = OptimConfig(lr=run.lr, warmup_steps=run.warmup_steps, total_steps=run.steps,
                      blocks_per_seq=run.blocks_per_seq, seed=run.seed + rank, bf16_autocast=run.bf16_autocast,
                      anchors=run.anchors, distill=run.distill,
                      copy_weight=run.copy_weight)
    ddp = torch.nn.parallel.DistributedDataParallel(draft) if world > 1 else None
    trainer = DraftTrainer(model, draft, cfg, ddp, cache_features=run.cache_features, store=store)
    ckpt = out / CKPT
    if ckpt.exists():
        trainer.load_state_dict(load_checkpoint(ckpt)["trainer"])
        if world > 1:  # the checkpoint holds rank 0's anchor generator: give each rank its own again
            trainer.gen.manual_seed((run.seed + rank) * 1_000_003 + trainer.step)
    logs = [open(p, "a") for p in (out / "train_log.jsonl", run.log) if p and rank == 0]  # noqa: SIM115
    if rank == 0 and trainer.step == 0:
        head = {"run": {k: v for k, v in vars(run).items()}, **info, "train_samples": len(train_set),
                "holdout_samples": len(holdout),
                "train_response_tokens": int(sum(int(m.sum()) for _, m, _ in train_set))}
        head["step0_holdout_tau_est"] = holdout_estimate(trainer, holdout)  # where this stage starts
        head["step0_holdout_tau_chain"] = holdout_chain(trainer, holdout)
        for q in eval_block_sizes(run):
            head[f"step0_holdout_tau_chain_b{q}"] = holdout_chain(trainer, holdout, q)
        for f in logs:
            f.write(json.dumps(head) + "\n")
    _loop(run, trainer, train_set, holdout, logs, ckpt, out, rank, world)
    if world > 1:
        dist.destroy_process_group()
    load_draft(out / "draft")  # the result reloads
    return out / "draft"


def _loop(run: TrainRun, trainer: DraftTrainer, train_set: list, holdout: list, logs: list, ckpt: Path,
          out: Path, rank: int, world: int) -> None:
    bar = tqdm(total=run.steps, initial=trainer.step, desc="train", disable=rank != 0)
    while trainer.step < run.steps:
        idx = batch_indices(trainer.step, len(train_set), run.batch_size, run.seed, rank, world)
        batch = [train_set[i] for i in idx]
        if trainer.store is not None:  # the next two steps' features start loading during this one
            ahead = [train_set[i][2] for s in (1, 2) if trainer.step + s < run.steps
                     for i in batch_indices(trainer.step + s, len(train_set), run.batch_size, run.seed, rank, world)]
            trainer.store.prefetch([k for k in ahead if isinstance(k, tuple) and len(k) == 3])
        t0 = time.perf_counter()
        stats = trainer.train_step([(s[0], s[1]) for s in batch], keys=[s[2] for s in batch])
        stats["step_s"] = time.perf_counter() - t0
        if trainer.step % run.eval_every == 0 or trainer.step == run.steps:
            stats["holdout_tau_est"] = holdout_estimate(trainer, holdout)
            stats["holdout_tau_chain"] = holdout_chain(trainer, holdout)
            for q in eval_block_sizes(run):
                stats[f"holdout_tau_chain_b{q}"] = holdout_chain(trainer, holdout, q)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", tau=f"{stats['tau_est']:.2f}")
        for f in logs:
            row = {"step": trainer.step, "response_tokens_this_run": trainer.response_tokens_seen, **stats}
            f.write(json.dumps(row) + "\n")
            f.flush()
        if rank == 0 and (trainer.step % run.save_every == 0 or trainer.step == run.steps):
            save_checkpoint(trainer, ckpt)
            save_draft(trainer.draft, out / "draft", dtype=torch.bfloat16)


def check_run(run: TrainRun) -> None:
    """What can be wrong with a run's paths and arguments, checked before any slow work: --init,
    --log's directory, and, when --out holds a checkpoint, that this run builds the same draft."""
    if run.init not in ("random", "target"):
        if not run.init.startswith("draft:"):
            raise ConfigError(f"--init must be random, target or draft:PATH, got {run.init!r}")
        src = Path(run.init.split(":", 1)[1])
        if not src.exists():
            raise ConfigError(f"--init {run.init}: {src} does not exist")
    if run.log and not Path(run.log).parent.is_dir():
        raise ConfigError(f"--log {run.log}: directory {Path(run.log).parent} does not exist")
    if run.anchors not in ("uniform", "on-policy"):
        raise ConfigError(f"--anchors must be uniform or on-policy, got {run.anchors!r}")
    if run.train_shards:
        shard_selection(run.train_shards)  # a malformed list fails here
    if run.prompt_vocab and run.draft_vocab == 0:
        raise ConfigError("--prompt-vocab needs a draft vocabulary: --draft-vocab 0 is the full vocabulary")
    if not 0.0 <= run.distill <= 1.0:
        raise ConfigError(f"--distill must be from 0 (hard labels) to 1 (the target's distribution), got {run.distill}")
    if not (math.isfinite(run.copy_weight) and run.copy_weight > 0):
        raise ConfigError(f"--copy-weight must be a positive number, got {run.copy_weight}")
    if run.block_hints is not None:
        parse_block_hints(run.block_hints)
    out = Path(run.out)
    saved_cfg = out / "draft" / "config.json"
    if not (out / CKPT).exists() or not saved_cfg.is_file():
        return
    try:
        cfg = json.loads(saved_cfg.read_text())
        d = cfg.get("dflash_config") or {}
        saved: dict[str, Any] = {"--layers": int(cfg["num_hidden_layers"]),
                                 "--block-size": int(d.get("training_block_size", d.get("block_size", 16)))}
        asked: dict[str, Any] = {"--layers": run.layers, "--block-size": run.block_size}
        if run.target_layers:
            saved["--target-layers"] = [int(i) for i in d["target_layer_ids"]]
            asked["--target-layers"] = [int(x) for x in run.target_layers.split(",")]
        if run.draft_vocab is not None:
            saved["--draft-vocab"] = int(d.get("draft_vocab_size") or 0)
            asked["--draft-vocab"] = run.draft_vocab
        if run.prompt_vocab is not None:
            saved["--prompt-vocab"] = bool(d.get("prompt_vocab", False))
            asked["--prompt-vocab"] = run.prompt_vocab
        if run.block_hints is not None:
            saved["--block-hints"] = d.get("hint_ngram")
            hint = parse_block_hints(run.block_hints)
            asked["--block-hints"] = None if hint is None else list(hint)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{saved_cfg}: unreadable draft config beside the checkpoint ({e})") from e
    wrong = [f"{k} {asked[k]} (its draft: {saved[k]})" for k in asked if asked[k] != saved[k]]
    if wrong:
        raise ConfigError(f"{out / CKPT} was written by a run with other arguments: {'; '.join(wrong)}. "
                          "Resume with the checkpoint's arguments, or give another --out")


def eval_block_sizes(run: TrainRun) -> list[int]:
    """The decoding block sizes `--eval-block-sizes` adds to the chain replay (logged as
    `holdout_tau_chain_b{q}`), without the training block size, which is always logged."""
    try:
        sizes = [int(x) for x in run.eval_block_sizes.split(",") if x.strip()]
    except ValueError:
        sizes = [0]
    if any(q < 2 or q > run.block_size for q in sizes):
        raise ConfigError(f"--eval-block-sizes {run.eval_block_sizes!r}: block sizes from 2 to the "
                          f"training block size ({run.block_size})")
    return [q for q in dict.fromkeys(sizes) if q != run.block_size]


@torch.no_grad()
def holdout_chain(trainer: DraftTrainer, holdout: list, block_size: int | None = None) -> float:
    """Acceptance length of greedy chain decoding replayed on the held-out samples
    (`DraftTrainer.chain_acceptance`), tokens over steps pooled across them, as `bench` pools it.
    Unlike `holdout_estimate` it gives no credit past a sequence's end and visits only the anchors
    decoding would."""
    if not holdout:
        return math.nan
    trainer.draft.eval()
    gains = [g for k, s in enumerate(holdout)
             for g in trainer.chain_acceptance(s[0], s[1], s[2] if len(s) > 2 else ("holdout", k),
                                               block_size=block_size)]
    trainer.draft.train()
    return sum(gains) / len(gains) if gains else math.nan


@torch.no_grad()
def holdout_estimate(trainer: DraftTrainer, holdout: list) -> float:
    """Mean expected acceptance (greedy, training block size) on held-out samples."""
    if not holdout:
        return math.nan
    state = trainer.gen.get_state()
    trainer.draft.eval()
    accs = [float(trainer.sequence_loss(s[0], s[1], s[2] if len(s) > 2 else ("holdout", k), soft_labels=False)[2])
            for k, s in enumerate(holdout)]
    trainer.draft.train()
    trainer.gen.set_state(state)
    accs = [a for a in accs if not math.isnan(a)]
    return sum(accs) / len(accs) if accs else math.nan
