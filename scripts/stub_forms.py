"""Which form the HumanEval-shaped stubs of a range of `docstring` shards take (docs/TRAINING.md,
session 40).

Usage: python scripts/stub_forms.py --shards 1809-1866 [--data data/smollm2-selfdistill]

Since session 40 a stub holds either its function's whole docstring or only its first paragraph
(`prompts.humaneval_stub`). Each stub of the range is matched, by function name, against the
installed pool (`prompts.documented_functions`) and counted as `whole` (a docstring of several
paragraphs, whole), `first paragraph` (of such a docstring) or `one paragraph` (both forms are the
same prompt); `unmatched` if no function of the pool gives it (a pool built from other packages).
Plain requests are counted too. Samples and response tokens per form.
"""

from __future__ import annotations

import argparse
import collections
import re

from repeats import shard_number  # scripts/repeats.py (this script's directory is on sys.path)

from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training import prompts as P
from dflash_robot.training.data import Shard, shard_paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--shards", required=True, help="LO-HI, shard numbers")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.shards.split("-"))

    _, tok = load_target_model(default_target_path(), None, "float32", "cpu")
    pool: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for name, sig, doc in P.documented_functions():
        pool[name].append((sig, doc))
    head = P.HUMANEVAL_WRAPPER.split("\n")[0]
    samples: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    for path in shard_paths(args.data):
        if not lo <= shard_number(path.stem) <= hi:
            continue
        shard = Shard.load(path)
        if shard.source != "docstring":
            continue
        for i in range(len(shard)):
            ids, _ = shard.sample(i)
            start = int(shard.response_start[i])
            prompt = tok.decode(ids[:start])
            form = "plain request" if head not in prompt else stub_form(prompt, pool)
            samples[form] += 1
            tokens[form] += len(ids) - start
    for form in sorted(samples):
        print(f"shards {args.shards} | {form} | {samples[form]} samples | {tokens[form]} response tokens")


def stub_form(prompt: str, pool: dict[str, list[tuple[str, str]]]) -> str:
    match = re.search(r"```python\n(.*)\n```", prompt, re.S)
    stub = match.group(1) if match else ""
    found = re.match(r"def (\w+)", stub)
    name = found.group(1) if found else ""
    for sig, doc in pool.get(name, []):
        whole, first = P.humaneval_stub(name, sig, doc), P.humaneval_stub(name, sig, doc, summary_only=True)
        if stub == whole:
            return "stub: one paragraph" if whole == first else "stub: whole docstring"
        if stub == first:
            return "stub: first paragraph"
    return "stub: unmatched"


if __name__ == "__main__":
    main()
