"""Target adapters: the one interface (`TargetAdapter`) over every target the runtime drives.

- `base`: the protocol, `TargetOutput`, `CacheSnapshot`, the shared chunked prefill/verify;
- `hf`: any attention-only transformers causal LM (full or sliding-window cache);
- `lean`: a lean forward for Llama / Qwen2 / Qwen3 (fused, packed, preallocated cache);
- `stateful`: hybrid linear-attention / SSM targets, rollback by replay or state capture;
- `capabilities`, `factory`: what a model can do, and the adapter chosen from that;
- `loading`: a target model and tokenizer from a Hugging Face directory or a GGUF file.
"""

from typing import Any

from dflash_robot.targets.base import CacheSnapshot, ChunkedForwardAdapter, TargetAdapter, TargetOutput

_LAZY = {"ENGINES": "factory", "make_target_adapter": "factory", "HFTargetAdapter": "hf"}


def __getattr__(name: str) -> Any:
    """`factory` and `hf` import transformers: loaded when first asked for, so that a start
    that never needs transformers (targets/snapshot.py) does not pay for its import."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"dflash_robot.targets.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENGINES", "CacheSnapshot", "ChunkedForwardAdapter", "HFTargetAdapter", "TargetAdapter", "TargetOutput",
           "make_target_adapter"]
