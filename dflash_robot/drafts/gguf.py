"""DFlash drafts as single GGUF files (schema: docs/DRAFT_FORMAT.md).

Keys and tensor names are llama.cpp's `dflash` architecture wherever llama.cpp has them;
what it lacks (training block size, loss decay, target depth, ...) lives under
`dflash_robot.*`. Files are written with `gguf.GGUFWriter` and read with `gguf.GGUFReader`;
quantized weights (Q8_0, ...) are dequantized with `gguf.quants.dequantize` on load.

Two llama.cpp conventions differ from z-lab's `config.json` and are converted here:
- `dflash.target_layers` holds z-lab's `target_layer_ids` + 1 (llama.cpp taps a layer's
  *input*; the input of layer id + 1 is the output of layer id, i.e. hidden_states[id + 1]);
- the `d2t` tensor holds absolute target ids [N] (llama.cpp scatters logits with it), while
  the in-memory `DFlashDraft.d2t` buffer holds EAGLE-3 offsets (target id = i + d2t[i]).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from dflash_robot.drafts.checkpoint import _check_state, qwen3_config
from dflash_robot.drafts.metadata import DraftMetadata, default_loss_decay
from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.errors import ConfigError, DraftLoadError, IncompatibleDraftError, UnsupportedModelError

ARCH = "dflash"  # llama.cpp's LLM_ARCH_DFLASH
FORMAT_VERSION = 1
OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")

# llama.cpp keys (src/llama-arch.cpp LLM_KV_NAMES with "%s" = "dflash")
K_ARCH = "general.architecture"
K_MASK = "tokenizer.ggml.mask_token_id"  # read by llama_vocab_mask()
K_TOKENS = "tokenizer.ggml.tokens"
K_OLD_MASK = "dflash.mask_token_id"  # written by the first llama.cpp converter (PR #22105); read only
K_CTX, K_EMBD, K_LAYERS, K_FF = (f"{ARCH}.{k}" for k in (
    "context_length", "embedding_length", "block_count", "feed_forward_length"))
K_HEADS, K_KV_HEADS, K_KEY_LEN, K_VALUE_LEN, K_EPS, K_CAUSAL = (f"{ARCH}.attention.{k}" for k in (
    "head_count", "head_count_kv", "key_length", "value_length", "layer_norm_rms_epsilon", "causal"))
K_ROPE_BASE = f"{ARCH}.rope.freq_base"
K_VOCAB = f"{ARCH}.vocab_size"
K_BLOCK = f"{ARCH}.block_size"
K_TARGET_LAYERS = f"{ARCH}.target_layers"
K_TARGET_HIDDEN = f"{ARCH}.target_hidden_size"
K_LOGIT_SCALE = f"{ARCH}.logit_scale"
K_SOFTCAP = f"{ARCH}.final_logit_softcapping"
# ours (llama.cpp has no such key)
X = "dflash_robot"
X_F64 = f"{X}.f64."  # + a llama.cpp F32 key: its exact value, when float32 would change it
X_VERSION, X_TRAIN_BLOCK, X_LOSS_DECAY, X_NUM_TARGET, X_EMB_SCALE, X_VOCAB, X_DTYPE, X_ROPE = (
    f"{X}.{k}" for k in ("format_version", "training_block_size", "loss_decay", "num_target_layers",
                         "input_embedding_scale", "draft_vocab_size", "torch_dtype", "rope_parameters"))
X_PROMPT_VOCAB = f"{X}.prompt_vocab"  # bool: DraftMetadata.prompt_vocab
X_HINT_NGRAM = f"{X}.hint_ngram"  # [min, max] uint32: DraftMetadata.hint_ngram

# z-lab tensor name -> GGUF tensor name (llama.cpp's src/models/dflash.cpp, load_arch_tensors)
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
        "norm.weight": "output_norm.weight", "d2t": "d2t", "t2d": f"{X}.t2d"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_AUTO = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def gguf_name(name: str) -> str:
    """z-lab tensor name -> GGUF tensor name (KeyError if the draft has no such tensor)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(name)
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"


