"""`DFlashRuntime`: a target, its tokenizer and a validated draft, with a text-in/text-out API.

    rt = DFlashRuntime.load()                              # the default target + shipped draft
    out = rt.generate("Explain KV caches.", max_new_tokens=64)
    out.text, out.mean_acceptance_length, out.tokens_per_second
    for delta in rt.stream([{"role": "user", "content": "Hi!"}]):
        print(delta, end="")

`generate` and `stream` are thin layers over `RuntimeOrchestrator.stream` (token ids in,
`StepEvent`s out), which stays available as `rt.orchestrator` for token-level use.
Defaults match the CLI: 128 new tokens, greedy, stop at the tokenizer's and model's EOS,
the chat template applied to text and to messages.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft
from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.drafts.validation import check_compatible
from dflash_robot.errors import ConfigError, DFlashError, UnsupportedModelError
from dflash_robot.runtime.config import DEFAULT_LOOKUP_NGRAM, GenerationConfig, SamplingConfig
from dflash_robot.runtime.orchestrator import GenerationResult, RuntimeOrchestrator, StepEvent
from dflash_robot.runtime.policy import AdaptiveBlockSize, BlockSizePolicy
from dflash_robot.runtime.proposer import DFlashProposer
from dflash_robot.runtime.text import TextStream
from dflash_robot.targets.base import ROLLBACKS, TargetAdapter
from dflash_robot.targets.loading import (
    _split_target_path,
    check_device,
    converted_dir,
    default_target_path,
    load_target_model,
    parse_dtype,
)
from dflash_robot.targets.quant import GROUP as INT4_GROUP

DEFAULT_DRAFT = SHIPPED_DRAFT
# The lean engine's weights when nothing is asked: "auto" = the GGUF's own Q4 blocks ("gguf") for a
# GGUF target the lean engine runs, else fp32. Measured fastest and lossless (docs/BENCHMARKS.md).
DEFAULT_PRECISION = "auto"
DEFAULT_COST_CACHE = Path.home() / ".cache" / "dflash-robot" / "costs.json"
# the n-gram lookup branch (runtime/lookup.py) that `config` adds by default to greedy decoding where
# the target verifies trees: up to 7 tokens, from the last match of the last 4 (else 3) committed
# tokens; measured in docs/BENCHMARKS.md, session 47
DEFAULT_LOOKUP_TOKENS = 7
Prompt = str | Sequence[dict[str, str]] | Sequence[int]


@dataclass
class Completion(GenerationResult):
    """The result of `DFlashRuntime.generate`: a `GenerationResult` plus its text.
    finish_reason "stop" also covers a stop string."""

    text: str = ""

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class DFlashRuntime:
    """A target, its tokenizer and (optionally) a validated draft, ready to generate."""

    target: TargetAdapter
    tokenizer: Any
    draft: DFlashDraft | None
    orchestrator: RuntimeOrchestrator
    info: dict[str, Any] = field(default_factory=dict)  # what it was loaded from (cost-curve key)
    _costs: dict[int, float] | None = field(default=None, repr=False)
    # `config`'s lookup branch when a call names none: None = DEFAULT_LOOKUP_TOKENS where it can run
    lookup_tokens: int | None = None
    lookup_ngram: tuple[int, int] = DEFAULT_LOOKUP_NGRAM  # ... and the (min, max) n-gram sizes it matches

    @classmethod
    def from_models(cls, target_model: Any, draft: DFlashDraft | None, tokenizer: Any = None,
                    prefill_chunk_size: int = 512, rollback: str | None = None,
                    fast_linears: bool = False, engine: str = "hf", precision: str = "fp32",
                    gguf_file: str | None = None) -> DFlashRuntime:
        """`rollback` picks the strategy for stateful (hybrid) targets: "replay" or
        "capture" (None = the measured default); attention-only targets always crop.
        `engine` runs the target through transformers ("hf") or the lean engine ("lean",
        `lean.py`; "auto" = lean where it supports the architecture, else hf); the lean
        engine keeps its own packed copies and leaves `target_model` untouched.
        `fast_linears` packs the fp32 CPU linears of both models for oneDNN, in place
        (`fastpath.py`); off by default here because it changes the caller's modules."""
        from dflash_robot.targets.factory import make_target_adapter  # imports transformers

        target = make_target_adapter(target_model, rollback, engine, precision, gguf_file)
        rt = cls._assemble(target, target_model, draft, tokenizer, prefill_chunk_size, fast_linears, precision)
        rt.info.update(engine=engine, rollback=rollback, fast_linears=fast_linears, precision=precision)
        return rt

    @classmethod
    def _assemble(cls, target: TargetAdapter, target_model: Any, draft: DFlashDraft | None, tokenizer: Any,
                  prefill_chunk_size: int, fast_linears: bool, precision: str) -> DFlashRuntime:
        proposer = None
        if draft is not None:
            check_compatible(draft, target)
        if fast_linears and target_model is not None:
            from dflash_robot.targets.fastpath import pack_linears
            from dflash_robot.targets.hf import HFTargetAdapter

            if isinstance(target, HFTargetAdapter):  # includes the stateful adapter; lean packs its own
                pack_linears(target_model)
        # the draft is not packed: its lean forward (drafts/lean.py) keeps its own packed copies
        if draft is not None:
            proposer = DFlashProposer(draft, target.input_embedding_weight(), target.output_head(),
                                      precision=draft_precision(precision, draft))
        rt = cls(target, tokenizer, draft, RuntimeOrchestrator(target, proposer, prefill_chunk_size))
        rt.info["kernels"] = "fused" if getattr(target, "fused_kernels", False) else "torch"
        return rt

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
             gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
             device: str = "cpu", no_draft: bool = False, rollback: str | None = None,
             fast_linears: bool = True, engine: str = "auto", precision: str = DEFAULT_PRECISION,
             draft_device: str | None = None, draft_dtype: str | torch.dtype | None = None) -> DFlashRuntime:
        """Load target (default: SmolLM2-135M-Instruct GGUF) and draft (default: the shipped one).

        The draft is read first (it is small), so a bad draft path fails before the target
        loads; it is cast to the target's dtype, and a draft that does not fit is refused.
        `fast_linears` (default on) packs fp32 CPU linears for oneDNN; see `targets/fastpath.py`.
        `engine` (default "auto"): the lean engine for Llama/Qwen2/Qwen3 targets, else transformers.
        `precision` of the lean engine's weights (`targets/quant.py`): fp32, bf16, int8, int4, or
        gguf (the GGUF target's own quantized blocks); a precision the target cannot run
        (another engine, no GGUF) is refused. `draft_device` / `draft_dtype` place the draft
        apart from the target (default: with it); its features are then mirrored to it.
        """
        from dflash_robot.targets.quant import check_precision

        if engine == "executorch":
            if draft is not None:
                raise ConfigError("an ExecuTorch export holds its own draft (draft.pte); drop the draft argument")
            if target is None:
                raise ConfigError("engine 'executorch' needs target= an export directory "
                                  "(`dflash-robot export executorch`)")
            return cls.load_executorch(target)
        if precision != "auto":
            check_precision(precision)
        torch_dtype = parse_dtype(dtype)
        check_device(device)  # before any loading, on every path
        if rollback is not None and rollback not in ROLLBACKS:
            raise ConfigError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
        if draft_device is not None:
            check_device(draft_device)
        d_dtype = parse_dtype(draft_dtype) if draft_dtype is not None else torch_dtype
        d = None if no_draft else load_draft(draft or DEFAULT_DRAFT, dtype=d_dtype, device=draft_device or device)
        target_path = Path(target) if target else default_target_path()
        gguf_path = gguf_file_path(target_path, gguf_file)
        snap = _snapshot(target_path, gguf_file, engine, torch_dtype, device) if gguf_path else None
        if snap is not None:  # the lean engine straight from the converted snapshot: no transformers
            from dflash_robot.targets.lean import LeanTargetAdapter

            snap_model, snap_tok = snap
            if precision == "auto":
                precision = _gguf_precision(gguf_path)
            lean = LeanTargetAdapter.from_snapshot(
                snap_model, precision, gguf_path,
                load_model=lambda: load_target_model(target_path, gguf_file, torch_dtype, device)[0])
            rt = cls._assemble(lean, None, d, snap_tok, 512, fast_linears, precision)
            rt.info.update(engine=engine, rollback=rollback, fast_linears=fast_linears, precision=precision,
                           snapshot=str(snap_model.directory))
        else:
            model, tok = load_target_model(target_path, gguf_file, torch_dtype, device)
            if precision == "auto":
                precision = _auto_precision(model, engine, gguf_path, torch_dtype)
            rt = cls.from_models(model, d, tok, rollback=rollback, fast_linears=fast_linears, engine=engine,
                                 precision=precision, gguf_file=gguf_path)
        rt.info.update(target=str(target_path.resolve()), gguf_file=gguf_file, dtype=str(torch_dtype),
                       device=device, draft=str(Path(draft or DEFAULT_DRAFT).resolve()) if d is not None else None,
                       fast_linears=fast_linears)
        return rt

    @classmethod
    def load_executorch(cls, export_dir: str | Path) -> DFlashRuntime:
        """Run an ExecuTorch export (target.pte + draft.pte, `dflash_robot/export/`) through
        ExecuTorch's Python runtime, with the same orchestrator as the eager engines."""
        from dflash_robot.export.runtime import load_executorch_runtime

        target, draft, tok = load_executorch_runtime(export_dir)
        orch = RuntimeOrchestrator(target, draft)  # type: ignore[arg-type]
        info = {"engine": "executorch", "target": str(Path(export_dir).resolve()), "precision": "fp32",
                "block_size": target.block, "max_context": target.max_context,
                "stop_token_ids": list(target.manifest.get("stop_token_ids", []))}
        return cls(target, tok, draft, orch, info=info)  # type: ignore[arg-type]

    # --- text in, text out -------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Text (a user turn), chat messages, or token ids -> prompt token ids. The chat
        template is applied to text when `chat` and the tokenizer has one, always to messages."""
        if not isinstance(prompt, str) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if self.tokenizer is None:
            raise ConfigError("this target has no tokenizer; pass token ids (CLI: --input-ids)")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if isinstance(prompt, str):
            if not chat or not has_template:
                return list(self.tokenizer(prompt)["input_ids"])
            messages: Sequence[dict[str, str]] = [{"role": "user", "content": prompt}]
        else:
            messages = prompt  # type: ignore[assignment]
            if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise ConfigError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
            if not has_template:
                raise ConfigError("this tokenizer has no chat template; pass text with chat=False")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def stop_token_ids(self, extra: Sequence[int] = ()) -> tuple[int, ...]:
        """`extra` plus every EOS the tokenizer, the model config and its generation config name."""
        ids = set(extra) | set(self.info.get("stop_token_ids", ()))
        known = getattr(self.target, "eos_token_ids", None)  # a snapshot-built engine read them already
        if known is not None:
            ids |= set(known)
        model = None if known is not None else getattr(self.target, "model", None)
        for src in (getattr(self.tokenizer, "eos_token_id", None),
                    getattr(getattr(model, "config", None), "eos_token_id", None),
                    getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return tuple(sorted(ids))

    def config(self, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               block_size: int | None = None, seed: int | None = 0, stop_token_ids: Sequence[int] = (),
               verify_mode: str = "batched", tree_budget: int = 0,
               tree_topk: int | None = None, lookup_tokens: int | None = None,
               lookup_ngram: tuple[int, int] | None = None) -> GenerationConfig:
        """A validated `GenerationConfig` with this model's EOS ids as stop tokens.
        `tree_budget` > 0 verifies a draft tree of that many nodes per step (DDTree) instead
        of a chain; `tree_topk` caps the candidates per depth (default: the budget).
        `lookup_tokens` adds an n-gram lookup branch of up to that many tokens beside the draft's
        (`runtime/lookup.py`; 0: none; None: `self.lookup_tokens`, else DEFAULT_LOOKUP_TOKENS for
        greedy decoding where this target verifies trees in a batched forward, else none: sampled, a
        branch raised acceptance but cost more than it gained on the CPU box); `lookup_ngram` is
        the (min, max) n-gram size it matches (None: `self.lookup_ngram`)."""
        ngram: tuple[int, ...] = self.lookup_ngram if lookup_ngram is None else tuple(lookup_ngram)
        if len(ngram) != 2:
            raise ConfigError(f"lookup_ngram must be a (min, max) pair of n-gram sizes, got {ngram!r}")
        if lookup_tokens is None:
            lookup_tokens = self.lookup_tokens
        if lookup_tokens is None:
            can = self.draft is not None and verify_mode == "batched" and temperature == 0 and \
                getattr(self.target, "tree_unsupported", "none") is None
            lookup_tokens = DEFAULT_LOOKUP_TOKENS if can else 0
        return GenerationConfig(max_new_tokens=max_new_tokens, block_size=block_size,
                                sampling=SamplingConfig(temperature, top_p, top_k),
                                stop_token_ids=self.stop_token_ids(stop_token_ids), seed=seed,
                                verify_mode=verify_mode, tree_budget=tree_budget, tree_topk=tree_topk,
                                lookup_tokens=lookup_tokens, lookup_min_ngram=ngram[0],
                                lookup_max_ngram=ngram[1])

    def events(self, prompt: Prompt, cfg: GenerationConfig, policy: BlockSizePolicy | None = None,
               chat: bool = True) -> Generator[StepEvent, None, None]:
        """Token-level steps for a text/messages/ids prompt (the orchestrator's generator)."""
        return self.orchestrator.stream(self.encode(prompt, chat), cfg, policy)

    def stream(self, prompt: Prompt, *, stop: Sequence[str] = (), adaptive: bool = False, chat: bool = True,
               **settings: Any) -> Iterator[str]:
        """Yield text deltas. `settings` are those of `config` (max_new_tokens, temperature,
        top_p, top_k, block_size, seed, stop_token_ids, verify_mode, tree_budget, tree_topk,
        lookup_tokens, lookup_ngram)."""
        cfg = self.config(**settings)
        policy = self.adaptive_policy() if adaptive else None
        text = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None
        if text is None:
            raise ConfigError("stream() returns text and needs a tokenizer; use events() for token ids")
        gen = self.events(prompt, cfg, policy, chat)
        try:
            for ev in gen:
                delta = text.push(ev.tokens)
                if delta:
                    yield delta
                if text.stopped:
                    return
            tail = text.finish()
            if tail:
                yield tail
        finally:
            gen.close()  # frees the engine at once, also when the caller stops early

    def generate(self, prompt: Prompt, *, stop: Sequence[str] = (), adaptive: bool = False, chat: bool = True,
                 **settings: Any) -> Completion:
        """Generate to the end and return the text with its statistics (see `stream`)."""
        cfg = self.config(**settings)
        ids = self.encode(prompt, chat)
        policy = self.adaptive_policy() if adaptive else None
        text = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None

        if text is None:
            return Completion(**vars(self.orchestrator.generate(ids, cfg, policy)))

        def stopped(new_tokens: list[int]) -> bool:
            text.push(new_tokens)
            return text.stopped

        r = self.orchestrator.generate(ids, cfg, policy, stopped)
        text.finish()
        return Completion(**vars(r), text=text.text)

    # --- adaptive block size -----------------------------------------------------------

    def cost_key(self) -> str:
        """What an iteration-cost curve depends on: package, engine, precision, machine, models."""
        from dflash_robot import __version__

        i = self.info
        return "|".join([f"dflash-robot {__version__}", f"torch {torch.__version__}", type(self.target).__name__,
                         str(self.target.dtype), str(i.get("precision")), str(self.target.device),
                         f"threads {torch.get_num_threads()}",
                         _cpu_identity(), str(i.get("target")),
                         str(i.get("gguf_file")), str(i.get("draft")), f"packed {i.get('fast_linears')}",
                         f"draft forward {_draft_forward(self)}", f"kernels {_kernels(self.target)}"])

    def adaptive_policy(self, cost_cache: str | Path | None = DEFAULT_COST_CACHE,
                        progress: Any = None, tree_budgets: Sequence[int] = ()) -> AdaptiveBlockSize:
        """An `AdaptiveBlockSize` over this runtime's measured cost curve (cached, expiring).
        With `tree_budgets`, it also weighs tree verification at those node budgets (budget n at
        block size min(training block size, n + 1)), from their own measured iteration costs."""
        from dflash_robot.runtime.policy import load_or_measure_costs, measure_tree_costs

        if self.draft is None:
            raise ConfigError("adaptive block size needs a draft")
        top = self.draft.metadata.training_block_size
        if self._costs is None:
            qs = list(range(1, top + 1))
            self._costs = load_or_measure_costs(self, qs, cost_cache, self.cost_key(), progress=progress)
        tree_costs = None
        if tree_budgets:
            if any(not isinstance(n, int) or n < 1 for n in tree_budgets):
                raise ConfigError(f"tree budgets must be integers >= 1, got {list(tree_budgets)}")
            reason = getattr(self.target, "tree_unsupported", None)
            if reason is not None:
                raise UnsupportedModelError(f"adaptive tree budgets: {reason}")
            tree_costs = load_or_measure_costs(
                self, sorted(set(tree_budgets)), cost_cache, self.cost_key() + f"|tree max q={top}", progress=progress,
                measure=lambda rt, ns, **kw: measure_tree_costs(rt, ns, top, **kw))
        return AdaptiveBlockSize(self._costs, top, tree_costs=tree_costs)


def _draft_forward(rt: DFlashRuntime) -> str:
    """How the draft runs (part of the cost-curve key: session 6 made it 2-3x cheaper)."""
    lean = getattr(rt.orchestrator.drafter, "_lean", None)
    return "module" if lean is None else f"lean {lean.precision}"


def draft_precision(target_precision: str, draft: DFlashDraft | None = None) -> str:
    """The draft's weights for a target at `target_precision` (`drafts/lean.py`): quantized targets
    get an int4 draft (groups of 32; its head's rows stay bf16), or int8 (per channel) when one of
    `draft`'s products has an input width that is not a multiple of 32. Measured 2026-12-02 on the
    2-core Xeon box (docs/BENCHMARKS.md, session 15): in place between the target's verifies
    (`scripts/profile_iteration.py --draft-precision`), a block-4 proposal took 3.00 ms in int8 and
    2.59 ms in int4 for the shipped draft, 4.24 and 3.41 ms for a 5-layer one; side by side on 10
    HumanEval + 10 GSM8K prompts (`scripts/compare_drafts.py`) τ stayed within 0.025 either way and
    DFlash ran 3-7% faster at block 4. Session 6 (2026-11-30, an AMD box) had 1.1 ms against 1.0 ms
    with the same τ to two decimals, and kept int8 as the smaller change."""
    if target_precision in ("fp32", "bf16"):
        return target_precision
    if draft is not None and any(m.in_features % INT4_GROUP for m in draft.modules() if isinstance(m, nn.Linear)):
        return "int8"
    return "int4"


def _snapshot(target_path: Path, gguf_file: str | None, engine: str, dtype: torch.dtype, device: str
              ) -> tuple[Any, Any] | None:
    """(model, tokenizer) of the converted snapshot of a GGUF target that the lean engine can start
    from without transformers (`targets/snapshot.py`), when there is one; None sends the load the
    usual way."""
    if engine not in ("auto", "lean") or dtype != torch.float32 or torch.device(device).type != "cpu":
        return None
    try:
        directory, gguf = _split_target_path(target_path, gguf_file)
    except DFlashError:
        return None  # the usual path reports it
    if not gguf or not (directory / gguf).is_file():
        return None
    from dflash_robot.targets.snapshot import open_snapshot

    return open_snapshot(converted_dir(directory / gguf, dtype))


def gguf_file_path(target_path: Path, gguf_file: str | None) -> str | None:
    """The GGUF file a target path names (the path itself, or `gguf_file` inside a directory), else None."""
    if target_path.suffix == ".gguf":
        return str(target_path)
    return str(target_path / gguf_file) if gguf_file else None


def runtime_target_adapter(model: Any, gguf_path: str | None) -> TargetAdapter:
    """The target adapter `DFlashRuntime.load` runs `model` with by default (engine "auto",
    precision "auto"): the engine and weight precision whose tapped features a draft is fed at
    run time. Training computes its stored features with it (`training.run.ensure_features`)."""
    from dflash_robot.targets.factory import make_target_adapter

    precision = _auto_precision(model, "auto", gguf_path, model.dtype)
    return make_target_adapter(model, engine="auto", precision=precision, gguf_file=gguf_path)


def _auto_precision(model: Any, engine: str, gguf_path: str | None, dtype: torch.dtype) -> str:
    """"gguf" where the lean engine runs an fp32-loaded GGUF target whose layers are Q4_0/Q4_1, else "fp32"."""
    from dflash_robot.targets.capabilities import is_stateful
    from dflash_robot.targets.lean import supports

    if gguf_path is None or engine == "hf" or dtype != torch.float32 or is_stateful(model) or not supports(model):
        return "fp32"
    return _gguf_precision(gguf_path)


def _gguf_precision(gguf_path: str | None) -> str:
    """"gguf" for a GGUF whose layers are Q4_0/Q4_1 (the int4 kernel runs them as stored), else "fp32"."""
    if gguf_path is None:
        return "fp32"
    from dflash_robot.targets.gguf_weights import gguf_tensor_types

    types = {t for name, t in gguf_tensor_types(gguf_path).items() if name.startswith("blk.") and
             name.endswith(("attn_q.weight", "ffn_down.weight"))}
    return "gguf" if types and types <= {"Q4_0", "Q4_1"} else "fp32"


def _cpu_identity() -> str:
    from dflash_robot.targets.kernels import cpu_identity

    return cpu_identity()


def _kernels(target: Any) -> str:
    """The fused kernels' build (source and flags) when the target engine runs them, else "off"."""
    if not getattr(target, "fused_kernels", False):
        return "off"
    from dflash_robot.targets import kernels

    return kernels.build_name()


__all__ = ["DEFAULT_DRAFT", "Completion", "DFlashError", "DFlashRuntime"]
