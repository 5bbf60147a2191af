"""Self-distillation data: the target writes the responses it will later be drafted for.

On disk, a data directory holds compact shards, one generation batch each:

    shard-00000.npz     tokens int32 [T] (all samples, concatenated), offsets int64 [n + 1],
                        response_start int32 [n] (relative to the sample), source str
    features/taps-1-14-27/shard-00000.npy
                        bf16 bits as uint16 [T, n_taps * H]: the target's tapped hidden states
                        (z-lab's meaning: hidden_states[id + 1], concatenated in id order)

The shards are small (4 bytes a token) and committed; features are large (2 * n_taps * H bytes
a token) and rebuilt by `ensure_features` where missing, with the runtime's own target engine
(`runtime.api.runtime_target_adapter`: for the embedded default, the lean engine on the GGUF's Q4_1
blocks). Features captured while generating come from the same batched transformers forward that
wrote the tokens (forward hooks, no extra target pass): close to those, not equal to them.

Prompt sources are in `prompts.py`. Every prompt is checked against the installed evaluation
sets (HumanEval, GSM8K, MT-Bench, AIME25, IFBench) and refused if it matches one, and a prompt
already in the directory (token for token) is skipped for a fresh one. Generation resumes after the
last complete shard: shard k is a pure function of (schedule, seed, k, the prompts of the shards
already there, the installed packages that make the docstring pool).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from dflash_robot.errors import ConfigError
from dflash_robot.training import prompts as P

SEED_PREFIXES = [
    "Write a Python function that", "Write a Python program to", "Implement a function in Python",
    "How do I", "Explain", "Solve this math problem:", "Calculate", "A store sells",
    "What is the difference between", "Give me a step-by-step", "Write a short story about",
    "Summarize", "List", "Why does", "Can you help me", "Fix the bug in this code:",
    "Write a function that returns", "If a train travels", "Describe", "Compare",
]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def evaluation_prompts() -> set[str]:
    """Normalised prompts of every installed evaluation set (never trained on)."""
    from dflash_robot.bench.datasets import load_all_eval_prompts  # lazy: optional packages

    return {_norm(p) for p in load_all_eval_prompts()}


def check_not_evaluation(prompts: list[str], eval_set: set[str]) -> list[str]:
    """Drop prompts that equal an evaluation prompt, or contain one (or are contained)."""
    keep = []
    long_eval = [e for e in eval_set if len(e) >= 40]
    for p in prompts:
        n = _norm(p)
        if n in eval_set or any(e in n or (len(n) >= 40 and n in e) for e in long_eval):
            continue
        keep.append(p)
    return keep


# ---------------------------------------------------------------- schedule of sources

def parse_sources(spec: str) -> list[tuple[str, int]]:
    """'docstring:40,math:30,self:10' -> [(source, batches)]; shards cycle through the list."""
    out = []
    for part in spec.split(","):
        name, _, n = part.partition(":")
        if name not in P.SOURCES:
            raise ConfigError(f"unknown prompt source {name!r}: choose from {', '.join(P.SOURCES)}")
        try:
            count = int(n) if n else 1
        except ValueError:
            raise ConfigError(f"prompt source {part!r}: the weight after ':' must be an integer") from None
        if count < 1:
            raise ConfigError(f"prompt source {part!r}: the weight must be >= 1")
        out.append((name, count))
    return out


def source_of_shard(schedule: list[tuple[str, int]], k: int) -> str:
    """Shards interleave sources in proportion to their weights (deterministic)."""
    cycle = [name for name, w in schedule for _ in range(w)]
    order = list(range(len(cycle)))
    random.Random(len(cycle)).shuffle(order)
    return cycle[order[k % len(cycle)]]


# ---------------------------------------------------------------- generation

class FeatureTap:
    """Forward hooks that record the tapped hidden states of every forward call.

    `hidden_states[id + 1]` is the output of decoder layer `id`, except for the last layer,
    whose tapped state comes after the final norm (transformers' convention)."""

    def __init__(self, model: Any, layer_ids: Sequence[int]):
        inner = model.model
        n = len(inner.layers)
        self.parts: list[list[torch.Tensor]] = [[] for _ in layer_ids]
        self.handles = []
        for j, lid in enumerate(layer_ids):
            mod = inner.norm if lid == n - 1 else inner.layers[lid]
            self.handles.append(mod.register_forward_hook(self._hook(j)))

    def _hook(self, j: int):  # type: ignore[no-untyped-def]
        def f(_m, _inp, out):  # type: ignore[no-untyped-def]
            h = out[0] if isinstance(out, tuple) else out
            self.parts[j].append(h.detach().to(torch.bfloat16))
        return f

    def clear(self) -> None:
        """Drop what earlier forwards recorded (a prompt-writing pass, say)."""
        self.parts = [[] for _ in self.parts]

    def take(self) -> torch.Tensor:
        """-> [B, T, n_taps * H] over all recorded calls, then clears."""
        feats = torch.cat([torch.cat(p, dim=1) for p in self.parts], dim=-1)
        self.parts = [[] for _ in self.parts]
        return feats

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def batch_generate(model: Any, tok: Any, texts: list[str], max_new: int, temperature: float,
                   stop: list[int], seed: int, tap: FeatureTap | None = None
                   ) -> tuple[list[list[int]], list[list[int]], torch.Tensor | None, int]:
    """-> (prompt ids per row, response ids per row (cut after a stop token), features [B, T, F]
    or None, left-pad width P). Row i's prompt occupies feature columns P - len(prompt_i) .. P."""
    if tap is not None:
        tap.clear()  # the features returned are this call's forwards' only
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    torch.manual_seed(seed)
    out = model.generate(**enc, max_new_tokens=max_new, do_sample=temperature > 0,
                         temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                         eos_token_id=stop, pad_token_id=tok.pad_token_id)
    width = enc["input_ids"].shape[1]
    prompts = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
    res = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), None)
        res.append(row[:cut + 1] if cut is not None else row)
    feats = tap.take() if tap is not None else None
    return prompts, res, feats, width


