"""`dflash-robot data` (self-distillation data) and `dflash-robot train` (a draft from it).

    dflash-robot data --out data/my-set --sources docstring:4,math:3,selfmath:1,self:2 --shards 100
    dflash-robot train --data data/my-set --out runs/my-draft --steps 3000
    torchrun --nproc_per_node 2 -m dflash_robot.cli train ...   (gloo on CPU, nccl on GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dflash_robot.cli.common import HelpFormatter, add_model_args, int_at_least

DATA_DESCRIPTION = """Generate self-distillation data: prompts from offline sources, answered greedily
by the target, stored as compact token arrays (shard-*.npz), with the target's tapped
hidden states cached beside them (features/, bf16 .npy). Resumable: complete
shards are kept. No prompt of an installed evaluation set is ever used."""

TRAIN_DESCRIPTION = """Train a DFlash draft for a target on self-distillation data (see `dflash-robot data`).
Features come from the data directory's cache (computed once where missing), so each step
costs only the draft. Resumable from OUT/checkpoint.pt; the draft is written to OUT/draft."""


def add_data_parser(sub: Any) -> None:
    d = sub.add_parser("data", help="generate self-distillation data", description=DATA_DESCRIPTION,
                       formatter_class=HelpFormatter)
    add_model_args(d, engine=False)
    d.set_defaults(dtype="bfloat16")
    d.add_argument("--out", required=True, help="data directory (shards are added to it)")
    d.add_argument("--sources", default="docstring:4,math:3,selfmath:1,self:2",
                   help="prompt sources with weights (docstring, math, algo, wordmath, selfmath, self); shards cycle "
                        "through them")
    d.add_argument("--shards", type=int_at_least(1), default=100, help="total shards wanted in --out")
    d.add_argument("--batch-size", type=int_at_least(1), default=64, help="prompts per shard (one batch)")
    d.add_argument("--max-new-tokens", type=int_at_least(1), default=256, help="answer length cap")
    d.add_argument("--feature-layers", default="auto",
                   help="target layer ids whose hidden states are cached while generating (comma-separated), "
                        "'auto' = those of 2-, 3- and 4-layer drafts, 'none' = do not cache")
    d.add_argument("--seed", type=int, default=1)


def add_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train a DFlash draft (self-distillation)", description=TRAIN_DESCRIPTION,
                       formatter_class=HelpFormatter)
    add_model_args(t, engine=False)
    t.add_argument("--data", required=True, help="data directory written by `dflash-robot data`")
    t.add_argument("--out", required=True, help="output directory: checkpoint.pt, train_log.jsonl, draft/")
    t.add_argument("--layers", type=int_at_least(1), default=3, help="draft depth")
    t.add_argument("--target-layers", help="target layers the draft taps, comma-separated (default: the --init "
                                           "draft's, else z-lab's formula for the depth); with --init draft:PATH "
                                           "a superset of its taps and a --layers above its depth grow it without "
                                           "changing what it proposes (new layers start as the identity)")
    t.add_argument("--block-size", type=int_at_least(2), default=16, help="training block size")
    t.add_argument("--loss-decay", type=float, help="gamma of the exp(-(k-1)/gamma) weights (default: the paper's)")
    t.add_argument("--init", default="random",
                   help="random (z-lab's), target (copy the target's last layers) or draft:PATH (continue)")
    t.add_argument("--mask-token-id", type=int, help="default: the tokenizer's mask token, else its last "
                                                     "special token that the chat template does not use")
    t.add_argument("--draft-vocab", type=int_at_least(0),
                   help="draft head size N: the N most frequent response tokens of the data not held out "
                        "(0 = full vocabulary; default: the --init draft's, else full); above the --init "
                        "draft's, its tokens stay and the most frequent others are added")
    t.add_argument("--prompt-vocab", action=argparse.BooleanOptionalAction, default=None,
                   help="with a draft vocabulary: train (and mark the draft to decode) with each prompt's tokens "
                        "outside it as extra head columns, so the draft can propose words the target copies from "
                        "the prompt (default: the --init draft's setting)")
    t.add_argument("--steps", type=int_at_least(1), default=2000)
    t.add_argument("--batch-size", type=int_at_least(1), default=4, help="sequences per optimiser step")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-steps", type=int_at_least(1), default=50)
    t.add_argument("--blocks-per-seq", type=int_at_least(1), default=32)
    t.add_argument("--anchors", choices=("uniform", "on-policy"), default="uniform",
                   help="where training blocks start: uniformly over the response, or where chain decoding with "
                        "the current draft would start them (after a miss; one extra no-grad draft forward per "
                        "sequence, ~+30%% per step)")
    t.add_argument("--distill", type=float, default=0.0,
                   help="weight of soft labels: the target's own next-token distribution (over the draft "
                        "vocabulary), mixed with the hard label as (1-w)*CE(label) + w*CE(target); 0 = hard labels "
                        "only. Computed from the deepest tap through the target's remaining layers")
    t.add_argument("--copy-weight", type=float, default=1.0,
                   help="multiply the loss weight of labels that continue a bigram already in their context (the "
                        "tokens an n-gram lookup would propose, where the draft misses most) by this; 1 = the "
                        "paper's objective")
    t.add_argument("--block-hints", metavar="MIN,MAX",
                   help="fill each training block's masks with what an n-gram lookup (MIN..MAX tokens, longest "
                        "first) of its context proposes, and mark the draft so the runtime fills them the same way "
                        "when it decodes (e.g. 3,4; 'none' drops it; default: the --init draft's setting)")
    t.add_argument("--max-len", type=int_at_least(2), default=512)
    t.add_argument("--no-bf16-autocast", dest="bf16_autocast", action="store_false",
                   help="train in fp32 (fp32 steps measured ~15%% slower than bf16 autocast on the Xeon box, "
                        "1.4-1.6x as long on the AMD EPYC box: docs/TRAINING.md)")
    t.add_argument("--online-features", action="store_true",
                   help="compute the target's taps in every step (one no-grad target forward per sequence) "
                        "instead of caching them on disk first (~110 MB a shard of 64 samples for 5 taps of "
                        "SmolLM2): for a GPU, where that forward is cheap next to the draft's step and the "
                        "cache of every shard would not fit its disk. On the 2-core CPU box a 4-sequence step "
                        "of the 5-layer draft took ~6 s this way, against ~2.3 s on cached features (docs/TRAINING.md)")
    t.add_argument("--save-every", type=int_at_least(1), default=100)
    t.add_argument("--eval-every", type=int_at_least(1), default=100)
    t.add_argument("--holdout", type=int_at_least(0), default=48, help="held-out samples for the tau estimate")
    t.add_argument("--holdout-shards", default="shard-v1-00000,shard-00000,shard-00001,shard-00002",
                   help="shards the held-out samples are taken from, round-robin (only those samples are left out)")
    t.add_argument("--train-shards", default="",
                   help="train on these shards only: shard numbers and inclusive ranges, or full shard names, "
                        "comma-separated (e.g. 214-287 or shard-v1-00000,5-9); default: every shard. The "
                        "held-out samples still come from --holdout-shards")
    t.add_argument("--eval-block-sizes", default="",
                   help="also replay chain decoding on the held-out set at these block sizes (e.g. 4,16)")
    t.add_argument("--log", help="also append the log here (e.g. docs/logs/NAME.jsonl)")
    t.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from dflash_robot.cli.common import check_paths

    check_paths(args)
    if args.target_layers is not None:
        from dflash_robot.errors import ConfigError

        try:
            taps = [int(x) for x in args.target_layers.split(",")]
        except ValueError:
            raise ConfigError(f"--target-layers: expected comma-separated layer indices, got "
                              f"{args.target_layers!r}") from None
        if len(set(taps)) != len(taps) or min(taps) < 0:
            raise ConfigError(f"--target-layers: expected distinct non-negative layer indices, got {taps}")
    from dflash_robot.training.run import TrainRun, train

    fields = {f.name for f in dataclasses.fields(TrainRun)}
    out = train(TrainRun(**{k: v for k, v in vars(args).items() if k in fields}))
    print(f"draft written to {out}")
    return 0


def run_data(args: argparse.Namespace) -> int:
    from dflash_robot.cli.common import check_paths
    from dflash_robot.errors import ConfigError

    check_paths(args)
    from dflash_robot.training.data import parse_sources

    parse_sources(args.sources)  # fail before loading the model
    layers: list[int] | None = None
    if args.feature_layers not in ("none", "auto"):
        try:
            layers = [int(x) for x in args.feature_layers.split(",")]
        except ValueError:
            raise ConfigError("--feature-layers: expected 'auto', 'none' or comma-separated integers, "
                              f"got {args.feature_layers!r}") from None
        if len(set(layers)) != len(layers) or min(layers) < 0:
            raise ConfigError(f"--feature-layers: expected distinct non-negative layer indices, got {layers}")
    import torch

    from dflash_robot.drafts.metadata import build_target_layer_ids
    from dflash_robot.targets.loading import default_target_path, load_target_model
    from dflash_robot.training.data import generate_dataset

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_target_model(args.target or default_target_path(), args.gguf_file, args.dtype, args.device)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = cfg.num_hidden_layers
    if args.feature_layers == "auto":
        layers = sorted({i for k in (2, 3, 4) for i in build_target_layer_ids(n, k)})
    elif layers and max(layers) >= n:
        raise ConfigError(f"--feature-layers {layers}: the target has layers 0..{n - 1}")
    if tok is None:
        raise ConfigError("generating data needs the target's tokenizer")
    generate_dataset(model, tok, args.out, args.sources, args.shards, args.max_new_tokens, args.batch_size,
                     seed=args.seed, feature_layer_ids=layers)
    print(f"data in {args.out}")
    return 0
