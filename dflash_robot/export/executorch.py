"""`dflash-robot export executorch`: a target and its draft as two ExecuTorch programs.

Writes, into one directory:
  target.pte     (tokens [q], input_pos [1]) -> (logits [q, V], features [q, n*H])
  draft.pte      (tokens [q], hidden [q, n*H], hidden_len [1], input_pos [1]) -> logits [q-1, V']
  manifest.json  block size, maximum context, taps, draft metadata and vocabulary, EOS ids
  tokenizer files (when a tokenizer is given), so `--engine executorch --target DIR` needs nothing else

Lowering: `torch.export` -> `to_edge_transform_and_lower` with the XNNPACK partitioner; what
XNNPACK does not take (the KV-cache index_copy_, masks, gathers) stays on ExecuTorch's
portable kernels. `modules.py` explains the static shapes and position-based rollback.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.errors import ConfigError
from dflash_robot.export.manifest import FORMAT, MANIFEST, require_executorch


def _lower(module: torch.nn.Module, example: tuple[torch.Tensor, ...], backend: str) -> bytes:
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from torch.export import export

    with torch.no_grad():
        ep = export(module, example, strict=False)
    partitioners = []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioners.append(XnnpackPartitioner())
    elif backend != "portable":
        raise ConfigError(f"backend must be 'xnnpack' or 'portable', got {backend!r}")
    edge = to_edge_transform_and_lower(ep, partitioner=partitioners,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    from executorch.exir import ExecutorchBackendConfig

    # the KV-cache writes stay in place (no functional copy of the buffer)
    return edge.to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True)).buffer


def export_executorch(target_model: Any, draft: DFlashDraft, out_dir: str | Path, block_size: int | None = None,
                      max_context: int = 1024, tokenizer: Any = None, backend: str = "xnnpack",
                      stop_token_ids: tuple[int, ...] = (),
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Export `target_model` (Llama/Qwen2/Qwen3, computed in fp32) and `draft` -> the manifest."""
    require_executorch()
    from dflash_robot.export.modules import ExportableDraft, ExportableTarget

    say = progress or (lambda s: None)
    meta = draft.metadata
    q = int(block_size or meta.block_size)
    meta.check_block_size(q)
    if q < 2:
        raise ConfigError("the exported block size must be >= 2 (block size 1 runs the same program)")
    if not isinstance(max_context, int) or max_context < 2 * q:
        raise ConfigError(f"max_context must be an integer >= 2 * block size ({2 * q}), got {max_context!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    taps = tuple(meta.target_layer_ids)
    target = ExportableTarget(target_model, taps, max_context).eval()
    head = target_model.get_output_embeddings()
    w, b = draft.head_weight(head)
    edraft = ExportableDraft(draft, target_model.get_input_embeddings().weight, w, b, q, max_context).eval()
    sizes = {}
    for name, module, example in [
        ("target", target, (torch.zeros(q, dtype=torch.long), torch.zeros(1, dtype=torch.long))),
        ("draft", edraft, (torch.zeros(q, dtype=torch.long), torch.zeros(q, draft.fc.in_features),
                           torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))),
    ]:
        t0 = time.perf_counter()
        say(f"exporting {name}.pte (block size {q}, max context {max_context}, {backend}) ...")
        data = _lower(module, example, backend)
        path = out / f"{name}.pte"
        path.write_bytes(data)
        sizes[name] = path.stat().st_size
        say(f"  {name}.pte: {sizes[name] / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    cfg = target_model.config.get_text_config() if hasattr(target_model.config, "get_text_config") \
        else target_model.config
    vocab_ids = draft.vocab_ids
    manifest = {
        "format": FORMAT, "backend": backend, "block_size": q, "max_context": max_context,
        "target": {"model_type": cfg.model_type, "num_layers": int(cfg.num_hidden_layers),
                   "hidden_size": int(cfg.hidden_size), "vocab_size": int(head.weight.shape[0])},
        "draft": {**dataclasses.asdict(meta),
                  "vocab_ids": None if vocab_ids is None else vocab_ids.tolist(),
                  "fc_in_features": int(draft.fc.in_features)},
        "stop_token_ids": sorted(set(int(t) for t in stop_token_ids)),
        "pte_bytes": sizes,
        "torch": torch.__version__,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return manifest
