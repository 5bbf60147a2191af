"""`dflash-robot train`: self-distillation data, then draft training, resumable, DDP-ready.

Single process:  dflash-robot train --out runs/my-draft --prompts self:2000 --steps 3000
Several:         torchrun --nproc_per_node 2 -m dflash_robot.cli train ...   (gloo on CPU, nccl on GPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..checkpoint import ensure_writable_dir, load_draft, save_draft
from ..draft import build_draft
from ..errors import ConfigError, DFlashError
from .data import generate_dataset, load_dataset
from .init import initialise
from .trainer import DraftTrainer, OptimConfig

CKPT = "checkpoint.pt"


def add_train_parser(sub) -> None:  # type: ignore[no-untyped-def]
    from ..cli import add_model_args

    t = sub.add_parser("train", help="train a DFlash draft for a target (self-distillation)")
    add_model_args(t, engine=False)  # training runs the HF model itself
    t.add_argument("--out", required=True, help="output directory: checkpoint.pt and the final draft")
    t.add_argument("--data", help="training data directory (data-*.jsonl); generated there if empty")
    t.add_argument("--prompts", default="self:1000", help="prompt source for generation: self:N or jsonl:PATH[:FIELD]")
    t.add_argument("--num-samples", type=int, default=1000)
    t.add_argument("--gen-max-new-tokens", type=int, default=256)
    t.add_argument("--gen-batch-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=2, help="draft depth")
    t.add_argument("--block-size", type=int, default=16, help="training block size")
    t.add_argument("--init", default="random",
                   help="draft initialisation: random (z-lab's), target (copy the target's last layers) "
                        "or draft:PATH (continue from an existing draft with a fresh schedule)")
    t.add_argument("--mask-token-id", type=int, help="default: the tokenizer's mask token, else its last "
                                                     "special token that the chat template does not use")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=4, help="sequences per optimiser step (per process)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--blocks-per-seq", type=int, default=32)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--bf16-autocast", action="store_true")
    t.add_argument("--cache-features", action="store_true",
                   help="keep target features in memory after their first use (about S x n_taps x H x 4 bytes "
                        "per sample in fp32), so later epochs skip the target forward")
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--holdout", type=int, default=16, help="samples held out for the acceptance estimate")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int)


def choose_mask_token(tokenizer) -> int:  # type: ignore[no-untyped-def]
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
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise DFlashError(f"{path}: corrupt or truncated training checkpoint ({type(e).__name__}: {e}); "
                          "delete it to start over") from e
    if not isinstance(state, dict) or "trainer" not in state:
        raise DFlashError(f"{path}: not a dflash-robot training checkpoint")
    return state


def batch_indices(step: int, n: int, batch: int, seed: int, rank: int, world: int) -> list[int]:
    """Deterministic epoch-shuffled indices for `step` on `rank` (resume replays the same order)."""
    per_step = batch * world
    start = step * per_step
    out = []
    for k in range(start + rank * batch, start + rank * batch + batch):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        out.append(int(perm[pos]))
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from ..loading import default_target_path, load_target_model, parse_dtype

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    ensure_writable_dir(out)
    model, tok = load_target_model(args.target or default_target_path(), args.gguf_file, args.dtype, args.device)
    if not args.no_fast_linears:  # the target is frozen: its no-grad forwards use packed linears
        from ..fastpath import pack_linears

        pack_linears(model)
    data_dir = Path(args.data) if args.data else out / "data"
    if rank == 0 and not list(data_dir.glob("data-*.jsonl")) or (
            rank == 0 and sum(1 for s in data_dir.glob("data-*.jsonl") for _ in s.open()) < args.num_samples):
        if tok is None:
            raise ConfigError("generating data needs the target's tokenizer; pass --data with ready shards")
        generate_dataset(model, tok, data_dir, args.prompts, args.num_samples, args.gen_max_new_tokens,
                         args.gen_batch_size, seed=args.seed)
    if world > 1:
        dist.barrier()
    if args.steps == 0:  # data only
        print(f"training data in {data_dir}")
        return 0
    samples = load_dataset(data_dir, args.max_len)
    holdout, train = samples[:args.holdout], samples[args.holdout:]
    if not train:
        raise ConfigError(f"{data_dir}: no training samples left after holding out {args.holdout}")
    mask = args.mask_token_id if args.mask_token_id is not None else choose_mask_token(tok)
    cfg = OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps,
                      blocks_per_seq=args.blocks_per_seq, seed=args.seed + rank, bf16_autocast=args.bf16_autocast)
    torch.manual_seed(args.seed)
    draft = build_draft(model.config, args.layers, args.block_size, mask).to(parse_dtype(args.dtype))
    skipped = initialise(draft, model, args.init)
    if skipped and rank == 0:
        print(f"--init {args.init}: kept the random init of {', '.join(skipped)}")
    ddp = None
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(draft, find_unused_parameters=False)
    trainer = DraftTrainer(model, draft, cfg, ddp, cache_features=args.cache_features)
    ckpt = out / CKPT
    if ckpt.exists():
        trainer.load_state_dict(load_checkpoint(ckpt)["trainer"])
    bar = tqdm(total=args.steps, initial=trainer.step, desc="train", disable=rank != 0)
    log = (out / "train_log.jsonl").open("a") if rank == 0 else None
    while trainer.step < args.steps:
        idx = batch_indices(trainer.step, len(train), args.batch_size, args.seed, rank, world)
        t0 = time.perf_counter()
        stats = trainer.train_step([train[i] for i in idx], keys=idx)
        stats["step_s"] = time.perf_counter() - t0
        if trainer.step % args.eval_every == 0 or trainer.step == args.steps:
            stats["holdout_tau_est"] = holdout_estimate(trainer, holdout)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", tau=f"{stats['tau_est']:.2f}")
        if log:
            log.write(json.dumps({"step": trainer.step, **stats}) + "\n")
            log.flush()
        if rank == 0 and (trainer.step % args.save_every == 0 or trainer.step == args.steps):
            save_checkpoint(trainer, ckpt)
            save_draft(draft, out / "draft", dtype=torch.bfloat16)
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        load_draft(out / "draft")  # the result reloads
        print(f"draft written to {out / 'draft'}")
    return 0


def save_checkpoint(trainer: DraftTrainer, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"trainer": trainer.state_dict()}, tmp)
    tmp.replace(path)


@torch.no_grad()
def holdout_estimate(trainer: DraftTrainer, holdout: list) -> float:
    """Mean expected acceptance (greedy, training block size) on held-out samples."""
    if not holdout:
        return math.nan
    state = trainer.gen.get_state()
    trainer.draft.eval()
    accs = [float(trainer.sequence_loss(ids, m, ("holdout", k))[2]) for k, (ids, m) in enumerate(holdout)]
    trainer.draft.train()
    trainer.gen.set_state(state)
    accs = [a for a in accs if not math.isnan(a)]
    return sum(accs) / len(accs) if accs else math.nan