def zlab_name(name: str) -> str | None:
    """GGUF tensor name -> z-lab tensor name, or None for a name this schema does not know."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER_BACK:
        return None
    return f"layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"


# --- writing ---------------------------------------------------------------------------

def save_gguf_draft(draft: DFlashDraft, path: str | Path, outtype: str = "auto",
                    tokenizer_from: str | Path | None = None) -> Path:
    """Write `draft` as one GGUF file. outtype: auto (the draft's own dtype), f32, f16, bf16 or
    q8_0; 1-D tensors (norms) stay F32 whatever the outtype, as in llama.cpp's converter.
    `tokenizer_from`: the target's GGUF file, whose `tokenizer.ggml.*` keys are copied in (as
    llama.cpp's converter does with --target-model-dir): llama.cpp loads no model without a
    vocabulary. This runtime does not need them."""
    path = Path(path)
    src_dtype = draft.fc.weight.dtype
    if outtype == "auto":
        outtype = _AUTO.get(src_dtype, "f32")
    if outtype not in _FILE_TYPE:
        raise ConfigError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    _check_exportable(draft)
    tokenizer = target_tokenizer_fields(tokenizer_from, draft.shape.vocab_size) if tokenizer_from else []
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    _write_keys(w, draft, outtype, src_dtype)
    for f in tokenizer:
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for name, t in draft.state_dict().items():
        if not name.startswith("rotary_emb.") and name != "t2d":  # t2d follows from d2t; llama.cpp refuses
            # a file with tensors its loader does not take ("wrong number of tensors")
            data, qtype = _encode(name, t, outtype)
            w.add_tensor(gguf_name(name), data, raw_shape=data.shape if qtype else None, raw_dtype=qtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(path)
    except OSError as e:
        w.close()
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the GGUF draft {path}: {e}") from e
    return path


def target_tokenizer_fields(target_gguf: str | Path, vocab_size: int) -> list[Any]:
    """The `tokenizer.*` fields of a target GGUF file (not its mask token: the draft's is written),
    checked to hold `vocab_size` tokens, the draft's vocabulary."""
    p = Path(target_gguf)
    if not p.is_file() or p.suffix.lower() != ".gguf":
        raise ConfigError(f"{p}: the tokenizer source must be the target's .gguf file")
    try:
        fields = gguf.GGUFReader(p).fields
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise ConfigError(f"{p}: corrupt or truncated GGUF file ({e})") from e
    tokens = fields.get(K_TOKENS)
    if tokens is None:
        raise ConfigError(f"{p}: no {K_TOKENS} key; it holds no tokenizer to copy")
    if len(tokens.data) != vocab_size:
        raise IncompatibleDraftError(f"{p}: its tokenizer has {len(tokens.data)} tokens, the draft's vocabulary "
                                     f"{vocab_size}: not this draft's target")
    return [f for k, f in fields.items() if k.startswith("tokenizer.") and k != K_MASK]


def _check_exportable(draft: DFlashDraft) -> None:
    cfg = draft.config
    if getattr(cfg, "attention_bias", False):
        raise UnsupportedModelError("drafts with attention biases have no GGUF tensor names here")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"draft activation {cfg.hidden_act!r}: llama.cpp's DFlash draft uses silu")


def _write_keys(w: gguf.GGUFWriter, draft: DFlashDraft, outtype: str, src_dtype: torch.dtype) -> None:
    cfg, meta, s = draft.config, draft.metadata, draft.shape
    w.add_uint32("general.file_type", int(_FILE_TYPE[outtype]))
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for key, val in ((K_CTX, cfg.max_position_embeddings), (K_EMBD, s.hidden_size), (K_LAYERS, s.num_layers),
                     (K_FF, cfg.intermediate_size), (K_HEADS, cfg.num_attention_heads),
                     (K_KV_HEADS, s.num_kv_heads), (K_KEY_LEN, s.head_dim), (K_VALUE_LEN, s.head_dim),
                     (K_VOCAB, s.vocab_size), (K_BLOCK, meta.block_size), (K_TARGET_HIDDEN, s.hidden_size),
                     (K_MASK, meta.mask_token_id), (X_VERSION, FORMAT_VERSION),
                     (X_TRAIN_BLOCK, meta.training_block_size), (X_NUM_TARGET, meta.num_target_layers)):
        w.add_uint32(key, int(val))
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    _add_f32(w, K_EPS, float(cfg.rms_norm_eps))
    _add_f32(w, K_ROPE_BASE, float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_bool(K_CAUSAL, False)
    w.add_array(K_TARGET_LAYERS, [int(i) + 1 for i in meta.target_layer_ids])
    w.add_float64(X_LOSS_DECAY, float(meta.loss_decay))
    w.add_string(X_DTYPE, str(src_dtype).removeprefix("torch."))
    if rope.get("rope_type", "default") != "default":
        w.add_string(X_ROPE, json.dumps(rope, sort_keys=True))
    if meta.output_multiplier != 1.0:
        _add_f32(w, K_LOGIT_SCALE, float(meta.output_multiplier))
    if meta.final_logit_softcapping is not None:
        _add_f32(w, K_SOFTCAP, float(meta.final_logit_softcapping))
    if meta.input_embedding_scale != 1.0:
        w.add_float64(X_EMB_SCALE, float(meta.input_embedding_scale))
    if meta.draft_vocab_size is not None:
        w.add_uint32(X_VOCAB, int(meta.draft_vocab_size))
    if meta.prompt_vocab:
        w.add_bool(X_PROMPT_VOCAB, True)
    if meta.hint_ngram is not None:
        w.add_array(X_HINT_NGRAM, [int(n) for n in meta.hint_ngram])


def _f32(v: Any) -> float:
    """The shortest decimal of float32(v): 1e-6 stays 1e-6 through an F32 key."""
    return float(str(np.float32(v)))


def _add_f32(w: gguf.GGUFWriter, key: str, val: float) -> None:
    """An F32 key (llama.cpp's type), plus its exact F64 value under X_F64 when float32 changes it."""
    w.add_float32(key, val)
    if _f32(val) != val:
        w.add_float64(X_F64 + key, val)


def _encode(name: str, t: torch.Tensor, outtype: str) -> tuple[np.ndarray, QType | None]:
    """A state-dict tensor -> (numpy data, raw GGML type or None when numpy's dtype says it)."""
    if name == "d2t":  # offsets -> the absolute target ids llama.cpp indexes with
        return (t.cpu() + torch.arange(t.shape[0])).numpy().astype(np.int64), None
    x = t.detach().cpu().float().numpy()
    if t.ndim <= 1 or outtype == "f32":
        return x, None
    if outtype == "f16":
        return x.astype(np.float16), None
    qtype = QType.BF16 if outtype == "bf16" else QType.Q8_0
    try:
        return gguf.quants.quantize(x, qtype), qtype
    except gguf.QuantError:  # rows not a multiple of the block size: llama.cpp falls back to F16
        return x.astype(np.float16), None


# --- reading ---------------------------------------------------------------------------

def load_gguf_draft(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> DFlashDraft:
    """Load a GGUF draft. dtype None: the dtype it was exported from (`dflash_robot.torch_dtype`),
    else its weights' storage type (F16 -> float16, BF16 -> bfloat16, otherwise float32)."""
    path = Path(path)
    reader = _open(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = fields.get(K_ARCH)
    if arch != ARCH:
        raise DraftLoadError(f"{path}: GGUF architecture {arch!r} is not a DFlash draft (expected {ARCH!r})")
    _check_supported(fields, path)
    d2t = next((t for t in reader.tensors if t.name == "d2t"), None)
    cfg = config_dict(fields, str(path), None if d2t is None else int(d2t.n_elements))
    try:
        metadata = DraftMetadata.from_config_dict(cfg, source=str(path))
        config = qwen3_config(cfg)
    except (ConfigError, TypeError, ValueError) as e:
        raise DraftLoadError(f"{path}: {e}") from e
    with torch.device("meta"):
        draft = DFlashDraft(config, metadata)
    tensors = _match_tensors(reader, draft, path)
    dtype = dtype or _default_dtype(fields, tensors)
    state = {name: _to_torch(t, dtype, path).to(device) for name, t in tensors.items() if name != "t2d"}
    if metadata.draft_vocab_size is not None:
        _vocab_to_state(state, tensors.get("t2d"), config.vocab_size, path)
    _check_state(draft, state, path)
    draft.load_state_dict(state, assign=True, strict=False)
    with torch.device(device):
        draft.rotary_emb = type(draft.rotary_emb)(config)
    return draft.to(dtype=dtype)


def _check_supported(fields: dict[str, Any], path: Path) -> None:
    """Refuse llama.cpp DFlash variants this runtime does not implement, rather than run them wrong."""
    if any(f"{ARCH}.{k}" in fields for k in ("conv_kernel_size", "selector_rank", "hyper_connection.count")):
        raise UnsupportedModelError(f"{path}: DFlash-2 / DSpark drafts (conv, selector, hyper-connections) "
                                    "are not supported")
    if fields.get(f"{ARCH}.attention.sliding_window") or fields.get(K_CAUSAL):
        raise UnsupportedModelError(f"{path}: sliding-window or causal draft attention is not supported; "
                                    "only bidirectional full-attention draft layers are")


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise DraftLoadError(f"draft path {path} is not a file")
    try:
        reader = gguf.GGUFReader(path)
        short = [t.name for t in reader.tensors if t.data.nbytes != t.n_bytes]
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise DraftLoadError(f"{path}: corrupt or truncated GGUF file ({e})") from e
    if short:
        raise DraftLoadError(f"{path}: truncated GGUF file (tensor data of {short[:3]} is cut off)")
    return reader


def _exact(v: Any) -> float:
    """A float key we write as F64: taken as is."""
    return float(v)


def _get(fields: dict[str, Any], key: str, source: str, kind: Any = int, default: Any = ...) -> Any:
    """One key's value as `kind`. `float` keys are F32 (llama.cpp's type); they are read back as the
    shortest decimal of that float32, so 1e-6 stays 1e-6 (use `_exact` for our F64 keys)."""
    if key not in fields:
        if default is ...:
            raise DraftLoadError(f"{source}: required GGUF key {key!r} is missing")
        return default
    v = fields[key]
    try:
        if isinstance(v, (list, str, bytes)) and kind is not str:
            raise TypeError(type(v).__name__)
        if kind is not float:
            return kind(v)
        exact = fields.get(X_F64 + key)  # ignored once the F32 key was changed on its own
        return exact if isinstance(exact, float) and np.float32(exact) == np.float32(v) else _f32(v)
    except (TypeError, ValueError) as e:
        raise DraftLoadError(f"{source}: GGUF key {key!r} has a bad value {v!r}") from e


def config_dict(fields: dict[str, Any], source: str, d2t_rows: int | None = None) -> dict[str, Any]:
    """GGUF keys -> a z-lab style config dict (Qwen3Config entries + DFlash metadata).
    d2t_rows: rows of a `d2t` tensor, the draft vocabulary size when no key states it."""
    def get(key: str, kind: Any = int, default: Any = ...) -> Any:
        return _get(fields, key, source, kind, default)

    hidden, heads = get(K_EMBD), get(K_HEADS)
    vocab = get(K_VOCAB, default=None) or len(fields.get(K_TOKENS) or []) or get(K_VOCAB)
    cfg: dict[str, Any] = dict(
        architectures=["DFlashDraftModel"], hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
        hidden_size=hidden, num_hidden_layers=get(K_LAYERS), intermediate_size=get(K_FF),
        num_attention_heads=heads, num_key_value_heads=get(K_KV_HEADS, default=heads),
        head_dim=get(K_KEY_LEN, default=hidden // max(heads, 1)), vocab_size=vocab,
        max_position_embeddings=get(K_CTX), rms_norm_eps=get(K_EPS, float),
        rope_parameters=_rope(fields, get(K_ROPE_BASE, float, 10000.0), source))
    dflash = _dflash_entries(fields, source)
    if X_VOCAB in fields:
        dflash["draft_vocab_size"] = get(X_VOCAB)
    elif d2t_rows is not None:
        dflash["draft_vocab_size"] = d2t_rows
    if X_PROMPT_VOCAB in fields:
        flag = fields[X_PROMPT_VOCAB]
        if not isinstance(flag, bool):
            raise DraftLoadError(f"{source}: GGUF key {X_PROMPT_VOCAB!r} must be a bool, got {flag!r}")
        dflash["prompt_vocab"] = flag
    if X_HINT_NGRAM in fields:
        hint = fields[X_HINT_NGRAM]
        if not (isinstance(hint, list) and len(hint) == 2 and all(isinstance(n, int) for n in hint)):
            raise DraftLoadError(f"{source}: GGUF key {X_HINT_NGRAM!r} must be two integers [min, max], got {hint!r}")
        dflash["hint_ngram"] = hint
    cfg.update(dflash_config=dflash, block_size=dflash["block_size"])
    if X_NUM_TARGET in fields:
        cfg["num_target_layers"] = get(X_NUM_TARGET)
    return cfg


def _rope(fields: dict[str, Any], theta: float, source: str) -> dict[str, Any]:
    if X_ROPE not in fields:
        return {"rope_type": "default", "rope_theta": theta}
    try:
        rope = json.loads(fields[X_ROPE])
    except (TypeError, ValueError) as e:
        raise DraftLoadError(f"{source}: GGUF key {X_ROPE!r} is not valid JSON ({e})") from e
    if not isinstance(rope, dict):
        raise DraftLoadError(f"{source}: GGUF key {X_ROPE!r} must be a JSON object")
    return rope


def _dflash_entries(fields: dict[str, Any], source: str) -> dict[str, Any]:
    """The `dflash_config` entries: llama.cpp's keys, then ours (f64, exact)."""
    layers = fields.get(K_TARGET_LAYERS)
    if layers is None:
        raise DraftLoadError(f"{source}: required GGUF key {K_TARGET_LAYERS!r} is missing (the target "
                             "layers the draft reads)")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and i >= 1 for i in layers):
        raise DraftLoadError(f"{source}: {K_TARGET_LAYERS!r} must be a non-empty list of layer ids >= 1 "
                             f"(llama.cpp stores z-lab's target_layer_ids + 1), got {layers!r}")
    if K_MASK not in fields and K_OLD_MASK not in fields:
        raise DraftLoadError(f"{source}: required GGUF key {K_MASK!r} is missing (the draft's mask token)")
    block = _get(fields, K_BLOCK, source, default=16)
    train_block = _get(fields, X_TRAIN_BLOCK, source, default=block)
    out: dict[str, Any] = dict(
        mask_token_id=_get(fields, K_MASK if K_MASK in fields else K_OLD_MASK, source),
        target_layer_ids=[i - 1 for i in layers], block_size=block,
        training_block_size=train_block,
        loss_decay=default_loss_decay(train_block),
        input_embedding_scale=1.0, output_multiplier=_get(fields, K_LOGIT_SCALE, source, float, 1.0))
    for key, name in ((X_LOSS_DECAY, "loss_decay"), (X_EMB_SCALE, "input_embedding_scale")):
        if key in fields:  # written as f64: take the exact value
            out[name] = _get(fields, key, source, _exact)
    if K_SOFTCAP in fields:
        out["final_logit_softcapping"] = _get(fields, K_SOFTCAP, source, float)
    return out


def _match_tensors(reader: gguf.GGUFReader, draft: DFlashDraft, path: Path) -> dict[str, Any]:
    """GGUF tensors by z-lab name, checked against the names and shapes the metadata implies.
    `t2d` may be absent (llama.cpp has none; it is rebuilt from d2t)."""
    expected = {k: tuple(v.shape) for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    found: dict[str, Any] = {}
    unknown = []
    for t in reader.tensors:
        name = zlab_name(t.name)
        if name is None or name not in expected or name in found:
            unknown.append(t.name)
        else:
            found[name] = t
    missing = sorted(gguf_name(k) for k in set(expected) - set(found) - {"t2d"})
    if missing or unknown:
        raise DraftLoadError(f"{path}: GGUF tensors do not match the metadata: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {sorted(unknown)[:5]}")
    for name, t in found.items():
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost first
        if shape != expected[name]:
            raise DraftLoadError(f"{path}: tensor {t.name} ({name}) has shape {shape}, the metadata "
                                 f"implies {expected[name]}")
    return found


def _to_torch(t: Any, dtype: torch.dtype, path: Path) -> torch.Tensor:
    """A ReaderTensor -> a torch tensor in torch's dim order; floats in `dtype`."""
    shape = tuple(int(s) for s in reversed(t.shape))
    if t.tensor_type in (QType.I64, QType.I32, QType.I8):
        return torch.from_numpy(np.array(t.data, dtype=np.int64)).reshape(shape)
    try:
        if t.tensor_type in (QType.F32, QType.F16):
            x = torch.from_numpy(np.array(t.data))
        else:
            x = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    except (NotImplementedError, ValueError) as e:
        raise DraftLoadError(f"{path}: tensor {t.name} of type {t.tensor_type.name} cannot be read ({e})") from e
    return x.reshape(shape).to(dtype)


def _vocab_to_state(state: dict[str, torch.Tensor], t2d: Any, vocab_size: int, path: Path) -> None:
    """GGUF d2t (absolute ids) -> offsets; t2d from its I8 tensor, else rebuilt from d2t."""
    if "d2t" not in state:
        raise DraftLoadError(f"{path}: {X_VOCAB} is set but the d2t tensor is missing")
    ids = state["d2t"].to(torch.int64)
    state["d2t"] = ids - torch.arange(ids.shape[0], device=ids.device)
    if t2d is not None:
        state["t2d"] = torch.from_numpy(np.array(t2d.data)).reshape(-1).ne(0).to(ids.device)
        return
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise DraftLoadError(f"{path}: d2t holds ids outside the vocabulary [0, {vocab_size})")
    t2d_mask = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    t2d_mask[ids] = True
    state["t2d"] = t2d_mask


def _default_dtype(fields: dict[str, Any], tensors: dict[str, Any]) -> torch.dtype:
    if fields.get(X_DTYPE) in _DTYPES:
        return _DTYPES[fields[X_DTYPE]]
    kind = tensors["fc.weight"].tensor_type
    return {QType.F16: torch.float16, QType.BF16: torch.bfloat16}.get(kind, torch.float32)

