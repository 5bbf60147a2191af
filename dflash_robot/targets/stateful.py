"""Stateful (hybrid linear-attention / SSM) targets: rollback of states that cannot be cropped.

A linear-attention or SSM layer keeps a *conv state* (the last k-1 inputs of its causal
convolution) and a *recurrent state* (a fixed-size matrix that every token updates in
place). Verifying a block writes all q block tokens into both; when only `n < q` of them
are accepted, the states must be put back to "after token n". Attention layers of the same
model are simply cropped. Two strategies (`rollback=`):

- ``"replay"``: before verifying, clone every conv and recurrent state (`snapshot`). On a
  partial acceptance, copy the clones back, crop the attention layers to the snapshot and
  re-run the `n` accepted tokens through the target. Works for any layer kind transformers
  caches in a `LinearAttentionLayer`; costs one extra target forward of n tokens.
- ``"capture"`` (Luce's "fast rollback"): while verifying, step the recurrent kernel token
  by token and keep the state after every block position; the conv inputs are kept by
  transformers' past recording. On a partial acceptance, copy in the state after position n
  and crop the conv history: no re-run. Needs a recurrent kernel this module knows how to
  step (`_STEPPERS`); today that is the gated delta rule (Qwen3.5, Qwen3.5-MoE, Qwen3-Next
  and other families whose layers call it), and conv-only layers (LFM2), which need no
  stepping at all. Memory: q recurrent states per linear layer, freed at the rollback.

A target is recognised as stateful by capability: its `_is_stateful` flag, or a cache that
holds `LinearAttentionCacheLayerMixin` layers. Anything this adapter does not know how to
roll back is refused when the adapter is built, never run silently wrong.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.targets.base import ROLLBACKS, CacheSnapshot, TargetOutput
from dflash_robot.targets.capabilities import new_cache
from dflash_robot.targets.hf import HFTargetAdapter

__all__ = ["DEFAULT_ROLLBACK", "ROLLBACKS", "StatefulTargetAdapter"]
#: measured default (docs/ARCHITECTURE.md, scripts/profile_hybrid.py)
DEFAULT_ROLLBACK = "capture"

_ATTENTION_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
_LINEAR_LAYERS = (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)

# The capture currently in progress: a list that stepped kernels append their per-position
# states to, in layer order. None outside a capturing verify, so the wrappers are inert.
_CAPTURE: contextvars.ContextVar[list[list[torch.Tensor]] | None] = contextvars.ContextVar(
    "dflash_robot_capture", default=None)


# --- per-step stepping of recurrent kernels -------------------------------------------------

@dataclass(frozen=True)
class _Stepper:
    """How to capture per-position states for one recurrent kernel family.

    `chunk_name` is the module-level kernel a layer calls for a multi-token forward,
    `step_name` the one it calls for a single token; both take and return
    `(..., initial_state=..., output_final_state=...) -> (out, final_state)`, with the
    sequence on dim 1 of their first five arguments.
    """

    chunk_name: str
    step_name: str


_STEPPERS = (_Stepper("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),)


def _stepped(original_chunk: Callable, step: Callable) -> Callable:
    """A multi-token kernel that, inside a capture, steps `step` token by token instead and
    records the state after every position (outside a capture it calls `original_chunk`)."""
    def chunk(*args: Any, **kwargs: Any) -> Any:
        states = _CAPTURE.get()
        if states is None:
            return original_chunk(*args, **kwargs)
        names = ("query", "key", "value", "g", "beta")
        seq = dict(zip(names, args[:5], strict=False))
        for n in names[len(seq):]:
            seq[n] = kwargs.pop(n)
        kwargs.pop("chunk_size", None)
        kwargs.pop("output_final_state", None)
        state = kwargs.pop("initial_state", None)
        outs, per_pos = [], []
        for t in range(seq["query"].shape[1]):
            o, state = step(**{k: v[:, t:t + 1] for k, v in seq.items()}, initial_state=state,
                            output_final_state=True, **kwargs)
            outs.append(o)
            per_pos.append(state)
        states.append(per_pos)
        return torch.cat(outs, dim=1), state

    chunk.__wrapped__ = original_chunk  # type: ignore[attr-defined]
    chunk._dflash_robot_stepped = True  # type: ignore[attr-defined]
    return chunk


def _single(original_step: Callable) -> Callable:
    """A single-token kernel that, inside a capture, also records the state it returns."""
    def step(*args: Any, **kwargs: Any) -> Any:
        out, state = original_step(*args, **kwargs)
        states = _CAPTURE.get()
        if states is not None:
            states.append([state])
        return out, state

    step.__wrapped__ = original_step  # type: ignore[attr-defined]
    step._dflash_robot_stepped = True  # type: ignore[attr-defined]
    return step


def _install_stepper(module_name: str) -> bool:
    """Wrap the module's recurrent kernels so that a capturing verify records per-position
    states. Idempotent; outside a capture the wrappers call straight through. False if the
    module uses no kernel we know how to step."""
    mod = sys.modules.get(module_name)
    if mod is None:
        return False
    d = mod.__dict__
    for s in _STEPPERS:
        if s.chunk_name in d and s.step_name in d:
            chunk, step = d[s.chunk_name], d[s.step_name]
            if not getattr(chunk, "_dflash_robot_stepped", False):
                raw_step = getattr(step, "__wrapped__", step) if getattr(step, "_dflash_robot_stepped", False) \
                    else step
                d[s.chunk_name] = _stepped(chunk, raw_step)
            if not getattr(step, "_dflash_robot_stepped", False):
                d[s.step_name] = _single(step)
            return True
    return False


# --- the adapter ---------------------------------------------------------------------------

@dataclass
class _LinearStates:
    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]


class StatefulTargetAdapter(HFTargetAdapter):
    """A transformers causal LM whose cache mixes attention layers and linear-attention/SSM
    layers (or only the latter). See the module docstring for the two rollback strategies."""

    tree_unsupported: str | None = ("a hybrid linear-attention/SSM target carries one recurrent state per "
                        "layer, and a tree's nodes would each need their own along their parent chain "
                        "(not implemented); use chain mode (tree budget 0)")

    def __init__(self, model: PreTrainedModel, rollback: str | None = None):
        """`rollback` None takes DEFAULT_ROLLBACK where this model supports it, else replay."""
        requested, rollback = rollback, rollback or DEFAULT_ROLLBACK
        if rollback not in ROLLBACKS:
            raise ConfigError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
        super().__init__(model)
        probe = new_cache(model)
        self._linear_idx: list[int] = []
        self._attn_idx: list[int] = []
        for i, layer in enumerate(probe.layers):
            if type(layer) in _LINEAR_LAYERS:
                self._linear_idx.append(i)
                if isinstance(layer, LinearAttentionAndFullAttentionLayer):
                    self._attn_idx.append(i)
            elif type(layer) in _ATTENTION_LAYERS:
                self._attn_idx.append(i)
            else:
                raise UnsupportedModelError(
                    f"{type(model).__name__}: cache layer {i} is a {type(layer).__name__}, which dflash-robot "
                    "does not know how to roll back")
        if not self._linear_idx:
            raise UnsupportedModelError(
                f"{type(model).__name__} is marked stateful but its cache has no linear-attention layers; "
                "its states cannot be snapshotted")
        self._steps_recurrent = False
        if rollback == "capture":
            try:
                self._check_capture(model)
            except UnsupportedModelError:
                if requested:
                    raise
                rollback = "replay"
        self.rollback_strategy = rollback
        self._block: torch.Tensor | None = None
        self._captured: list[list[torch.Tensor]] | None = None

    def _check_capture(self, model: PreTrainedModel) -> None:
        """Every linear layer's recurrent kernel must be one we can step (conv-only layers
        need none). Checked on the mixer modules' own Python modules."""
        mixer_modules = {type(m).__module__ for m in model.modules()
                         if getattr(m, "layer_idx", None) in self._linear_idx and type(m).__module__}
        steppable = {name for name in mixer_modules if _install_stepper(name)}
        self._steps_recurrent = bool(steppable)
        # A layer with a recurrent state but no steppable kernel cannot be captured.
        mod_names = mixer_modules - steppable
        needs_state = [name for name in mod_names if _module_updates_recurrent(name)]
        if needs_state:
            raise UnsupportedModelError(
                f"{type(model).__name__}: per-step state capture does not know the recurrent kernel of "
                f"{sorted(needs_state)}; use rollback='replay'")

    def _layer(self, i: int) -> Any:
        assert self._cache is not None
        return self._cache.layers[i]

    # -- cache lifecycle

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        layers: list[Any] = list(self._cache.layers)
        for i, layer in enumerate(layers):
            linear = i in self._linear_idx
            if linear and self.rollback_strategy == "capture":
                _record_conv_inputs(layer)
            elif not linear and isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        self._len = 0

    def _trim(self) -> None:
        """Drop recorded history no later forward needs (sliding windows, conv inputs)."""
        assert self._cache is not None
        layers: list[Any] = list(self._cache.layers)
        for layer in layers:
            if getattr(layer, "record_past", False) and _initialised(layer):
                layer.crop(0)

    # -- verify and rollback

    def snapshot(self) -> CacheSnapshot:
        if self.rollback_strategy == "capture":
            return CacheSnapshot(seq_len=self._len)
        assert self._cache is not None
        conv: list[torch.Tensor | None] = []
        rec: list[torch.Tensor | None] = []
        for i in self._linear_idx:
            layer = self._layer(i)
            for s in range(layer.number_of_states):
                c, r = layer.conv_states[s], layer.recurrent_states[s]
                conv.append(c.clone() if layer.is_conv_states_initialized[s] and c is not None else None)
                rec.append(r.clone() if layer.is_recurrent_states_initialized[s] and r is not None else None)
        return CacheSnapshot(seq_len=self._len, states=_LinearStates(conv, rec))

    @torch.inference_mode()
    def verify(self, block_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
               sequential: bool = False) -> TargetOutput:
        self._block = block_ids
        if self.rollback_strategy != "capture":
            return super().verify(block_ids, tap_layer_ids, sequential)
        captured: list[list[torch.Tensor]] = []
        token = _CAPTURE.set(captured)
        try:
            out = super().verify(block_ids, tap_layer_ids, sequential)
        finally:
            _CAPTURE.reset(token)
        if self._steps_recurrent:
            n_rec = sum(1 for i in self._linear_idx for s in range(self._layer(i).number_of_states)
                        if self._layer(i).is_recurrent_states_initialized[s])
            # sequential verify: one entry per (token, layer); regroup to one list per layer
            if sequential and n_rec:
                captured = [sum((captured[t * n_rec + j] for t in range(len(captured) // n_rec)), [])
                            for j in range(n_rec)]
            if len(captured) != n_rec:
                raise UnsupportedModelError(
                    f"per-step capture saw {len(captured)} recurrent kernel calls for {n_rec} recurrent "
                    "states; this model calls its kernels in a way the capture does not know. "
                    "Use rollback='replay'")
        self._captured = captured
        return out

    @torch.inference_mode()
    def rollback(self, snapshot: CacheSnapshot, num_kept: int) -> None:
        assert self._cache is not None
        verified = self._len - snapshot.seq_len
        if not 0 <= num_kept <= verified:
            raise ValueError(f"rollback keeps {num_kept} of {verified} verified tokens")
        removed = verified - num_kept
        if self.rollback_strategy == "capture":
            self._rollback_capture(removed, num_kept)
        elif removed:
            self._rollback_replay(snapshot, num_kept)
        self._captured = None

    def _rollback_capture(self, removed: int, num_kept: int) -> None:
        assert self._cache is not None
        if removed:
            if num_kept == 0:
                raise ValueError("per-step capture cannot roll back past the block's first token")
            j = 0
            for i in self._linear_idx:
                layer = self._layer(i)
                for s in range(layer.number_of_states):
                    if layer.is_recurrent_states_initialized[s]:
                        layer.recurrent_states[s].copy_(self._captured[j][num_kept - 1])  # type: ignore[index]
                        j += 1
            for i, layer in enumerate(self._cache.layers):
                _crop_layer(layer, removed, linear=i in self._linear_idx)
            self._len -= removed
        self._trim()

    def _rollback_replay(self, snapshot: CacheSnapshot, num_kept: int) -> None:
        assert self._cache is not None and isinstance(snapshot.states, _LinearStates)
        k = 0
        for i in self._linear_idx:
            layer = self._layer(i)
            for s in range(layer.number_of_states):
                c, r = snapshot.states.conv[k], snapshot.states.recurrent[k]
                if c is not None:
                    layer.conv_states[s].copy_(c)
                if r is not None:
                    layer.recurrent_states[s].copy_(r)
                if c is None and r is None:  # the block was this layer's first input
                    layer.has_previous_state[s] = False
                k += 1
        removed = self._len - snapshot.seq_len
        for i in self._attn_idx:
            _crop_layer(self._layer(i), removed, linear=False)
        self._len = snapshot.seq_len
        if num_kept:
            assert self._block is not None
            self._forward(self._block[:num_kept], None, logits_to_keep=1)
            self._trim()

    def crop(self, length: int) -> None:
        if length != self._len:
            raise UnsupportedModelError("a stateful target can only be rolled back through snapshot/rollback")


def _crop_layer(layer: Any, removed: int, linear: bool) -> None:
    """Remove the last `removed` tokens from a layer: its attention KV if it has one, and
    (`linear`) its recorded conv inputs. A combined layer (Falcon-H1) gets both."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        if layer.is_initialized:
            layer.crop(-removed)  # its own crop also restores the window from the recorded past
        return
    if isinstance(layer, DynamicLayer) and layer.is_initialized:
        DynamicLayer.crop(layer, -removed)
    if linear and isinstance(layer, LinearAttentionCacheLayerMixin) and _initialised(layer):
        _crop_conv_inputs(layer, removed)


def _record_conv_inputs(layer: Any) -> None:
    """Have a linear layer keep its conv inputs until the next crop. transformers >= 5.25 can
    also keep per-position recurrent states itself (`recurrent_states_to_keep`); the capture
    steps its own kernels, so it asks for none, which also keeps the layer's forward on the
    code path 5.24 runs."""
    if "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters:
        layer.activate_past_recording(recurrent_states_to_keep=0)
    else:
        layer.activate_past_recording()


def _crop_conv_inputs(layer: Any, removed: int) -> None:
    """Drop the last `removed` recorded conv inputs of a linear layer and keep the window
    its next forward reads. Only the conv side: the capture restores the recurrent state
    itself, which transformers' own crop would overwrite from a history it never filled."""
    if removed <= 0:
        raise ValueError(f"a conv crop removes at least one token, got {removed}")
    for s in range(layer.number_of_states):
        if layer.is_conv_states_initialized[s]:
            k = layer.conv_kernel_size[s]
            layer.conv_states[s] = layer.conv_states[s][..., -removed - k:-removed]
    length = getattr(layer, "cumulative_length_linear", None)  # transformers >= 5.25 counts tokens
    if isinstance(length, torch.Tensor):
        length.sub_(removed)


def _initialised(layer: Any) -> bool:
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return any(layer.is_conv_states_initialized.values())
    return bool(getattr(layer, "is_initialized", False))


def _module_updates_recurrent(module_name: str) -> bool:
    """Whether any function or method defined in `module_name` writes a recurrent state.
    transformers 5.25 moved some mixers' bodies into module-level functions, which its
    kernel hub wraps in a callable module object whose `forward` closes over the function,
    so closures are followed too."""
    mod = sys.modules.get(module_name)
    seen: set[int] = set()

    def writes(f: Any) -> bool:
        f = inspect.unwrap(f)
        if id(f) in seen:
            return False
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if code is None:
            return False
        if "update_recurrent_state" in code.co_names:
            return True
        return any(writes(c) for c in _closure_values(f) if callable(c) and not isinstance(c, type))

    for obj in getattr(mod, "__dict__", {}).values():
        if getattr(obj, "__module__", None) != module_name or not callable(obj):
            continue
        if isinstance(obj, type):
            members = list(vars(obj).values())
        elif hasattr(inspect.unwrap(obj), "__code__"):
            members = [obj]
        else:  # a callable object, such as the kernel hub's wrapper: read its class
            members = list(vars(type(obj)).values())
        if any(writes(m) for m in members):
            return True
    return False


def _closure_values(f: Any) -> list[Any]:
    values = []
    for cell in getattr(f, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet bound
            continue
    return values