@torch.inference_mode()
def greedy_batch(model: Any, tok: Any, texts: list[str], max_new: int, stop: list[int],
                 tap: FeatureTap | None = None
                 ) -> tuple[list[list[int]], list[list[int]], torch.Tensor | None, int]:
    """`batch_generate` at temperature 0, with the rows that have finished taken out of the batch.

    transformers' `generate` runs every row until the last one stops; with answers of 30 to
    `max_new` tokens a third of its row-steps went to rows already done (shards 1040-1050: 0.68-0.75
    of the row-steps were answer tokens). Here a row leaves the batch, and its KV cache rows with it
    (`Cache.batch_select_indices`), once it has written a stop token or `max_new` tokens. Each row
    is still the target's greedy answer to its prompt (tested against uncached greedy decoding of
    each prompt alone), and its tapped features are those of the forwards that wrote it, as in
    `batch_generate`; the row of its last token, never fed back, stays zero. A target whose cache
    has layers that cannot drop rows (linear attention, SSM state) gets `batch_generate`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if not all(hasattr(layer, "batch_select_indices") for layer in cache.layers):
        # linear-attention / SSM state layers cannot drop rows: every row runs to the end
        return batch_generate(model, tok, texts, max_new, 0.0, stop, 0, tap)
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    b, width = ids.shape
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    feats = None
    if tap is not None:
        tap.clear()  # the features returned are this call's forwards' only
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        feats = torch.zeros(b, width + max_new, len(tap.parts) * cfg.hidden_size, dtype=torch.bfloat16)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    alive = torch.arange(b, device=ids.device)
    out = torch.full((b, max_new), -1, dtype=torch.long, device=ids.device)  # -1: after the row left
    stops = torch.tensor(stop, dtype=torch.long, device=ids.device)
    inp, col = ids, 0
    for step in range(max_new):
        logits = model(input_ids=inp, attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True, logits_to_keep=1).logits
        if feats is not None and tap is not None:
            f = tap.take()
            feats[alive.cpu(), col:col + f.shape[1]] = f.cpu()
            col += f.shape[1]
        nxt = logits[:, -1].argmax(-1)
        out[alive, step] = nxt
        done = torch.isin(nxt, stops)
        if step + 1 == max_new or bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            alive, nxt, mask, pos = alive[keep], nxt[keep], mask[keep], pos[keep]
        inp = nxt[:, None]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        pos = pos[:, -1:] + 1
    if feats is not None:
        feats = feats[:, :col]
    res = [row[row >= 0].tolist() for row in out.cpu()]
    return prompts, res, feats, width


def self_written(model: Any, tok: Any, instructions: list[str] | None, n: int, rng: random.Random,
                 seed: int) -> list[str]:
    """The target writes user turns: continuing a user-turn prefix (Magpie), or answering an
    instruction (selfmath). Sampled at temperature 0.9."""
    stop = [tok.eos_token_id]
    if instructions is None:
        prefixes = [rng.choice(SEED_PREFIXES) for _ in range(n)]
        head = tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False).split("X")[0]
        _, outs, _, _ = batch_generate(model, tok, [head + p for p in prefixes], 64, 0.9, stop, seed)
        texts = [(p + tok.decode(o, skip_special_tokens=True)).strip() for p, o in zip(prefixes, outs, strict=True)]
        return [t for t, p in zip(texts, prefixes, strict=True) if len(t) > len(p) + 8]
    chats = chat_texts(tok, instructions)
    _, outs, _, _ = batch_generate(model, tok, chats, 128, 0.9, stop, seed)
    texts = [tok.decode(o, skip_special_tokens=True).strip() for o in outs]
    return [t + P.GSM8K_SUFFIX for t in texts if 40 < len(t) < 700]


def shard_prompts(model: Any, tok: Any, source: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if source in P.STATIC_SOURCES:
        return P.STATIC_SOURCES[source](rng, n)
    if source == "selfmath":
        return self_written(model, tok, P.selfmath_instructions(rng, n), n, rng, seed)
    return self_written(model, tok, None, n, rng, seed)


@dataclass
class Shard:
    tokens: np.ndarray          # int32 [T]
    offsets: np.ndarray         # int64 [n + 1]
    response_start: np.ndarray  # int32 [n]
    source: str

    def __len__(self) -> int:
        return len(self.response_start)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (input_ids [S], loss_mask [S]) of sample i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = torch.from_numpy(self.tokens[a:b].astype(np.int64))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[int(self.response_start[i]):] = True
        return ids, mask

    def save(self, path: Path) -> None:
        tmp = path.with_name("." + path.stem + ".tmp.npz")  # hidden: `shard_paths` never lists it
        np.savez_compressed(tmp, tokens=self.tokens, offsets=self.offsets, response_start=self.response_start,
                            source=np.array(self.source))
        tmp.replace(path)  # a shard appears only when complete

    @classmethod
    def load(cls, path: Path) -> Shard:
        try:
            z = np.load(path)
            return cls(z["tokens"], z["offsets"], z["response_start"], str(z["source"]))
        except Exception as e:  # noqa: BLE001 - numpy/zipfile raise many types
            raise ConfigError(f"{path}: corrupt or truncated data shard ({type(e).__name__}: {e})") from e


def taps_dir(data_dir: Path, layer_ids: Sequence[int]) -> Path:
    return data_dir / "features" / ("taps-" + "-".join(str(i) for i in layer_ids))


def _save_features(path: Path, feats: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npy")
    np.save(tmp, feats.cpu().contiguous().view(torch.uint16).numpy())
    tmp.replace(path)


MANIFEST = "dataset.json"  # the identity of the target whose outputs the shards hold


def target_identity(model: Any, tok: Any) -> dict[str, Any]:
    """What a data directory must agree with: the target's vocabulary size and, with a
    tokenizer, a digest of its vocabulary (token -> id)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ident: dict[str, Any] = {"vocab_size": int(cfg.vocab_size)}
    if tok is not None:
        items = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        ident["tokenizer_sha256"] = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()
    return ident


