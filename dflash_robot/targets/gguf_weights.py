"""The lean engine's "gguf" precision: each layer's products built from the GGUF file's own
quantized blocks (read with the `gguf` library), not from transformers' dequantized copy.

Q4_0 / Q4_1 tensors become int4 products with the same groups, scales and offsets
(`quant.gguf_int4`); any other type is dequantized by the `gguf` library and multiplied in
bf16. llama.cpp stores a llama model's q/k rows permuted for its RoPE layout; they are put back in
transformers' order (`quant.unpermute_rows`; row permutations leave the K-groups intact). Other
architectures are stored unpermuted, as transformers reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dflash_robot.errors import UnsupportedModelError
from dflash_robot.targets.quant import (
    Int4Weight,
    Int8GroupWeight,
    bf16_linear,
    gguf_int4,
    gguf_q8_0,
    int4_linear,
    unpermute_rows,
)

PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


class GGUFLayerWeights:
    """The decoder blocks' Q4 tensors of one GGUF as `Int4Weight`s (q/k rows already in
    transformers' order).

    Parsing a GGUF with `gguf.GGUFReader` reads every metadata field, the tokenizer's 49K
    strings included, which took seconds; so the int4 form of the block tensors and the type of
    every tensor are cached once per file content (`int4_cache_path`, safetensors with 4-bit values
    stored a byte each) and a later start never parses the GGUF. A cache that cannot be read, or
    of another format version, is rebuilt."""

    def __init__(self, path: str | Path, n_heads: int, n_kv: int, cache: bool = True):
        self.path = str(path)
        self.n_heads, self.n_kv = n_heads, n_kv
        self.kinds: dict[str, int] = {}  # "int4" / "bf16" -> products built (for logs and tests)
        self.types, self._int4, heads, self._q8 = _load_int4(Path(path), cache)
        if heads is not None and heads != (n_heads, n_kv):
            raise UnsupportedModelError(f"{path}: the GGUF has {heads[0]}/{heads[1]} attention/KV heads, the "
                                        f"model {n_heads}/{n_kv}")

    def int4(self, name: str, shape: torch.Size) -> Int4Weight | None:
        if name not in self.types:
            raise UnsupportedModelError(f"{self.path}: no tensor {name}")
        w = self._int4.get(name)
        if w is None:
            return None
        if tuple(w.q.shape) != (int(shape[0]), int(shape[1])):
            raise UnsupportedModelError(f"{self.path}: {name} has shape {tuple(w.q.shape)}, the model expects "
                                        f"{tuple(shape)}")
        return w

    def head(self, hf_weight: torch.Tensor) -> Int8GroupWeight | None:
        """The output head's own Q8_0 blocks: `output.weight`, or `token_embd.weight` for a model
        whose head is tied to its embeddings; only when they are exactly what transformers
        dequantized into the model's head (`hf_weight`, compared whole, 4,096 rows at a time).
        Else None."""
        for name in ("output.weight", "token_embd.weight"):
            w = self._q8.get(name)
            if w is not None and tuple(w.q.shape) == tuple(hf_weight.shape):
                rows = range(0, w.q.shape[0], 4096)
                if all(torch.equal(w.dequantize(slice(i, i + 4096)), hf_weight[i:i + 4096].float()) for i in rows):
                    return w
        return None

    def build(self, index: int, part: str, hf_weights: list[torch.Tensor], bias: torch.Tensor | None,
              native: bool = False) -> Callable:
        """One fused product of layer `index` (`native`: as `quant.int4_linear`; an engine on the
        fused kernels also runs their AMX product where there is one)."""
        names = [f"blk.{index}.{n}.weight" for n in PARTS[part]]
        parts = [self.int4(n, w.shape) for n, w in zip(names, hf_weights, strict=True)]
        if all(p is not None for p in parts):
            self.kinds["int4"] = self.kinds.get("int4", 0) + 1
            return int4_linear(Int4Weight.cat(parts), bias, native, amx=native)  # type: ignore[arg-type]
        self.kinds["bf16"] = self.kinds.get("bf16", 0) + 1  # transformers' dequantized copy, in bf16
        return bf16_linear(torch.cat([w.detach() for w in hf_weights]), bias)


CACHE_VERSION = "3"  # bump when the cached form changes: older caches are then rebuilt


def int4_cache_path(path: Path) -> Path:
    from dflash_robot.targets.loading import cache_root, gguf_digest

    return cache_root() / "gguf-int4" / f"{path.stem}-{gguf_digest(path)[:20]}-v{CACHE_VERSION}.safetensors"


def gguf_tensor_types(path: str | Path, cache: bool = True) -> dict[str, str]:
    """name -> ggml type name of every tensor of a GGUF (from the int4 cache, built on a miss)."""
    p = Path(path)
    if cache:
        hit = _read_cache(int4_cache_path(p), types_only=True)
        if hit is not None:
            return hit[0]
        return _load_int4(p, cache=True)[0]
    return {t.name: t.tensor_type.name for t in _reader(p).tensors}


def _reader(path: Path):  # noqa: ANN202 - gguf.GGUFReader
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises many types on a bad file
        raise UnsupportedModelError(f"{path}: cannot read the GGUF for precision 'gguf' ({e})") from e


Heads = tuple[int, int] | None  # (attention heads, KV heads) read from a llama GGUF, else None


Loaded = tuple[dict[str, str], dict[str, Int4Weight], Heads, dict[str, Int8GroupWeight]]


def _read_cache(file: Path, types_only: bool = False) -> Loaded | None:
    if not file.is_file():
        return None
    import json

    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("version") != CACHE_VERSION:
                raise ValueError(f"format version {meta.get('version')!r}, expected {CACHE_VERSION}")
            types = json.loads(meta["types"])
            heads = json.loads(meta["heads"])
            heads = None if heads is None else (int(heads[0]), int(heads[1]))
            if types_only:
                return types, {}, heads, {}
            out = {}
            for name in json.loads(meta["int4"]):
                q = f.get_tensor(name + ".q").to(torch.int32)
                out[name] = Int4Weight(q, f.get_tensor(name + ".scale"), f.get_tensor(name + ".zero"))
            q8 = {name: Int8GroupWeight(f.get_tensor(name + ".q8"), f.get_tensor(name + ".d"))
                  for name in json.loads(meta["q8"])}
            return types, out, heads, q8
    except Exception as e:  # noqa: BLE001 - a damaged cache only costs a rebuild
        import logging

        logging.getLogger(__name__).warning("ignoring the unreadable int4 cache %s: %s", file, e)
        return None


def _field(reader, key: str):  # noqa: ANN001, ANN202 - gguf.GGUFReader, a scalar field value
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _load_int4(path: Path, cache: bool) -> Loaded:
    file = int4_cache_path(path) if cache else None
    if file is not None:
        hit = _read_cache(file)
        if hit is not None:
            return hit
    reader = _reader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    arch = _field(reader, "general.architecture")
    heads: Heads = None
    if arch == "llama":
        # llama.cpp's converter permutes a llama model's q/k rows for its RoPE layout; transformers
        # undoes it for llama only (its other GGUF architectures are stored unpermuted)
        h, kv = _field(reader, "llama.attention.head_count"), _field(reader, "llama.attention.head_count_kv")
        heads = (int(h), int(kv if kv is not None else h))
    int4: dict[str, Int4Weight] = {}
    q8: dict[str, Int8GroupWeight] = {}
    for t in reader.tensors:
        if t.name in ("output.weight", "token_embd.weight") and len(t.shape) == 2:  # the head's own blocks
            k, n = (int(x) for x in t.shape)
            w8 = gguf_q8_0(t.data, t.tensor_type.name, n, k)
            if w8 is not None:
                q8[t.name] = w8
            continue
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # ggml lists dims innermost first
        w = gguf_int4(t.data, t.tensor_type.name, n, k)
        if w is None:
            continue
        if heads is not None and ".attn_q." in t.name:
            w = unpermute_rows(w, heads[0])
        elif heads is not None and ".attn_k." in t.name:
            w = unpermute_rows(w, heads[1])
        int4[t.name] = w
    if file is not None:
        _write_cache(file, types, int4, heads, q8)
    return types, int4, heads, q8


def _write_cache(file: Path, types: dict[str, str], int4: dict[str, Int4Weight], heads: Heads,
                 q8: dict[str, Int8GroupWeight]) -> None:
    import json
    import os

    from safetensors.torch import save_file

    tensors = {}
    for name, w in int4.items():
        tensors[name + ".q"] = w.q.to(torch.uint8).contiguous()  # 0..15
        tensors[name + ".scale"] = w.scale.contiguous()
        tensors[name + ".zero"] = w.zero.contiguous()
    for name, w8 in q8.items():
        tensors[name + ".q8"] = w8.q.contiguous()
        tensors[name + ".d"] = w8.scale.contiguous()
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"version": CACHE_VERSION, "types": json.dumps(types),
                                               "int4": json.dumps(sorted(int4)), "heads": json.dumps(heads),
                                               "q8": json.dumps(sorted(q8))})
        tmp.replace(file)
    except OSError as e:  # a read-only cache only costs the next start
        import logging

        logging.getLogger(__name__).warning("could not cache the int4 weights in %s: %s", file, e)
        tmp.unlink(missing_ok=True)
