"""Self-distillation data: the target writes the responses it will later be drafted for.

Prompt sources (see docs/TRAINING.md):
- `self:N`: the target writes N user turns itself (Magpie-style), each seeded with a
  topic prefix from `SEED_PREFIXES` and sampled at temperature 0.9;
- `jsonl:PATH[:FIELD]`: prompts from a JSON-lines file (default field "prompt").
Every prompt is checked against the evaluation sets that are installed (HumanEval,
GSM8K, MT-Bench, AIME25, IFBench) and refused if it matches one.

Responses are greedy continuations by the target, generated in batches. Output is a
directory of JSON-lines shards, one record per sample: `input_ids` (prompt + response)
and `response_start` (the loss mask is input_ids[response_start:]). Generation resumes
after the last complete shard.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..errors import ConfigError

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
    from ..bench_data import load_all_eval_prompts  # lazy: optional packages

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


def jsonl_prompts(spec: str) -> list[str]:
    parts = spec.split(":")
    path = Path(parts[1])
    field = parts[2] if len(parts) > 2 else "prompt"
    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(str(json.loads(line)[field]))
    return out


@torch.inference_mode()
def _batch_generate(model: Any, tok: Any, texts: list[str], max_new: int, temperature: float,
                    stop: list[int], seed: int) -> list[list[int]]:
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(**enc, max_new_tokens=max_new, do_sample=temperature > 0,
                         temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                         eos_token_id=stop, pad_token_id=tok.pad_token_id)
    res = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), None)
        res.append(row[:cut + 1] if cut is not None else row)
    return res


def self_prompts(model: Any, tok: Any, n: int, batch: int, seed: int) -> Iterator[str]:
    """The target writes user turns itself, seeded by topic prefixes."""
    rng = random.Random(seed)
    stop = [tok.eos_token_id]
    done = 0
    while done < n:
        prefixes = [rng.choice(SEED_PREFIXES) for _ in range(batch)]
        heads = [tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False).split("X")[0]
                 + p for p in prefixes]
        outs = _batch_generate(model, tok, heads, 64, 0.9, stop, seed + done)
        for p, o in zip(prefixes, outs, strict=True):
            text = (p + tok.decode(o, skip_special_tokens=True)).strip()
            if len(text) > len(p) + 8:
                yield text
                done += 1


def generate_dataset(model: Any, tok: Any, out_dir: str | Path, prompt_source: str, num_samples: int,
                     max_new_tokens: int = 256, batch_size: int = 16, shard_size: int = 64,
                     seed: int = 0) -> Path:
    """Write shards `data-{k:05d}.jsonl` of greedy target responses; resumes after complete shards."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.padding_side = "left"
    done_shards = sorted(out.glob("data-*.jsonl"))
    have = sum(1 for s in done_shards for _ in s.open())
    eval_set = evaluation_prompts()
    if prompt_source.startswith("self"):
        n = int(prompt_source.split(":")[1]) if ":" in prompt_source else num_samples
        prompts: Iterator[str] = self_prompts(model, tok, n, batch_size, seed + have)
    elif prompt_source.startswith("jsonl:"):
        prompts = iter(jsonl_prompts(prompt_source)[have:])
    else:
        raise ConfigError(f"unknown prompt source {prompt_source!r}: use self:N or jsonl:PATH[:FIELD]")
    stop = [tok.eos_token_id]
    bar = tqdm(total=num_samples, initial=have, desc="self-distillation", unit="sample")
    shard_idx, buf = len(done_shards), []
    pending: list[str] = []
    while have < num_samples:
        for p in prompts:
            pending.append(p)
            if len(pending) >= batch_size:
                break
        pending = check_not_evaluation(pending, eval_set)
        if not pending:
            break
        chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=False) for p in pending]
        outs = _batch_generate(model, tok, chats, max_new_tokens, 0.0, stop, seed)
        for chat, resp in zip(chats, outs, strict=True):
            ids = tok(chat, add_special_tokens=False)["input_ids"]
            buf.append({"input_ids": ids + resp, "response_start": len(ids)})
        have += len(pending)
        bar.update(len(pending))
        pending = []
        while len(buf) >= shard_size or (buf and have >= num_samples):
            path = out / f"data-{shard_idx:05d}.jsonl"
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in buf[:shard_size]))
            tmp.replace(path)  # a shard appears only when complete
            buf, shard_idx = buf[shard_size:], shard_idx + 1
    return out


def load_dataset(data_dir: str | Path, max_len: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """-> [(input_ids [S], loss_mask [S])] from the shards."""
    shards = sorted(Path(data_dir).glob("data-*.jsonl"))
    if not shards:
        raise ConfigError(f"no training data in {data_dir} (expected data-*.jsonl shards)")
    out = []
    for s in shards:
        for line in s.open():
            r = json.loads(line)
            ids = torch.tensor(r["input_ids"][:max_len])
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[r["response_start"]:] = True
            if mask[1:].any():
                out.append((ids, mask))
    if not out:
        raise ConfigError(f"{data_dir}: the shards hold no sample with response tokens")
    return out
