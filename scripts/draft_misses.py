"""Where a draft misses on the bench's prompts: greedy chain decoding at one block size, with the
draft alone (no lookup branch); for each verify step that ended on a miss, the target's token there
and what the draft proposed. docs/TRAINING.md, "Session 47".

Usage: python scripts/draft_misses.py [--dataset humaneval] [--limit 30] [--block-size 16] [--threads 2]
                                      [--show 3]
                                      [--draft DIR]

Prints each output with `|` between verify steps (the first `--show` outputs), then JSON counts:
misses, and among them the target tokens that occur in the prompt, that continue a bigram already in
the context (prompt and output so far), and that the draft could not reach (outside its vocabulary
and the prompt's columns); the conditional acceptance by block position; the draft tokens kept per
step, by the step's copy run (how many of the target's next tokens continue an earlier occurrence of
the last token verbatim: 0, 1-3, 4-7, 8+; [steps, mean kept]); the most missed tokens.
A step cut by a stop token or the token budget is not a miss.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from dflash_robot.bench.datasets import formatted_prompts
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig, SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--draft", default=None, help="a draft directory (default: the shipped draft)")
    args = ap.parse_args()
    texts = formatted_prompts(args.dataset, args.limit)
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load(draft=args.draft)
    prop = rt.orchestrator.drafter
    proposals: list[list[int]] = []
    propose = prop.propose

    def recording(features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        logits = propose(features, block_ids)
        ids, top = prop.vocab_ids, logits.argmax(-1)
        proposals.append((top if ids is None else ids[top]).tolist())
        return logits

    prop.propose = recording  # type: ignore[method-assign]
    stops = rt.stop_token_ids()
    counts: collections.Counter[str] = collections.Counter()
    accepted: collections.Counter[int] = collections.Counter()
    tried: collections.Counter[int] = collections.Counter()
    missed: collections.Counter[str] = collections.Counter()
    by_copy: dict[str, list[int]] = collections.defaultdict(list)  # copy-run bucket -> draft tokens kept
    for k, text in enumerate(texts):
        ids = rt.encode(text)
        proposals.clear()
        r = rt.orchestrator.generate(ids, GenerationConfig(128, args.block_size, SamplingConfig(0.0),
                                                           stop_token_ids=stops))
        out, i, steps = r.token_ids, 1, [[r.token_ids[0]]]
        for step, a in enumerate(r.acceptance_lengths):
            drafted, n_ok = proposals[step], a - 1
            run = copy_run(ids + out, len(ids) + i - 1, len(drafted))
            by_copy[_bucket(run)].append(n_ok)
            for pos in range(min(n_ok + 1, len(drafted))):
                tried[pos] += 1
                accepted[pos] += pos < n_ok
            end = i + n_ok
            if n_ok < len(drafted) and end < len(out) and out[end] != drafted[n_ok]:
                want, ctx = out[end], ids + out[:end]
                counts["misses"] += 1
                counts["in_prompt"] += want in ids
                counts["continues_a_bigram"] += any(ctx[j] == ctx[-1] and ctx[j + 1] == want
                                                    for j in range(len(ctx) - 1))
                reach = prop.vocab_ids
                counts["out_of_reach"] += reach is not None and not bool((reach == want).any())
                missed[rt.tokenizer.decode([want])] += 1
            steps.append(out[i:i + a])
            i += a
        counts["steps"] += len(r.acceptance_lengths)
        counts["tokens"] += len(out) - 1
        if k < args.show:
            print("|".join(rt.tokenizer.decode(s).replace("\n", "\\n") for s in steps))
    print(json.dumps({"dataset": args.dataset, "prompts": len(texts), "block_size": args.block_size, **counts,
                      "tau": round((counts["tokens"]) / counts["steps"], 3) if counts["steps"] else None,
                      "conditional_acceptance": [round(accepted[p] / tried[p], 3) for p in sorted(tried)[:8]],
                      "draft_tokens_kept_by_copy_run": {b: [len(v), round(sum(v) / len(v), 3)]
                                                        for b, v in sorted(by_copy.items())},
                      "most_missed": missed.most_common(20)}))


def copy_run(seq: list[int], c: int, limit: int) -> int:
    """How many of the target's next tokens after position c (seq[c + 1:]) continue, verbatim, some
    earlier occurrence j < c of the token at c: the longest such run over every j, at most `limit`.
    The run an ideal copier could draft from the context here."""
    best = 0
    for j in range(c):
        if seq[j] != seq[c]:
            continue
        t = 0
        while t < limit and c + 1 + t < len(seq) and seq[j + 1 + t] == seq[c + 1 + t]:
            t += 1
        best = max(best, t)
    return best


def _bucket(run: int) -> str:
    return "0" if run == 0 else "1-3" if run <= 3 else "4-7" if run <= 7 else "8+"


if __name__ == "__main__":
    main()
