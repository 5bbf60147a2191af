"""Inference fast path: `nn.Linear` weights pre-packed for oneDNN on CPU.

On the project's AVX2 CPU, `F.linear` in fp32 goes to an MKL sgemm that is slow for the
few-row products decoding is made of: a 15-row product with SmolLM2's 49152 x 576 lm_head
took 113 ms, the same product through a oneDNN-packed weight 33 ms (docs/ARCHITECTURE.md has
the measured effect on whole forwards). `pack_linears` swaps every fp32 CPU `nn.Linear` of a
module for a `PackedLinear` that keeps the original `weight` Parameter (so ties, state dicts and
`.weight` lookups still work) and adds a packed copy used for the product.

Inference only: the packed copy is made once, so it goes stale if the weight is trained
afterwards, and a forward that needs gradients falls back to `F.linear`. The runtime packs
only models it loaded itself (`DFlashRuntime.load`); models handed to `from_models` are
packed only on request, since packing changes the caller's module in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def supported() -> bool:
    """oneDNN linear ops are present and usable on this CPU (fp32)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


class PackedLinear(nn.Module):
    """An inference-only `nn.Linear` whose product uses a oneDNN pre-packed weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def linear_fn(weight: torch.Tensor, bias: torch.Tensor | None = None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ weight.T + bias` with `weight` packed for oneDNN when it is fp32 on a CPU that
    supports it (the packed copy is the only one the returned function keeps), else `F.linear`."""
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return lambda x: F.linear(x, weight, bias)


def pack_linears(module: nn.Module) -> int:
    """Replace, in place, every fp32 CPU `nn.Linear` under `module` (itself included as a
    child only) with a `PackedLinear`. Returns how many were packed; 0 where unsupported."""
    if not supported():
        return 0
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n
