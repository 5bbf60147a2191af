"""dflash-robot: lossless DFlash block-diffusion speculative decoding for any transformers target.

    from dflash_robot import DFlashRuntime
    rt = DFlashRuntime.load()                      # SmolLM2-135M-Instruct + the shipped draft
    out = rt.generate("Write a haiku about caches.", max_new_tokens=64)
    print(out.text, out.mean_acceptance_length)
    for delta in rt.stream("Tell me a story."):    # text deltas
        print(delta, end="", flush=True)

Subpackages: `targets` (target adapters), `drafts` (the draft and its formats), `runtime`
(the decode loop, acceptance, sampling, block-size policies, `DFlashRuntime`), `training`,
`bench`, `cli`. Names are imported lazily, so `import dflash_robot` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.1"

_EXPORTS = {
    "DFlashRuntime": "dflash_robot.runtime.api", "Completion": "dflash_robot.runtime.api",
    "GenerationConfig": "dflash_robot.runtime.config", "SamplingConfig": "dflash_robot.runtime.config",
    "GenerationResult": "dflash_robot.runtime.orchestrator", "RuntimeOrchestrator": "dflash_robot.runtime.orchestrator",
    "StepEvent": "dflash_robot.runtime.orchestrator",
    "AdaptiveBlockSize": "dflash_robot.runtime.policy", "BlockSizePolicy": "dflash_robot.runtime.policy",
    "FixedBlockSize": "dflash_robot.runtime.policy",
    "DFlashDraft": "dflash_robot.drafts.model", "DraftMetadata": "dflash_robot.drafts.metadata",
    "load_draft": "dflash_robot.drafts.checkpoint", "save_draft": "dflash_robot.drafts.checkpoint",
    "TargetAdapter": "dflash_robot.targets.base", "make_target_adapter": "dflash_robot.targets.factory",
    "DFlashError": "dflash_robot.errors", "ConfigError": "dflash_robot.errors", "DraftLoadError": "dflash_robot.errors",
    "IncompatibleDraftError": "dflash_robot.errors", "TargetLoadError": "dflash_robot.errors",
    "UnsupportedModelError": "dflash_robot.errors",
}
__all__ = [
    "AdaptiveBlockSize", "BlockSizePolicy", "Completion", "ConfigError", "DFlashDraft",
    "DFlashError", "DFlashRuntime", "DraftLoadError", "DraftMetadata", "FixedBlockSize",
    "GenerationConfig", "GenerationResult", "IncompatibleDraftError", "RuntimeOrchestrator", "SamplingConfig",
    "StepEvent", "TargetAdapter", "TargetLoadError", "UnsupportedModelError", "load_draft",
    "make_target_adapter", "save_draft",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dflash_robot' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *__all__]


if TYPE_CHECKING:
    from dflash_robot.drafts.checkpoint import load_draft, save_draft
    from dflash_robot.drafts.metadata import DraftMetadata
    from dflash_robot.drafts.model import DFlashDraft
    from dflash_robot.errors import (
        ConfigError,
        DFlashError,
        DraftLoadError,
        IncompatibleDraftError,
        TargetLoadError,
        UnsupportedModelError,
    )
    from dflash_robot.runtime.api import Completion, DFlashRuntime
    from dflash_robot.runtime.config import GenerationConfig, SamplingConfig
    from dflash_robot.runtime.orchestrator import GenerationResult, RuntimeOrchestrator, StepEvent
    from dflash_robot.runtime.policy import AdaptiveBlockSize, BlockSizePolicy, FixedBlockSize
    from dflash_robot.targets.base import TargetAdapter
    from dflash_robot.targets.factory import make_target_adapter
