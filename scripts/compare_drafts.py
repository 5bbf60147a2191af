"""Mean acceptance length and decode speed of several drafts on the bench's prompts, side by side.

Usage: python scripts/compare_drafts.py --drafts shipped,runs/stage6/draft [--datasets humaneval,gsm8k]
                                        [--limit 10] [--block-sizes 1,4,16] [--threads 2] [--repeats 1]
                                        [--temperature 1.0 --seeds 3] [--lookup 0,7 --lookup-ngram 3:4]

Greedy, 128 new tokens, z-lab's prompt formats with the chat template (`bench.datasets`; any set
`bench` knows: humaneval, gsm8k, aime25, mtbench (its first turn), ifbench), the default
target and engine (or sampled at `--temperature`, each prompt once per seed in `--seeds`); τ pooled
over the verify steps of all prompts, as `bench` reports it, and the decode tok/s. "shipped" is the
draft in the package. A draft may name the precision of its lean forward after an @ (`shipped@int4`;
default: what `DFlashRuntime.load` gives it). docs/TRAINING.md quotes it when a draft is considered for
shipping.

One target serves every draft (each draft gets its own proposer and orchestrator over it, at the
precision `DFlashRuntime.load` would give it). For each prompt every (draft, block size) run is
made, in an order that rotates from one prompt to the next, so drift on a shared box reaches every
run alike. Block size 1 is the target alone (no draft): it is run once per prompt, as
"autoregressive", in the same rotation. `--repeats N` runs every prompt N times per run (tok/s
over all of them; greedy τ does not change). For a draft with a draft vocabulary (`t2d`), "in_vocab"
is the share of the tokens its runs produced that the vocabulary holds: a token outside it is one the
draft can never propose, so 1 - in_vocab bounds what the vocabulary costs. A `prompt_vocab` draft also
proposes each request's prompt tokens: "in_reach" is the share in the vocabulary or that prompt.

`--lookup 0,7` runs every (draft, block size) once per n-gram lookup setting (0: the draft alone;
N: with the lookup branch of `runtime/lookup.py`, up to N tokens, n-grams of `--lookup-ngram MIN:MAX`);
a run with lookup is named `draft+lookupN`; its paired delta is against the first draft without it
(when 0 is among the settings).

How sure a τ is: "tau_se" is its bootstrap standard error over prompts (`bench.runner.tau_interval`),
and every draft after the first gets "delta_vs_<first>": its τ minus the first draft's on the same
prompts, paired, with the standard error and 95% interval of that difference. A difference whose
interval holds 0 is not a measured difference; raise `--limit` for a sharper one.
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_robot.bench.datasets import formatted_prompts
from dflash_robot.bench.runner import tau_interval
from dflash_robot.cli.common import ngram_range
from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.drafts.validation import check_compatible
from dflash_robot.errors import ConfigError
from dflash_robot.runtime.api import DFlashRuntime, draft_precision
from dflash_robot.runtime.config import DEFAULT_LOOKUP_NGRAM, GenerationConfig, SamplingConfig
from dflash_robot.runtime.orchestrator import RuntimeOrchestrator
from dflash_robot.runtime.proposer import DFlashProposer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="shipped")
    ap.add_argument("--datasets", default="humaneval,gsm8k")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--block-sizes", default="4,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every prompt per draft (timing only)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the floor's setting)")
    ap.add_argument("--seeds", type=int, default=1, help="sampled runs per prompt (seeds 0..N-1)")
    ap.add_argument("--lookup", default="0", help="lookup branch lengths to run (0: none), e.g. 0,7")
    ap.add_argument("--lookup-ngram", default=":".join(map(str, DEFAULT_LOOKUP_NGRAM)),
                    help="MIN:MAX n-gram sizes the lookup matches (default: the runtime's)")
    args = ap.parse_args()
    for flag in ("limit", "repeats", "seeds", "max_new_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    sampling = SamplingConfig(temperature=args.temperature)
    seeds = list(range(args.seeds)) if args.temperature > 0 else [None]
    names = args.drafts.split(",")
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    try:
        lookups = list(dict.fromkeys(int(x) for x in args.lookup.split(",")))  # each setting once
        lo_n, hi_n = ngram_range(args.lookup_ngram)
        for lk in lookups:  # every setting is checked before anything loads
            GenerationConfig(lookup_tokens=lk, lookup_min_ngram=lo_n, lookup_max_ngram=hi_n)
    except (ValueError, ConfigError, argparse.ArgumentTypeError) as e:
        ap.error(f"--lookup / --lookup-ngram: {e}")
    paths = {n: n.split("@")[0] for n in names}
    drafts = {n: None if p == "shipped" else load_draft(p, dtype=torch.float32) for n, p in paths.items()}  # fail early
    try:  # an unknown or uninstalled set fails here, before the target loads
        texts = {ds: formatted_prompts(ds, args.limit) for ds in args.datasets.split(",")}
    except ConfigError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load()
    orchestrators = {"autoregressive": rt.orchestrator}
    vocab: dict[str, torch.Tensor | None] = {"autoregressive": None}
    prompt_vocab = {n: bool(getattr(getattr(rt.draft if d is None else d, "metadata", None), "prompt_vocab", False))
                    for n, d in drafts.items()}
    for n, d in drafts.items():
        precision = n.split("@")[1] if "@" in n else None
        vocab[n] = getattr(rt.draft if d is None else d, "t2d", None)  # [V] bool, or None: the full head
        if d is None and precision is None:
            orchestrators[n] = rt.orchestrator
            continue
        d = rt.draft if d is None else d
        assert d is not None
        check_compatible(d, rt.target)
        prop = DFlashProposer(d, rt.target.input_embedding_weight(), rt.target.output_head(),
                              precision=precision or draft_precision(rt.info["precision"], d))
        orchestrators[n] = RuntimeOrchestrator(rt.target, prop, rt.orchestrator.prefill_chunk_size)
    runs = ([("autoregressive", 1)] if 1 in block_sizes else []) + [
        (n if lk == 0 else f"{n}+lookup{lk}", q) for q in block_sizes if q > 1 for lk in lookups for n in names]
    lookup_of = {n if lk == 0 else f"{n}+lookup{lk}": lk for n in names for lk in lookups}
    lookup_of["autoregressive"] = 0
    base_of = {n if lk == 0 else f"{n}+lookup{lk}": n for n in names for lk in lookups}
    base_of["autoregressive"] = "autoregressive"
    eos = rt.stop_token_ids()
    warm = rt.encode(next(iter(texts.values()))[0])
    for n, q in runs:  # untimed: first-call allocations and kernel builds at each block size
        orchestrators[base_of[n]].generate(warm, GenerationConfig(16, q, sampling, stop_token_ids=eos,
                                                                  lookup_tokens=lookup_of[n], lookup_min_ngram=lo_n,
                                                                  lookup_max_ngram=hi_n))
    rows = []
    for ds, ds_texts in texts.items():
        prompts = [rt.encode(t) for t in ds_texts]
        jobs = [(j, i, s) for j, i in enumerate(prompts) for s in seeds for _ in range(args.repeats)]
        per_prompt: dict[tuple[str, int], list[list[int]]] = {r: [[] for _ in prompts] for r in runs}
        toks = dict.fromkeys(runs, 0)
        secs = dict.fromkeys(runs, 0.0)
        made: dict[tuple[str, int], list[int]] = {r: [] for r in runs}
        reach: dict[tuple[str, int], int] = dict.fromkeys(runs, 0)  # produced tokens in vocabulary or prompt
        for k, (j, ids, seed) in enumerate(jobs):
            for n, q in runs[k % len(runs):] + runs[:k % len(runs)]:
                r = orchestrators[base_of[n]].generate(ids, GenerationConfig(
                    args.max_new_tokens, q, sampling, stop_token_ids=eos, seed=seed, lookup_tokens=lookup_of[n],
                    lookup_min_ngram=lo_n, lookup_max_ngram=hi_n))
                per_prompt[n, q][j] += r.acceptance_lengths
                toks[n, q] += len(r.token_ids) - 1
                secs[n, q] += r.decode_s
                made[n, q] += r.token_ids
                if vocab[base_of[n]] is not None:
                    out = torch.tensor(r.token_ids)
                    reach[n, q] += int((vocab[base_of[n]].cpu()[out] | torch.isin(out, torch.tensor(ids))).sum())
        for n, q in runs:
            a = [x for p in per_prompt[n, q] for x in p]
            rows.append({"draft": n, "dataset": ds, "block_size": q, "lookup_tokens": lookup_of[n],
                         "temperature": args.temperature,
                         "tau": round(sum(a) / len(a), 3) if a else None,
                         "tok_s": round(toks[n, q] / secs[n, q], 1) if secs[n, q] > 0 else None,
                         "repeats": args.repeats})
            t2d = vocab[base_of[n]]
            if t2d is not None and made[n, q]:
                rows[-1]["in_vocab"] = round(t2d.cpu()[torch.tensor(made[n, q])].float().mean().item(), 4)
                if prompt_vocab.get(base_of[n]):
                    rows[-1]["in_reach"] = round(reach[n, q] / len(made[n, q]), 4)
            if q > 1 and a:
                se = tau_interval(per_prompt[n, q])["se"]
                rows[-1]["tau_se"] = None if se is None else round(se, 3)
                if n != names[0] and (names[0], q) in per_prompt and any(per_prompt[names[0], q]):
                    d = tau_interval(per_prompt[n, q], per_prompt[names[0], q])
                    rows[-1][f"delta_vs_{names[0]}"] = {key: None if v is None else round(v, 3)
                                                        for key, v in d.items()}
            print(json.dumps(rows[-1]), flush=True)

if __name__ == "__main__":
    main()
