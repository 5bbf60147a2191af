"""Start the lean engine from a converted snapshot without transformers.

A GGUF target is converted once into `cache_root()/converted/<name>-<digest>-<dtype>/`
(`loading.py`: config.json, model.safetensors, the tokenizer files). A later start of the lean
engine needs from it only the config, the norm weights, the embedding table (its head, when tied)
and, for precisions other than "gguf", the layer weights; the "gguf" precision reads its layer
products from the int4 cache (`gguf_weights.py`). Building transformers' model object for that, and
importing transformers at all, was most of a second start (~2 s of imports, measured with
`python -X importtime` on 2026-11-30).

`SnapshotModel` is the snapshot seen through the attributes `LeanTargetAdapter` reads of a
transformers model (`.config`, `.model.layers[i].self_attn.q_proj.weight`, ...). Its weights are
read from the memory-mapped safetensors file on first use, so the int4 path never reads the
fp32 layer weights. Only the "default" RoPE is computed here (the other types take the
transformers path). The transformers model itself is still loaded on demand
(`LeanTargetAdapter.model`), e.g. for `bench --hf-generate`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


class _LazyWeight:
    """A weight of the snapshot: its shape now, its values (`detach()`) when a product needs them."""

    def __init__(self, file: Any, name: str):
        self._file, self.name = file, name
        self.shape = torch.Size(file.get_slice(name).get_shape())

    def detach(self) -> torch.Tensor:
        return self._file.get_tensor(self.name)


def snapshot_config(directory: Path) -> dict[str, Any] | None:
    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def open_snapshot(directory: Path) -> tuple[SnapshotModel, Any] | None:
    """(the snapshot's model, its `SnapshotTokenizer`) when the lean engine can start from it
    without transformers: complete, a lean-engine architecture (`lean.unsupported_reason`) with the
    default RoPE, every weight present, and a tokenizer verified against transformers' own
    (`tokenizer.verify_against`). None otherwise: the caller takes the transformers path, which
    also reports whatever is wrong."""
    from dflash_robot.targets.lean import unsupported_reason
    from dflash_robot.targets.tokenizer import SnapshotTokenizer, verified

    cfg = snapshot_config(directory)
    if cfg is None or not (directory / "model.safetensors").is_file() or not verified(directory):
        return None
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling") or rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    try:
        model = SnapshotModel(directory, cfg)
        if unsupported_reason(model) is not None:
            return None
        return model, SnapshotTokenizer(directory)
    except Exception:  # noqa: BLE001 - a damaged snapshot (any reader error) only costs the fast path
        return None


def eligible(directory: Path) -> bool:
    return open_snapshot(directory) is not None


class SnapshotModel:
    """The snapshot through a transformers model's attribute names (module doc)."""

    def __init__(self, directory: Path, cfg: dict[str, Any] | None = None):
        from safetensors import safe_open

        cfg = cfg if cfg is not None else snapshot_config(directory)
        if cfg is None:
            raise ValueError(f"{directory}: no readable config.json")
        self.directory = directory
        self.config = SimpleNamespace(**cfg)
        self._file = safe_open(str(directory / "model.safetensors"), framework="pt")
        names = set(self._file.keys())

        def w(name: str) -> _LazyWeight | None:
            return _LazyWeight(self._file, name) if name in names else None

        def t(name: str) -> torch.Tensor | None:
            return self._file.get_tensor(name) if name in names else None

        def linear(prefix: str) -> SimpleNamespace:
            return SimpleNamespace(weight=w(prefix + ".weight"), bias=t(prefix + ".bias"))

        def norm(prefix: str) -> SimpleNamespace | None:
            x = t(prefix + ".weight")
            return None if x is None else SimpleNamespace(weight=x)

        required = ["model.embed_tokens.weight", "model.norm.weight"] + [
            f"model.layers.{i}.{n}.weight" for i in range(int(cfg["num_hidden_layers"])) for n in (
                "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        missing = [n for n in required if n not in names]
        if missing:
            raise KeyError(f"{directory}: the snapshot lacks {missing[:3]}")

        layers = []
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}."
            attn = SimpleNamespace(**{n: linear(p + "self_attn." + n)
                                      for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
            for n in ("q_norm", "k_norm"):
                if norm(p + "self_attn." + n) is not None:
                    setattr(attn, n, norm(p + "self_attn." + n))
            mlp = SimpleNamespace(**{n: linear(p + "mlp." + n) for n in ("gate_proj", "up_proj", "down_proj")})
            layers.append(SimpleNamespace(self_attn=attn, mlp=mlp, input_layernorm=norm(p + "input_layernorm"),
                                          post_attention_layernorm=norm(p + "post_attention_layernorm")))
        embed = t("model.embed_tokens.weight")
        self._embed = SimpleNamespace(weight=embed)
        head = t("lm_head.weight")
        tied = cfg.get("tie_word_embeddings", True) or head is None
        self._head = SimpleNamespace(weight=embed if tied else head, bias=None)
        d = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        base = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        from dflash_robot.targets.lean import default_inv_freq

        inv_freq = default_inv_freq(base, d)
        self.model = SimpleNamespace(layers=layers, norm=norm("model.norm"),
                                     rotary_emb=SimpleNamespace(inv_freq=inv_freq, attention_scaling=1.0))

    def eval(self) -> SnapshotModel:
        return self

    def get_input_embeddings(self) -> SimpleNamespace:
        return self._embed

    def get_output_embeddings(self) -> SimpleNamespace:
        return self._head

    def eos_token_ids(self) -> set[int]:
        """EOS ids named by config.json and generation_config.json (what transformers reads)."""
        ids: set[int] = set()
        sources = [vars(self.config)]
        gen: Any = None
        gen_file = self.directory / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except ValueError:
                gen = None
        if isinstance(gen, dict):
            sources.append(gen)
        for src in sources:
            e = src.get("eos_token_id")
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, list):
                ids.update(int(i) for i in e)
        return ids
