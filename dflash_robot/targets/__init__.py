"""Target adapters: the one interface (`TargetAdapter`) over every target the runtime drives.

- `base`: the protocol, `TargetOutput`, `CacheSnapshot`, the shared chunked prefill/verify;
- `hf`: any attention-only transformers causal LM (full or sliding-window cache);
- `lean`: a lean forward for Llama / Qwen2 / Qwen3 (fused, packed, preallocated cache);
- `stateful`: hybrid linear-attention / SSM targets, rollback by replay or state capture;
- `capabilities`, `factory`: what a model can do, and the adapter chosen from that;
- `loading`: a target model and tokenizer from a Hugging Face directory or a GGUF file.
"""

from dflash_robot.targets.base import CacheSnapshot, ChunkedForwardAdapter, TargetAdapter, TargetOutput
from dflash_robot.targets.factory import ENGINES, make_target_adapter
from dflash_robot.targets.hf import HFTargetAdapter

__all__ = ["ENGINES", "CacheSnapshot", "ChunkedForwardAdapter", "HFTargetAdapter", "TargetAdapter", "TargetOutput",
           "make_target_adapter"]
