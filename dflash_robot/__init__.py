"""dflash-robot: a model-agnostic runtime for DFlash block-diffusion speculative decoding."""

from .checkpoint import load_draft, save_draft
from .config import DraftMetadata, GenerationConfig, SamplingConfig, build_target_layer_ids
from .draft import DFlashDraft
from .errors import (
                     ConfigError,
                     DFlashError,
                     DraftLoadError,
                     IncompatibleDraftError,
                     TargetLoadError,
                     UnsupportedModelError,
)
from .orchestrator import GenerationResult, RuntimeOrchestrator, StepEvent
from .policy import AdaptiveBlockSize, BlockSizePolicy, FixedBlockSize
from .proposer import DFlashProposer, DraftAdapter
from .stateful import StatefulTargetAdapter
from .target import CacheSnapshot, HFTargetAdapter, TargetAdapter, TargetOutput, make_target_adapter

__version__ = "0.1.0"

__all__ = [
    "AdaptiveBlockSize", "BlockSizePolicy", "FixedBlockSize", "StatefulTargetAdapter", "make_target_adapter",
    "CacheSnapshot", "ConfigError", "DFlashDraft", "DFlashError", "DFlashProposer", "DraftAdapter",
    "DraftLoadError", "DraftMetadata", "GenerationConfig", "GenerationResult", "HFTargetAdapter",
    "IncompatibleDraftError", "RuntimeOrchestrator", "SamplingConfig", "StepEvent", "TargetAdapter",
    "TargetLoadError", "TargetOutput", "UnsupportedModelError", "build_target_layer_ids",
    "load_draft", "save_draft",
]