def check_data_target(data_dir: str | Path, model: Any, tok: Any, write: bool = False) -> None:
    """Refuse a data directory generated by another target or tokenizer (its `dataset.json`);
    `write`: record this target in a directory that has no record yet (`generate_dataset`).
    Directories from before the record (2026-12-01) are checked only for token ids outside this
    target's vocabulary before the record is written."""
    path = Path(data_dir) / MANIFEST
    ident = target_identity(model, tok)
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: unreadable ({e})") from e
        if "vocab_size" in saved and saved["vocab_size"] != ident["vocab_size"]:
            raise ConfigError(f"{data_dir} holds data of another target: its vocabulary has {saved['vocab_size']} "
                              f"tokens, this target's {ident['vocab_size']} ({path}); use the target it was "
                              "generated with, or another directory")
        if "tokenizer_sha256" in saved and "tokenizer_sha256" in ident and \
                saved["tokenizer_sha256"] != ident["tokenizer_sha256"]:
            # a warning, not an error: one model's tokenizer loaded another way (a HF directory against
            # its GGUF, another transformers version) may list its vocabulary differently
            warnings.warn(f"{data_dir} was generated with a tokenizer whose vocabulary differs from this target's "
                          f"({path}); if this is not the same model, the data does not fit it", stacklevel=2)
    elif write:
        # shards from before the record: the one thing they can tell is that their ids fit this vocabulary
        top = max((int(Shard.load(p).tokens.max(initial=0)) for p in shard_paths(data_dir)), default=-1)
        if top >= ident["vocab_size"]:
            raise ConfigError(f"{data_dir} holds shards with token id {top}, outside this target's vocabulary "
                              f"({ident['vocab_size']}): data of another target; use another directory")
        tmp = path.with_name("." + MANIFEST + ".tmp")
        tmp.write_text(json.dumps(ident, indent=1) + "\n")
        tmp.replace(path)


