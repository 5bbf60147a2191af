"""Running an ExecuTorch export (`executorch.py`) through ExecuTorch's Python runtime (pybindings),
behind the same `TargetAdapter` / `DraftAdapter` interfaces the eager engines implement, so the
orchestrator, acceptance and sampling code are the ones every engine uses.

Static shapes: every call runs the exported block size q. A shorter verify block (block size
1, or the last step's cap) and the prompt's last chunk are padded with token 0; the padded
rows write cache slots past the committed length, which the next call overwrites before any
row can read them (each row attends only to slots at or before its own position). Rollback is
therefore just the next `input_pos`: nothing is copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_robot.drafts.metadata import DraftMetadata
from dflash_robot.errors import ConfigError
from dflash_robot.export.manifest import read_manifest, require_executorch
from dflash_robot.targets.base import PositionCache, TargetOutput


def _load_method(path: Path, name: str = "forward") -> Any:
    from executorch.runtime import Runtime

    try:
        return Runtime.get().load_program(str(path)).load_method(name)
    except Exception as e:  # the pybindings raise RuntimeError / ValueError with ET error codes
        raise ConfigError(f"cannot load the ExecuTorch program {path}: {e}") from e


class ExecuTorchTarget(PositionCache):
    """`TargetAdapter` over `target.pte`."""

    tree_unsupported = ("the exported target program takes a causal block at consecutive positions; "
                        "tree verification needs a per-node mask the export does not have")

    def __init__(self, export_dir: str | Path, manifest: dict[str, Any] | None = None):
        require_executorch()
        self.dir = Path(export_dir)
        self.manifest = manifest or read_manifest(self.dir)
        m = self.manifest
        self.block = int(m["block_size"])
        self.max_context = int(m["max_context"])
        t = m["target"]
        self.num_layers, self.hidden_size = int(t["num_layers"]), int(t["hidden_size"])
        self.vocab_size = int(t["vocab_size"])
        self.dtype, self.device = torch.float32, torch.device("cpu")
        # a call writes slots input_pos .. input_pos + q - 1, padding included
        self.max_length = self.max_context - self.block + 1
        self.taps = tuple(int(i) for i in m["draft"]["target_layer_ids"])
        self._method = _load_method(self.dir / "target.pte")
        self._len = 0

    def reset(self) -> None:
        self._len = 0

    def _run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = ids.shape[0]
        if self._len + self.block > self.max_context:
            raise ConfigError(f"the sequence reached the export's maximum context ({self.max_context} positions); "
                              "re-export with a larger --max-context")
        tokens = ids.to(torch.long)
        if n < self.block:
            tokens = torch.cat([tokens, tokens.new_zeros(self.block - n)])
        logits, feats = self._method.execute([tokens, torch.tensor([self._len], dtype=torch.long)])
        self._len += n
        return logits[:n].clone(), feats[:n].clone()  # the outputs live in the program's planned memory

    def _check_taps(self, tap_layer_ids: tuple[int, ...] | None) -> None:
        if tap_layer_ids is not None and tuple(tap_layer_ids) != self.taps:
            raise ConfigError(f"this export taps layers {self.taps}, asked for {tuple(tap_layer_ids)}")

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                chunk_size: int = 512) -> TargetOutput:
        self._check_taps(tap_layer_ids)
        self.reset()
        feats, logits = [], None
        for start in range(0, input_ids.shape[0], self.block):
            logits, f = self._run(input_ids[start:start + self.block])
            feats.append(f)
        assert logits is not None, "prefill needs at least one token"
        return TargetOutput(logits[-1:], torch.cat(feats) if tap_layer_ids else None)

    @torch.inference_mode()
    def verify(self, block_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
               sequential: bool = False) -> TargetOutput:
        self._check_taps(tap_layer_ids)
        if block_ids.shape[0] > self.block:
            raise ConfigError(f"block of {block_ids.shape[0]} tokens; this export verifies at most {self.block}")
        if sequential:
            outs = [self._run(block_ids[i:i + 1]) for i in range(block_ids.shape[0])]
            logits, feats = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        else:
            logits, feats = self._run(block_ids)
        return TargetOutput(logits, feats if tap_layer_ids else None)

    def verify_tree(self, *args: Any, **kwargs: Any) -> TargetOutput:
        from dflash_robot.errors import UnsupportedModelError

        raise UnsupportedModelError(f"tree verification: {self.tree_unsupported}")

    def input_embedding_weight(self) -> torch.Tensor:
        raise ConfigError("the ExecuTorch target keeps its embedding inside target.pte; "
                          "use the exported draft.pte with it")

    def output_head(self) -> nn.Module:
        raise ConfigError("the ExecuTorch target keeps its head inside target.pte")


class ExecuTorchDraft:
    """`DraftAdapter` over `draft.pte` (its context K/V kept by position inside the program)."""

    def __init__(self, export_dir: str | Path, manifest: dict[str, Any] | None = None):
        require_executorch()
        self.dir = Path(export_dir)
        m = manifest or read_manifest(self.dir)
        d = dict(m["draft"])
        ids = d.pop("vocab_ids")
        self.fc_in = int(d.pop("fc_in_features"))
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        self.block = int(m["block_size"])
        # the program runs exactly q positions: the block sizes it can draft are 1..q
        d["training_block_size"] = min(int(d["training_block_size"]), self.block)
        d["block_size"] = min(int(d["block_size"]), self.block)
        d.setdefault("hint_ngram", None)  # a manifest from before hinted drafts
        d["prompt_vocab"] = False  # the program's head is fixed: a request's prompt columns are not added
        self.metadata = DraftMetadata(**d)
        self.vocab_ids = None if ids is None else torch.tensor(ids, dtype=torch.long)
        self._method = _load_method(self.dir / "draft.pte")
        self._pos = 0

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        """`prompt` is not used: the exported program's head is fixed (see `__init__`)."""
        self._pos = 0

    @property
    def context_length(self) -> int:
        return self._pos

    def _run(self, block: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        if n < self.block:
            hidden = torch.cat([hidden, hidden.new_zeros(self.block - n, hidden.shape[1])])
        out = self._method.execute([block, hidden.float().contiguous(), torch.tensor([n], dtype=torch.long),
                                    torch.tensor([self._pos], dtype=torch.long)])[0]
        self._pos += n
        return out

    @torch.inference_mode()
    def propose(self, features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """features [c, n*H] committed since the last call, block [q'] (q' <= q) -> logits [q'-1, V']."""
        q = block_ids.shape[0]
        if q > self.block:
            raise ConfigError(f"block of {q} tokens; this export drafts at most {self.block}")
        block = block_ids.to(torch.long)
        if q < self.block:  # pad with mask tokens; only the first q - 1 rows are read
            block = torch.cat([block, block.new_full((self.block - q,), self.metadata.mask_token_id)])
        # a context longer than one call takes (the prompt): feed it chunk by chunk first
        while features.shape[0] > self.block:
            self._run(block, features[:self.block])
            features = features[self.block:]
        return self._run(block, features)[:q - 1].clone()


def load_executorch_runtime(export_dir: str | Path) -> tuple[ExecuTorchTarget, ExecuTorchDraft, Any]:
    """-> (target adapter, draft adapter, tokenizer or None) for an export directory."""
    require_executorch()
    manifest = read_manifest(export_dir)
    target = ExecuTorchTarget(export_dir, manifest)
    draft = ExecuTorchDraft(export_dir, manifest)
    tokenizer = None
    if (Path(export_dir) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    return target, draft, tokenizer
