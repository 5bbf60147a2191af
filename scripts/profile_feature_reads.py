"""How long a training step waits for its batch's cached target features, with and without
`FeatureStore.prefetch` issued one step ahead.

Usage: python scripts/profile_feature_reads.py [--data data/smollm2-selfdistill] [--shards 400-581]
                                               [--taps 1,10,14,19,27] [--batch 4] [--pairs 30] [--wait 1.0]

Draws random batches of samples (as the trainer's shuffled order does) from the selected shards and
times `FeatureStore.get` over each batch: "plain" reads at once; "prefetched" first calls
`prefetch` on the batch and sleeps `--wait` seconds (a training step's length) before reading. The
two alternate, each batch drawn fresh, so page-cache state reaches both alike. Whether reads come
from the page cache or the disk depends on the machine's memory and on what else ran: report it
with the run's date and `free -m`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from dflash_robot.training.data import FeatureStore, Shard, shard_paths
from dflash_robot.training.run import shard_selection


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--shards", default="400-581")
    ap.add_argument("--taps", default="1,10,14,19,27")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--wait", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    data = Path(args.data)
    store = FeatureStore(data, [int(x) for x in args.taps.split(",")], args.hidden)
    selected = shard_selection(args.shards, [p.stem for p in shard_paths(data)])
    chosen = [p for p in shard_paths(data) if selected(p.stem)]
    keys = []
    for p in chosen:
        sh = Shard.load(p)
        for i in range(len(sh)):
            a, b = int(sh.offsets[i]), int(sh.offsets[i + 1])
            keys.append((p.stem, a, min(b, a + args.max_len)))
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())
    times: dict[str, list[float]] = {"plain": [], "prefetched": []}
    for k in range(args.pairs):
        for mode in (("plain", "prefetched") if k % 2 else ("prefetched", "plain")):
            batch = rng.sample(keys, args.batch)
            if mode == "prefetched":
                store.prefetch(batch)
                time.sleep(args.wait)
            t = time.perf_counter()
            for key in batch:
                store.get(*key)
            times[mode].append(time.perf_counter() - t)
    print(f"{len(keys)} samples in {len(chosen)} shards; batches of {args.batch}, {args.pairs} of each")
    for mode, ts in times.items():
        print(f"{mode:10s} median {statistics.median(ts) * 1e3:7.1f} ms  mean {statistics.mean(ts) * 1e3:7.1f} ms  "
              f"max {max(ts) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