def chat_texts(tok: Any, texts: list[str]) -> list[str]:
    """Each prompt as a one-turn user chat, ready for the assistant's answer."""
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts]


STATIC_OVERSAMPLE = 4  # a template or docstring shard draws 4 batches of prompts, for the repeats it skips


def token_key(ids: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """A hashable key of a token sequence, the same for a list, an array or a tensor of its ids."""
    if isinstance(ids, torch.Tensor):
        ids = ids.cpu().numpy()
    return np.asarray(ids, dtype=np.int32).tobytes()


def stored_prompts(data_dir: str | Path) -> set[bytes]:
    """The prompt token ids of every sample already in a data directory (as `token_key`)."""
    keys: set[bytes] = set()
    for p in shard_paths(data_dir):
        s = Shard.load(p)
        for i in range(len(s)):
            a = int(s.offsets[i])
            keys.add(token_key(s.tokens[a:a + int(s.response_start[i])]))
    return keys


def fresh_prompts(tok: Any, chats: list[str], seen: set[bytes], n: int) -> tuple[list[str], int]:
    """The first `n` chats whose prompt tokens are neither in `seen` nor earlier in the list -> (chats,
    how many were skipped as repeats). A repeated prompt would be answered with the same greedy text
    again: by shards 1500-1749 of data/smollm2-selfdistill, 61% of the docstring samples were."""
    out: list[str] = []
    taken: set[bytes] = set()
    skipped = 0
    for chat in chats:
        if len(out) == n:
            break
        key = token_key(tok(chat, add_special_tokens=False)["input_ids"])
        if key in seen or key in taken:
            skipped += 1
            continue
        taken.add(key)
        out.append(chat)
    return out, skipped


def generate_dataset(model: Any, tok: Any, out_dir: str | Path, sources: str, num_shards: int,
                     max_new_tokens: int = 256, batch_size: int = 64, seed: int = 0,
                     feature_layer_ids: Sequence[int] | None = None) -> Path:
    """Write shards `shard-{k:05d}.npz` of greedy target responses (and, with
    `feature_layer_ids`, their tapped features); resumes after the complete shards."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schedule = parse_sources(sources)
    check_data_target(out, model, tok, write=True)  # shards of one target only
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    eval_set = evaluation_prompts()
    stop = [tok.eos_token_id]
    tap = FeatureTap(model, feature_layer_ids) if feature_layer_ids else None
    fdir = taps_dir(out, feature_layer_ids) if feature_layer_ids else None
    todo = [k for k in range(num_shards) if not (out / f"shard-{k:05d}.npz").exists()]
    seen = stored_prompts(out) if todo else set()
    bar = tqdm(total=num_shards, initial=num_shards - len(todo), desc="self-distillation", unit="shard")
    try:
        for k in todo:
            source = source_of_shard(schedule, k)
            shard_seed = seed * 100_003 + k
            # a static source draws more than a batch, so that prompts already in the data are replaced
            draw = batch_size * (STATIC_OVERSAMPLE if source in P.STATIC_SOURCES else 1)
            texts = check_not_evaluation(shard_prompts(model, tok, source, draw, shard_seed), eval_set)
            chats, repeats = fresh_prompts(tok, chat_texts(tok, texts), seen, batch_size)
            if not chats:
                continue
            prompts, resps, feats, width = greedy_batch(model, tok, chats, max_new_tokens, stop, tap)
            shard = _pack(prompts, resps, source)
            if feats is not None and fdir is not None:
                _save_features(fdir / f"shard-{k:05d}.npy", _unpad_features(feats, prompts, resps, width))
            shard.save(out / f"shard-{k:05d}.npz")
            seen.update(token_key(p) for p in prompts)
            bar.update(1)
            bar.set_postfix(source=source, tokens=int(shard.tokens.size), repeats_skipped=repeats)
    finally:
        if tap is not None:
            tap.remove()
    return out


def _pack(prompts: list[list[int]], resps: list[list[int]], source: str) -> Shard:
    seqs = [p + r for p, r in zip(prompts, resps, strict=True)]
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    tokens = np.array([t for s in seqs for t in s], dtype=np.int32)
    return Shard(tokens, offsets, np.array([len(p) for p in prompts], dtype=np.int32), source)


def _unpad_features(feats: torch.Tensor, prompts: list[list[int]], resps: list[list[int]], width: int
                    ) -> torch.Tensor:
    """feats [B, T, F] (left-padded prompt, then one column per fed-back token) -> [sum S_i, F].
    The last response token is never fed back, so its row is zero (no anchor ever reads it)."""
    rows = []
    for i, (p, r) in enumerate(zip(prompts, resps, strict=True)):
        s = len(p) + len(r)
        f = feats[i, width - len(p): width - len(p) + s]
        if f.shape[0] < s:
            f = torch.cat([f, f.new_zeros(s - f.shape[0], f.shape[1])])
        rows.append(f)
    return torch.cat(rows)


# ---------------------------------------------------------------- reading

def shard_paths(data_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(data_dir).glob("shard-*.npz") if not p.name.endswith(".tmp.npz"))


@dataclass(frozen=True)
class _FeatureFile:
    """Where one shard's `.npy` feature rows lie: the file, the byte offset of row 0, the row's
    width in bf16 values, the row count, and the columns of the requested taps."""
    path: str
    offset: int
    width: int
    rows: int
    cols: tuple[slice, ...]

    @property
    def row_bytes(self) -> int:
        return self.width * 2


def _feature_file(path: Path, cols: Sequence[slice]) -> _FeatureFile:
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as e:
            raise ConfigError(f"{path}: not a feature file ({e})") from None
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in read:
            raise ConfigError(f"{path}: .npy format {version} is not one `np.save` writes for features")
        shape, fortran, dtype = read[version](f)
        if dtype != np.dtype(np.uint16) or fortran or len(shape) != 2:
            raise ConfigError(f"{path}: not a feature file (expected a C-ordered 2-D uint16 array, "
                              f"got {dtype} {shape}{' Fortran-ordered' if fortran else ''})")
        return _FeatureFile(str(path), f.tell(), int(shape[1]), int(shape[0]), tuple(cols))


class FeatureStore:
    """Tapped features of one data directory on disk, for a given set of layer ids: any subset of
    a stored tap set, in the same order. A shard's features are read from the first stored tap
    set (sorted by name) that covers the ids and has that shard.

    Rows are read with `pread`, not through a memory map: a training run visits every shard's
    rows, and mapping them left the process with millions of mapped page-cache pages (~11 GB
    RssFile on the 24 GiB box, ~40,000 minor faults a second) while its steps crept from ~1.27
    to ~1.56 s (stage 14). In one run that switched codes at its step 800, the median step went
    from 1.26 s (mapped) to 1.03 s (`pread`), flat over the next 2,200 steps (docs/TRAINING.md,
    session 17). A read copies the same bytes once and leaves nothing mapped."""

    def __init__(self, data_dir: Path, layer_ids: Sequence[int], hidden: int):
        self.sets: list[tuple[Path, list[slice]]] = []
        self.files: dict[str, _FeatureFile | None] = {}
        for d in sorted((data_dir / "features").glob("taps-*")):
            stored = [int(x) for x in d.name[5:].split("-")]
            if all(i in stored for i in layer_ids):
                cols = [slice(stored.index(i) * hidden, (stored.index(i) + 1) * hidden) for i in layer_ids]
                self.sets.append((d, cols))

    def _entry(self, shard: str) -> _FeatureFile | None:
        if shard not in self.files:
            found = [(d / f"{shard}.npy", cols) for d, cols in self.sets if (d / f"{shard}.npy").exists()]
            self.files[shard] = _feature_file(*found[0]) if found else None
        return self.files[shard]

    def get(self, shard: str, a: int, b: int) -> torch.Tensor | None:
        """Rows a..b of the shard's features, the requested taps concatenated: [b - a, taps * hidden]
        bf16, or None where the shard has no features."""
        e = self._entry(shard)
        if e is None:
            return None
        if not 0 <= a <= b <= e.rows:
            raise ValueError(f"{e.path}: rows {a}..{b} requested, the file holds {e.rows}")
        buf = bytearray((b - a) * e.row_bytes)
        view = memoryview(buf)
        fd = os.open(e.path, os.O_RDONLY)
        try:
            got = 0
            while got < len(view):  # pread may return less than asked (signals, large reads)
                n = os.preadv(fd, [view[got:]], e.offset + a * e.row_bytes + got)
                if n == 0:
                    raise ConfigError(f"{e.path}: file ends before row {b} (truncated?)")
                got += n
        finally:
            os.close(fd)
        rows = torch.from_numpy(np.frombuffer(buf, dtype=np.uint16).reshape(b - a, e.width)).view(torch.bfloat16)
        return torch.cat([rows[:, c] for c in e.cols], dim=-1)

    def prefetch(self, keys: Sequence[tuple[str, int, int]]) -> None:
        """Ask the kernel to start reading these samples' rows now (`posix_fadvise` WILLNEED), so
        that a later `get` finds them in the page cache. The training loop calls it for the next
        steps' batches: where the machine reclaims cold page-cache pages, a large set's features
        are read from disk at each visit, and this lets that I/O overlap the current step
        (docs/TRAINING.md, session 15). A hint only: nothing `get` returns depends on it, and a
        failure to give it is ignored."""
        if not hasattr(os, "posix_fadvise"):
            return
        for shard, a, b in keys:
            e = self._entry(shard)
            if e is None or b <= a:  # (a length of 0 would mean "to the end of the file")
                continue
            try:
                fd = os.open(e.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, e.offset + a * e.row_bytes, (b - a) * e.row_bytes, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass


def load_dataset(data_dir: str | Path, max_len: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """-> [(input_ids [S], loss_mask [S])] from the shards, each cut to `max_len` tokens."""
    return [(ids, m) for ids, m, _ in iter_samples(data_dir, max_len)]


def iter_samples(data_dir: str | Path, max_len: int = 512) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
    """-> [(input_ids, loss_mask, (shard name, start row, end row))]; the key locates its features."""
    paths = shard_paths(data_dir)
    if not paths:
        raise ConfigError(f"no training data in {data_dir} (expected shard-*.npz files)")
    out = []
    for p in paths:
        shard = Shard.load(p)
        for i in range(len(shard)):
            ids, mask = shard.sample(i)
            ids, mask = ids[:max_len], mask[:max_len]
            if mask[1:].any():
                a = int(shard.offsets[i])
                out.append((ids, mask, (p.stem, a, a + ids.shape[0])))
    if not out:
        raise ConfigError(f"{data_dir}: the shards hold no sample with response tokens")
    return out


def data_stats(data_dir: str | Path) -> dict[str, Any]:
    """Counts for docs and logs: samples, tokens, response tokens, per source."""
    per: dict[str, dict[str, int]] = {}
    for p in shard_paths(data_dir):
        s = Shard.load(p)
        d = per.setdefault(s.source, {"samples": 0, "tokens": 0, "response_tokens": 0})
        d["samples"] += len(s)
        d["tokens"] += int(s.tokens.size)
        d["response_tokens"] += int(sum(int(s.offsets[i + 1] - s.offsets[i]) - int(s.response_start[i])
                                        for i in range(len(s))))
    total = {k: sum(v[k] for v in per.values()) for k in ("samples", "tokens", "response_tokens")}
    return {"total": total, "per_source": per}


def convert_jsonl(src: str | Path, dst: str | Path, source: str = "self", shard_size: int = 64) -> int:
    """One-off: the earlier JSON-lines shards (input_ids, response_start) -> npz shards."""
    recs = [json.loads(line) for s in sorted(Path(src).glob("data-*.jsonl")) for line in s.open() if line.strip()]
    Path(dst).mkdir(parents=True, exist_ok=True)
    for k in range(0, len(recs), shard_size):
        part = recs[k:k + shard_size]
        prompts = [r["input_ids"][:r["response_start"]] for r in part]
        shard = _pack(prompts, [r["input_ids"][r["response_start"]:] for r in part], source)
        shard.save(Path(dst) / f"shard-v1-{k // shard_size:05d}.npz")
    return len(recs)
