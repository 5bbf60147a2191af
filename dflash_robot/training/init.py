"""Draft initialisation: random (z-lab's), from the target's own last layers, or from a draft.

`--init target` copies the target's last `n` decoder layers (attention and MLP projections,
their norms) into the draft's `n` layers, the target's final norm into the draft's, and sets
`fc` to pass the last tapped layer's hidden state through, normed like that layer's input.
q_norm / k_norm (which the target may lack) start as ones. The draft thus starts as "the
target's top layers reading the target's late features": a prior, not a working draft; see
docs/TRAINING.md for what it measured.

`--init draft:PATH` starts from an existing draft, e.g. to continue training a shipped draft with a
fresh schedule, or grows it (more layers, more target taps) without changing what it proposes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.errors import ConfigError, IncompatibleDraftError

_LAYER_PARAMS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


def _decoder(target: Any) -> Any:
    dec = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    if dec is None or not hasattr(dec, "layers") or not hasattr(dec, "norm"):
        raise ConfigError(f"{type(target).__name__}: cannot find decoder layers to initialise from; use --init random")
    return dec


@torch.no_grad()
def init_from_target(draft: DFlashDraft, target: Any) -> list[str]:
    """Copy the target's last layers into the draft. Returns the names it could not copy
    (shape mismatch, or the target lacks them); those keep their random init."""
    dec = _decoder(target)
    n, total = len(draft.layers), len(dec.layers)
    skipped: list[str] = []
    for i, layer in enumerate(draft.layers):
        src = dict(dec.layers[total - n + i].named_parameters())
        dst = dict(layer.named_parameters())
        for name in _LAYER_PARAMS:
            s, d = src.get(name), dst.get(name)
            if s is None or d is None or s.shape != d.shape:
                skipped.append(f"layers.{i}.{name}")
                continue
            d.copy_(s.to(d.dtype))
    if getattr(dec.norm, "weight", None) is not None and dec.norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(dec.norm.weight.to(draft.norm.weight.dtype))
    else:
        skipped.append("norm.weight")
    h = draft.config.hidden_size
    k = len(draft.metadata.target_layer_ids)
    eye = torch.eye(h, dtype=draft.fc.weight.dtype)
    draft.fc.weight.zero_()
    draft.fc.weight[:, (k - 1) * h:] = eye
    first = dec.layers[total - n]
    ln = getattr(first, "input_layernorm", None)
    if ln is not None and getattr(ln, "weight", None) is not None and ln.weight.shape == draft.hidden_norm.weight.shape:
        draft.hidden_norm.weight.copy_(ln.weight.to(draft.hidden_norm.weight.dtype))
    else:
        skipped.append("hidden_norm.weight")
    if skipped and len(skipped) == n * len(_LAYER_PARAMS) + 2:
        raise ConfigError("the target's layers do not match the draft's shapes; use --init random")
    return skipped


@torch.no_grad()
def init_from_draft(draft: DFlashDraft, path: str | Path) -> list[str]:
    """Load an existing draft's weights into `draft`. Same shapes and metadata: a plain continuation.

    The run's draft may also be a function-preserving growth of it: more layers (the extra ones
    appended with their o_proj and down_proj zeroed, so each starts as the identity on the residual
    stream) and more target taps (a superset of the source's, in any order; `fc` gets zero columns
    for the new ones). The grown draft then proposes exactly what the source proposed, and training
    starts from there. Returns what was grown (for the log)."""
    from dflash_robot.drafts.checkpoint import load_draft

    src = load_draft(path)
    a, b = src.metadata, draft.metadata
    for field in ("mask_token_id", "training_block_size", "num_target_layers"):
        if getattr(a, field) != getattr(b, field):
            raise IncompatibleDraftError(
                f"--init draft:{path}: its {field} is {getattr(a, field)}, the run asks for {getattr(b, field)}")
    missing = [i for i in a.target_layer_ids if i not in b.target_layer_ids]
    if missing:
        raise IncompatibleDraftError(f"--init draft:{path}: the run's taps {list(b.target_layer_ids)} lack its "
                                     f"taps {missing}")
    n_src, n_dst = len(src.layers), len(draft.layers)
    if n_dst < n_src:
        raise IncompatibleDraftError(f"--init draft:{path}: it has {n_src} layers, the run asks for {n_dst}")
    vocab = ("d2t", "t2d")  # the draft vocabulary is the run's own choice
    theirs = {k: v for k, v in src.state_dict().items() if k not in vocab}
    ours = {k: v for k, v in draft.state_dict().items() if k not in vocab}
    grown: list[str] = []
    h = draft.config.hidden_size
    if list(a.target_layer_ids) != list(b.target_layer_ids):
        w = torch.zeros_like(ours["fc.weight"])
        for j, tap in enumerate(a.target_layer_ids):
            k = list(b.target_layer_ids).index(tap)
            w[:, k * h:(k + 1) * h] = theirs["fc.weight"][:, j * h:(j + 1) * h].to(w.dtype)
        theirs["fc.weight"] = w
        grown.append(f"taps {list(a.target_layer_ids)} -> {list(b.target_layer_ids)} (new fc columns zero)")
    for i in range(n_src, n_dst):
        for name, t in ours.items():
            if name.startswith(f"layers.{i}."):
                zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                theirs[name] = torch.zeros_like(t) if zero else t  # the rest keeps this run's random init
        grown.append(f"layer {i} added as the identity (o_proj, down_proj zero)")
    bad = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if bad:
        raise IncompatibleDraftError(f"--init draft:{path}: shapes differ from this run's draft at {bad[:4]}")
    draft.load_state_dict({k: v.to(ours[k].dtype) for k, v in theirs.items() if k in ours}, strict=False)
    return grown


def initialise(draft: DFlashDraft, target: Any, spec: str) -> list[str]:
    """Apply `--init` (`random`, `target` or `draft:PATH`). Returns notes for the log: what kept its
    random init (target), or what was grown (draft)."""
    if spec == "random":
        return []
    if spec == "target":
        return init_from_target(draft, target)
    if spec.startswith("draft:"):
        return init_from_draft(draft, spec.split(":", 1)[1])
    raise ConfigError(f"--init must be random, target or draft:PATH, got {spec!r}")
