"""Choosing a target adapter by capability (what the model's cache holds) and engine."""

from __future__ import annotations

from transformers import PreTrainedModel

from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.targets.base import TargetAdapter
from dflash_robot.targets.capabilities import is_stateful
from dflash_robot.targets.hf import HFTargetAdapter

ENGINES = ("auto", "hf", "lean")


def make_target_adapter(model: PreTrainedModel, rollback: str | None = None, engine: str = "hf",
                        precision: str = "fp32", gguf_file: str | None = None) -> TargetAdapter:
    """The adapter for `model`, chosen by what its cache holds: attention-only targets get
    `HFTargetAdapter` (or, with `engine="lean"`/`"auto"`, the lean engine of `lean.py` where it
    supports the architecture), targets with linear-attention/SSM states `StatefulTargetAdapter`
    with the `rollback` strategy ("replay" or "capture"; None = the measured default).
    Attention-only targets roll back by cropping, whatever `rollback` says.
    `engine="lean"` refuses a model the lean engine cannot run; `"auto"` falls back to HF.
    `precision` other than "fp32" (`targets/quant.py`) runs only on the lean engine; "gguf"
    reads the layers' quantized blocks from `gguf_file`."""
    from dflash_robot.targets.quant import check_precision
    from dflash_robot.targets.stateful import ROLLBACKS, StatefulTargetAdapter

    check_precision(precision)

    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
    if is_stateful(model):
        if engine == "lean" or precision != "fp32":
            raise UnsupportedModelError(f"the lean engine does not run stateful (hybrid) targets like "
                                        f"{type(model).__name__}; use engine='hf' or 'auto'")
        return StatefulTargetAdapter(model, rollback)
    if rollback is not None and rollback not in ROLLBACKS:
        raise ConfigError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
    if engine != "hf":
        from dflash_robot.targets.lean import LeanTargetAdapter, supports

        if engine == "lean" or supports(model):
            return LeanTargetAdapter(model, precision=precision, gguf_file=gguf_file)  # type: ignore[return-value]
    if precision != "fp32":
        raise UnsupportedModelError(f"precision {precision!r} runs on the lean engine, which does not run "
                                    f"{type(model).__name__}; use precision 'fp32'")
    return HFTargetAdapter(model)


