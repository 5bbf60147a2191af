"""The draft's metadata schema.

`DraftMetadata` is the one schema for a draft's DFlash fields. It is read from and
written to z-lab's `config.json` (`dflash_config` plus the top-level `block_size` and
`num_target_layers`), and a later exporter writes the same fields as GGUF keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_robot.errors import ConfigError

# Paper (arXiv 2602.06036, Sec. 3.4 / App. B): loss decay gamma per training block size.
_PAPER_LOSS_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's layer-id formula: evenly spaced ids in [1, L-3], Python's round (half to even).

    One draft layer taps the middle layer `L // 2`.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ConfigError("num_target_layers and num_draft_layers must be >= 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def default_loss_decay(block_size: int) -> float:
    """The paper's gamma: 7 for block 16, 5 for block 10, 4 for block 8.

    Other sizes interpolate piecewise-linearly between those points (and scale
    proportionally outside them); the value is recorded in the draft's metadata.
    """
    if block_size in _PAPER_LOSS_DECAY:
        return _PAPER_LOSS_DECAY[block_size]
    points = sorted(_PAPER_LOSS_DECAY.items())
    if block_size < points[0][0]:
        return points[0][1] * block_size / points[0][0]
    if block_size > points[-1][0]:
        return points[-1][1] * block_size / points[-1][0]
    for (b0, g0), (b1, g1) in zip(points, points[1:], strict=False):
        if b0 <= block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    raise AssertionError("unreachable")


def _flag(value: Any, name: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: dflash_config.{name} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class DraftMetadata:
    """Everything a runtime needs to know about a draft beyond its transformer weights.

    Fields written by z-lab: block_size, mask_token_id, target_layer_ids, num_target_layers.
    Fields we add (ignored by z-lab's loader): training_block_size, loss_decay, and
    draft_vocab_size (the draft's head covers only that many target tokens, listed by the
    EAGLE-3-style `d2t`/`t2d` tensors in the weights; see `DFlashDraft.vocab_ids`).
    Optional z-lab knobs: input_embedding_scale, output_multiplier, final_logit_softcapping.
    prompt_vocab (ours, needs draft_vocab_size): for each request the head also covers the
    prompt's tokens outside the draft vocabulary (the target head's rows for them, appended as
    extra columns), as the draft was trained (`train --prompt-vocab`; docs/TRAINING.md, session 24).
    hint_ngram (ours): (min, max) n-gram sizes of the lookup whose proposal fills the block's mask
    positions, as the draft was trained (`train --block-hints`; `objective.hint_blocks`): the
    runtime looks the last committed n-gram up in the request's own tokens (`runtime/lookup.py`)
    and puts what followed it after `last`, masks after that. None (z-lab's drafts): masks only.
    """

    block_size: int  # default run-time block size (z-lab's `block_size`)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # taps hidden_states[id + 1], concatenated in this order
    num_target_layers: int  # target depth the ids refer to
    num_draft_layers: int  # draft depth
    training_block_size: int  # largest block the draft was trained for
    loss_decay: float  # gamma of the exp(-(k-1)/gamma) training weights
    input_embedding_scale: float = 1.0  # noise embedding = raw target embedding * this
    output_multiplier: float = 1.0  # draft logits multiplier
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None  # the draft head covers this many target tokens (d2t/t2d); None = all
    prompt_vocab: bool = False  # the head also covers each request's prompt tokens outside the draft vocabulary
    hint_ngram: tuple[int, int] | None = None  # the block's masks start with an n-gram lookup's proposal

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.training_block_size < 1:
            raise ConfigError(f"block sizes must be >= 1, got block_size={self.block_size}, "
                              f"training_block_size={self.training_block_size}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must not be empty")
        if self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ConfigError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.prompt_vocab and self.draft_vocab_size is None:
            raise ConfigError("prompt_vocab needs a draft vocabulary (draft_vocab_size): a full-vocabulary "
                              "head already covers every prompt token")
        if self.hint_ngram is not None:
            h = self.hint_ngram
            if isinstance(h, list):  # as JSON and GGUF arrays carry it
                h = tuple(h)
                object.__setattr__(self, "hint_ngram", h)
            if not (isinstance(h, tuple) and len(h) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                                                  for n in h) and 1 <= h[0] <= h[1]):
                raise ConfigError(f"hint_ngram must be two integers [min, max] with 1 <= min <= max, got {h!r}")

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> DraftMetadata:
        """Read the metadata from a z-lab style `config.json` dict."""
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"{source}: dflash_config must be a JSON object, got {type(dflash).__name__}")

        def pick(name: str, default: Any = None) -> Any:
            return dflash.get(name, cfg.get(name, default))

        mask = pick("mask_token_id")
        if mask is None:
            raise ConfigError(f"{source}: dflash_config.mask_token_id is missing; a DFlash draft "
                              "needs the id of its mask token")
        num_draft_layers = int(cfg.get("num_hidden_layers", 0))
        num_target_layers = pick("num_target_layers")
        ids = pick("target_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise ConfigError(f"{source}: neither target_layer_ids nor num_target_layers is set")
            ids = build_target_layer_ids(int(num_target_layers), num_draft_layers)
        if num_target_layers is None:
            num_target_layers = max(ids) + 1
        block_size = int(pick("block_size", 16))
        train_bs = int(pick("training_block_size", block_size))
        softcap = pick("final_logit_softcapping")
        hint = pick("hint_ngram")
        if hint is not None and not isinstance(hint, list):
            raise ConfigError(f"{source}: dflash_config.hint_ngram must be a list [min, max], got {hint!r}")
        return cls(
            block_size=block_size,
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=int(num_target_layers),
            num_draft_layers=num_draft_layers,
            training_block_size=train_bs,
            loss_decay=float(pick("loss_decay", default_loss_decay(train_bs))),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            draft_vocab_size=None if pick("draft_vocab_size") is None else int(pick("draft_vocab_size")),
            prompt_vocab=_flag(pick("prompt_vocab", False), "prompt_vocab", source),
            hint_ngram=hint,  # type: ignore[arg-type]  # a list: checked and made a tuple in __post_init__
        )

    def to_config_entries(self) -> dict[str, Any]:
        """Top-level `config.json` entries, in z-lab's layout plus our extra keys."""
        dflash: dict[str, Any] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "training_block_size": self.training_block_size,
            "loss_decay": self.loss_decay,
        }
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.draft_vocab_size is not None:
            dflash["draft_vocab_size"] = self.draft_vocab_size
        if self.prompt_vocab:
            dflash["prompt_vocab"] = True
        if self.hint_ngram is not None:
            dflash["hint_ngram"] = list(self.hint_ngram)
        return {"block_size": self.block_size, "num_target_layers": self.num_target_layers,
                "dflash_config": dflash}

    def check_block_size(self, block_size: int) -> int:
        """Run-time block size must be in [1, training_block_size]."""
        if not isinstance(block_size, int) or not 1 <= block_size <= self.training_block_size:
            raise ConfigError(f"block size {block_size!r} is out of range: this draft supports "
                              f"1..{self.training_block_size} (its training block size)")
        return block_size


