"""The lean engine's "gguf" precision: each layer's products built from the GGUF file's own
quantized blocks (read with the `gguf` library), not from transformers' dequantized copy.

Q4_0 / Q4_1 tensors become int4 products with the same groups, scales and offsets
(`quant.gguf_int4`); any other type is dequantized by the `gguf` library and multiplied in
bf16. llama.cpp stores Llama's q/k rows permuted for its RoPE layout; they are put back in
transformers' order (`quant.unpermute_rows`), row permutations leave the K-groups intact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dflash_robot.errors import UnsupportedModelError
from dflash_robot.targets.quant import Int4Weight, bf16_linear, gguf_int4, int4_linear, unpermute_rows

PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


class GGUFLayerWeights:
    def __init__(self, path: str | Path, n_heads: int, n_kv: int):
        from gguf import GGUFReader

        self.path = str(path)
        try:
            reader = GGUFReader(self.path)
        except Exception as e:  # noqa: BLE001 - the reader raises many types on a bad file
            raise UnsupportedModelError(f"{path}: cannot read the GGUF for precision 'gguf' ({e})") from e
        self.tensors = {t.name: t for t in reader.tensors}
        self.n_heads, self.n_kv = n_heads, n_kv
        self.kinds: dict[str, int] = {}  # "int4" / "bf16" -> products built (for logs and tests)

    def int4(self, name: str, shape: torch.Size) -> Int4Weight | None:
        t = self.tensors.get(name)
        if t is None:
            raise UnsupportedModelError(f"{self.path}: no tensor {name}")
        w = gguf_int4(t.data, t.tensor_type.name, int(shape[0]), int(shape[1]))
        if w is None:
            return None
        if ".attn_q." in name:
            w = unpermute_rows(w, self.n_heads)
        elif ".attn_k." in name:
            w = unpermute_rows(w, self.n_kv)
        return w

    def build(self, index: int, part: str, hf_weights: list[torch.Tensor], bias: torch.Tensor | None) -> Callable:
        names = [f"blk.{index}.{n}.weight" for n in PARTS[part]]
        parts = [self.int4(n, w.shape) for n, w in zip(names, hf_weights, strict=True)]
        if all(p is not None for p in parts):
            self.kinds["int4"] = self.kinds.get("int4", 0) + 1
            return int4_linear(Int4Weight.cat(parts), bias)  # type: ignore[arg-type]
        self.kinds["bf16"] = self.kinds.get("bf16", 0) + 1  # transformers' dequantized copy, in bf16
        return bf16_linear(torch.cat([w.detach() for w in hf_weights]), bias)
