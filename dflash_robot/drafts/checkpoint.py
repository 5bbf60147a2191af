"""Load and save drafts in z-lab's checkpoint format, unchanged.

A draft directory holds:
- `config.json`: a Qwen3Config with `architectures: ["DFlashDraftModel"]`, top-level
  `block_size` and `num_target_layers`, and `dflash_config` (see `DraftMetadata`);
- `model.safetensors`: `fc`, `hidden_norm`, `norm` and `layers.{i}.*` tensors only.
  Embedding and lm_head come from the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_robot.drafts.metadata import DraftMetadata
from dflash_robot.drafts.model import DFlashDraft, rotary_embedding
from dflash_robot.errors import ConfigError, DraftLoadError, UnsupportedModelError

#: the draft shipped for the default target (SmolLM2-135M-Instruct)
SHIPPED_DRAFT = Path(__file__).parent / "smollm2-135m-instruct"

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_SUPPORTED_ARCH = "DFlashDraftModel"
# Keys of Qwen3Config that only describe the draft's relation to the target.
_DFLASH_TOP_LEVEL = ("block_size", "num_target_layers", "dflash_config")
_VOCAB_TENSORS = ("d2t", "t2d")  # the draft vocabulary, EAGLE-3's names


def _read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise DraftLoadError(f"{path}: no {CONFIG_NAME}; is this a DFlash draft directory?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftLoadError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise DraftLoadError(f"{cfg_path}: expected a JSON object")
    return cfg


def _check_supported(cfg: dict[str, Any], source: Path) -> None:
    archs = cfg.get("architectures") or [_SUPPORTED_ARCH]
    if _SUPPORTED_ARCH not in archs:
        raise UnsupportedModelError(f"{source}: draft architecture {archs} is not supported; "
                                    f"only {_SUPPORTED_ARCH} (plain DFlash) is")
    dflash = cfg.get("dflash_config") or {}
    if any(k in dflash for k in ("conv_kernel_size", "selector_rank")):
        raise UnsupportedModelError(f"{source}: DFlash-2 drafts (dynamic conv, candidate "
                                    "selector) are not supported")
    layer_types = cfg.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd or cfg.get("is_causal"):
        raise UnsupportedModelError(f"{source}: draft layers {odd or 'with is_causal'} are not "
                                    "supported; only bidirectional full-attention draft layers are")


class DraftConfig:
    """The Qwen3Config part of a draft's config dict, read without importing transformers (its
    import cost ~2 s of every start): attribute access with Qwen3Config's defaults for the fields
    the draft reads, and `to_dict()` giving back what was read. Configs this does not cover
    (RoPE scaling, a legacy `rope_scaling`) are built as transformers' Qwen3Config instead."""

    _DEFAULTS: dict[str, Any] = {"attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                                 "max_position_embeddings": 32768, "initializer_range": 0.02}
    _REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

    def __init__(self, cfg: dict[str, Any]):
        missing = [k for k in self._REQUIRED if not isinstance(cfg.get(k), int)]
        if missing:
            raise ValueError(f"missing or non-integer {', '.join(missing)}")
        self._cfg = dict(cfg)
        self._values = {**self._DEFAULTS, **cfg}
        heads = self._values["num_attention_heads"]
        # Qwen3Config's defaults: 32 KV heads and head_dim 128 when absent; KV heads None = all heads
        kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else 32
        self._values["num_key_value_heads"] = heads if kv is None else kv
        self._values["head_dim"] = cfg["head_dim"] if "head_dim" in cfg else 128
        self._values["rope_parameters"] = cfg.get("rope_parameters") or {
            "rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._cfg)

    @staticmethod
    def covers(cfg: dict[str, Any]) -> bool:
        rope = cfg.get("rope_parameters") or {}
        return not cfg.get("rope_scaling") and rope.get("rope_type", rope.get("type", "default")) == "default"


def qwen3_config(cfg: dict[str, Any]) -> Any:
    """The Qwen3Config part of a draft's config dict (a `DraftConfig` where it covers it)."""
    kwargs = {k: v for k, v in cfg.items() if k not in _DFLASH_TOP_LEVEL}
    if DraftConfig.covers(kwargs):
        return DraftConfig(kwargs)
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    return Qwen3Config(**kwargs)


def load_draft(path: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> DFlashDraft:
    """Load a z-lab format draft directory, or a .gguf draft file. dtype None keeps the
    checkpoint's dtype."""
    path = Path(path)
    if not path.exists():
        raise DraftLoadError(f"draft path {path} does not exist")
    if path.is_file() and path.suffix.lower() == ".gguf":  # one-file draft, see drafts/gguf.py
        from dflash_robot.drafts.gguf import load_gguf_draft

        return load_gguf_draft(path, dtype=dtype, device=device)
    if not path.is_dir():
        raise DraftLoadError(f"draft path {path} is not a directory (expected config.json + "
                             f"{WEIGHTS_NAME}) or a .gguf file")
    cfg = _read_config(path)
    _check_supported(cfg, path)
    try:
        metadata = DraftMetadata.from_config_dict(cfg, source=str(path / CONFIG_NAME))
        config = qwen3_config(cfg)
    except (ConfigError, TypeError, ValueError) as e:
        raise DraftLoadError(f"{path / CONFIG_NAME}: {e}") from e
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise DraftLoadError(f"{path}: no {WEIGHTS_NAME}")
    try:
        state = load_file(str(weights), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DraftLoadError(f"{weights}: corrupt or truncated safetensors file ({e})") from e
    with torch.device("meta"):
        draft = DFlashDraft(config, metadata)
    _check_state(draft, state, weights)
    file_dtype = state["fc.weight"].dtype
    draft.load_state_dict(state, assign=True, strict=False)
    # the rotary buffers are not saved; rebuild them on the real device
    with torch.device(device):
        draft.rotary_emb = rotary_embedding(config)
    return draft.to(dtype=dtype or file_dtype)


def _check_state(draft: DFlashDraft, state: dict[str, torch.Tensor], source: Path) -> None:
    expected = {k: v.shape for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DraftLoadError(f"{source}: tensor names do not match the config: missing "
                             f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                             f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise DraftLoadError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                                 f"the config implies {tuple(shape)}")
    bad = sorted({str(t.dtype) for k, t in state.items() if not t.is_floating_point() and k not in _VOCAB_TENSORS})
    if bad:
        raise DraftLoadError(f"{source}: non-floating-point weights ({bad})")
    if "d2t" in state:
        _check_vocab(state["d2t"], state["t2d"], source)


def _check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, source: Path) -> None:
    """d2t (int64 offsets) and t2d (bool mask) must describe the same sorted id set."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise DraftLoadError(f"{source}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    ids = torch.arange(d2t.shape[0]) + d2t.cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.shape[0] or bool((ids[1:] <= ids[:-1]).any())):
        raise DraftLoadError(f"{source}: d2t does not map to distinct, sorted ids in [0, {t2d.shape[0]})")
    if int(t2d.sum()) != ids.numel() or not bool(t2d.cpu()[ids].all()):
        raise DraftLoadError(f"{source}: d2t and t2d disagree about the draft vocabulary")


def draft_config_dict(draft: DFlashDraft) -> dict[str, Any]:
    config = draft.config
    if isinstance(config, DraftConfig):  # written as a whole Qwen3Config, as z-lab's loader expects
        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

        config = Qwen3Config(**config.to_dict())
    cfg = config.to_dict()
    for key in ("transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [_SUPPORTED_ARCH]
    cfg["num_hidden_layers"] = len(draft.layers)
    cfg.update(draft.metadata.to_config_entries())
    return cfg


def ensure_writable_dir(path: Path) -> None:
    """Create `path` if needed and prove a file can be written there, or raise ConfigError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output directory {path} is not writable: {e}") from e


def save_draft(draft: DFlashDraft, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors in z-lab's format."""
    path = Path(path)
    ensure_writable_dir(path)
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous().cpu()
             for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    tmp = path / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / WEIGHTS_NAME)
    tmp = path / (CONFIG_NAME + ".tmp")
    tmp.write_text(json.dumps(draft_config_dict(draft), indent=2, sort_keys=True) + "\n")
    tmp.replace(path / CONFIG_NAME)  # a crash leaves the previous config, never half of one
    return path
