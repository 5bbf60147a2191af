"""Which target layer's hidden state says most about the token the draft's first position predicts?

Usage: python scripts/probe_taps.py [--data data/smollm2-selfdistill] [--samples 300] [--threads 2]

For every response anchor a of `--samples` training samples, a ridge regression (closed form,
one per layer) maps the target's hidden state at a - 1 (what the draft's context holds for the
positions before its block), with or without the embedding of the anchor token x[a] appended, to
the one-hot of x[a + 1] over the shipped draft's vocabulary; top-1 accuracy is then measured on the
held-out samples. It ranks the layers as candidate taps (`--target-layers`) by how much of the
first drafted token they hold linearly. docs/TRAINING.md (session 8) quotes it.
"""

from __future__ import annotations

import argparse

import torch

from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training.run import evaluation_samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hold, train = evaluation_samples(args.data, args.samples)
    model, _ = load_target_model(default_target_path(), None, "float32", "cpu")
    ids = load_draft(str(SHIPPED_DRAFT)).vocab_ids
    col = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    col[ids] = torch.arange(ids.numel())
    n_layers, hidden, v = model.config.num_hidden_layers, model.config.hidden_size, ids.numel()
    emb = model.get_input_embeddings().weight.detach()

    @torch.no_grad()
    def rows(sample):
        x, m = sample[0], sample[1]
        out = model(input_ids=x[None], output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hs = torch.stack([h[0] for h in out.hidden_states[1:]])  # [L, S, H]: the output of layer l
        a = torch.nonzero(m[1:], as_tuple=True)[0]
        a = a[a >= 1]
        return hs[:, a - 1], emb[x[a]], col[x[a + 1]]

    def design(f, e, with_emb):
        one = torch.ones(f.shape[0], 1)
        return torch.cat([f, e, one] if with_emb else [f, one], 1).double()

    dims = {False: hidden + 1, True: 2 * hidden + 1}
    xtx = {m: torch.zeros(n_layers, dims[m], dims[m], dtype=torch.float64) for m in dims}
    ytx = {m: torch.zeros(n_layers, v, dims[m], dtype=torch.float64) for m in dims}
    for s in train:
        f, e, y = rows(s)
        ok = y >= 0
        for m in dims:
            for layer in range(n_layers):
                x = design(f[layer][ok], e[ok], m)
                xtx[m][layer] += x.T @ x
                ytx[m][layer].index_add_(0, y[ok], x)  # X^T Y for one-hot Y, without building Y
    held = [rows(s) for s in hold]
    for m in dims:
        accs = []
        for layer in range(n_layers):
            w = torch.linalg.solve(xtx[m][layer] + args.ridge * torch.eye(dims[m], dtype=torch.float64),
                                   ytx[m][layer].T).float()
            hit = sum(int(((design(f[layer], e, m).float() @ w).argmax(-1) == y).sum()) for f, e, y in held)
            accs.append(hit / sum(y.numel() for _, _, y in held))
        label = "state + anchor embedding" if m else "state alone"
        print(f"{label}: top-1 of x[a+1] by layer 0..{n_layers - 1}: " + " ".join(f"{a:.3f}" for a in accs))


if __name__ == "__main__":
    main()
