"""Draft trees (DDTree, arXiv 2604.12989): pure tensor functions, on the device.

One draft forward gives, for a block `[last, mask * D]`, a distribution per depth
1..D. A chain verifies the argmax at each depth; a tree verifies several candidates at
once. Node = a path of per-depth ranks `(r_1, ..., r_d)`; its score is the sum of the
draft's log-probabilities of those ranked tokens. DDTree grows the tree best-first from
a heap (each popped node pushes its next sibling and its first child). Because a child
never scores above its parent, nor a sibling above its elder sibling, the heap pops
exactly the `budget` highest-scoring nodes of all rank paths. `build_tree` computes that
same set without a heap or a host sync: level by level it keeps the top-`budget`
children of the previous level's kept nodes (a node of the global top-`budget` is in
the top-`budget` of its level, and so is its parent), then takes the global
top-`budget` of those levels with a stable sort in depth order, which puts a parent
before its children even when their scores tie.

Layout of a tree of M = budget + 1 nodes (node 0 is the root, the last committed token):
  tokens [M]       target token ids (siblings are distinct: they are one top-k)
  parents [M]      parent node index, parents[0] = 0; a parent's index is below its child's
  depths [M]       0 for the root, 1..D
  ancestors [M, M] ancestors[j, i]: node i is node j or one of its ancestors; this is the
                   attention mask among the tree's nodes at verification
  live [M]         optional: False for a node that can never be accepted (a lookup branch's
                   nodes that repeat a path already in the tree, `attach_chain`)

Acceptance walks the target's own token down the children: at node j the target chose
`choice[j]` (its argmax, or a draw from its processed distribution); child c of j is
followed when `tokens[c] == choice[j]`. At most one child matches (siblings differ), so the
followed nodes form one path from the root; the token committed at depth d is
`choice[path[d]]`, a fresh target draw at each step: lossless by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_robot.runtime.acceptance import Acceptance


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [M] int64
    parents: torch.Tensor  # [M] int64
    depths: torch.Tensor  # [M] int64
    ancestors: torch.Tensor  # [M, M] bool
    max_depth: int  # D: the deepest possible node (block size - 1)
    live: torch.Tensor | None = None  # [M] bool, or None: every node may be accepted

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def build_tree(last: torch.Tensor, logprobs: torch.Tensor, budget: int, topk: int,
               vocab_ids: torch.Tensor | None = None) -> DraftTree:
    """last [1] (the root token), logprobs [D, V'] (the draft's log-probabilities at depths
    1..D, over its own vocabulary when `vocab_ids` [V'] maps its columns to target ids)
    -> the `budget` best nodes plus the root. Shapes depend only on (budget, topk, D)."""
    depth_max, vocab = logprobs.shape
    assert budget >= 1 and topk >= 1 and depth_max >= 1
    k = min(topk, vocab, budget)
    device = logprobs.device
    vals, idx = logprobs.float().topk(k, dim=-1)  # [D, k]
    # the union of kept nodes, level by level; entry 0 is the root
    scores = [torch.zeros(1, device=device)]
    parents = [torch.zeros(1, dtype=torch.long, device=device)]  # indices into the union
    tokens = [last.reshape(1).to(torch.long)]
    depths = [torch.zeros(1, dtype=torch.long, device=device)]
    prev_score, prev_start = scores[0], 0
    for d in range(depth_max):
        cand = (prev_score[:, None] + vals[d][None, :]).reshape(-1)  # [m_prev * k]
        keep = min(budget, cand.shape[0])
        top_s, top_i = cand.topk(keep)
        parent_local, rank = top_i // k, top_i % k
        tok = idx[d][rank]
        scores.append(top_s)
        parents.append(prev_start + parent_local)
        tokens.append(tok if vocab_ids is None else vocab_ids[tok])
        depths.append(torch.full((keep,), d + 1, dtype=torch.long, device=device))
        prev_start += prev_score.shape[0]
        prev_score = top_s
    all_s, all_p, all_t, all_d = (torch.cat(x) for x in (scores, parents, tokens, depths))
    # root first, then the best `budget` nodes; stable: on a tie the shallower (the parent) first
    order = torch.sort(all_s[1:], descending=True, stable=True).indices[:budget] + 1
    order = torch.cat([order.new_zeros(1), order])  # [M] union indices, in node order
    m = order.shape[0]
    node_of = torch.full((all_s.shape[0],), -1, dtype=torch.long, device=device)
    node_of[order] = torch.arange(m, device=device)
    par = node_of[all_p[order]]  # a kept node's parent is kept (see the module doc)
    par[0] = 0
    anc = torch.eye(m, dtype=torch.bool, device=device)
    reach = anc.clone()
    for _ in range(depth_max):  # reach[j] = {j} | reach[parent(j)], D times, covers every ancestor
        reach = anc | reach[par]
    return DraftTree(tokens=all_t[order], parents=par, depths=all_d[order], ancestors=reach,
                     max_depth=depth_max)


@dataclass
class TreeAcceptance(Acceptance):
    path: torch.Tensor = None  # type: ignore[assignment]  # [D + 1] node index at each depth (0-padded)


def tree_accept(tree: DraftTree, choice: torch.Tensor) -> TreeAcceptance:
    """choice [M]: the target's token at each node (argmax, or one draw from its processed
    distribution) -> the accepted path. num_accepted = a (its depth), tokens [D + 1] with
    tokens[:a] the accepted drafts and tokens[a] the bonus (the target's choice at the last
    accepted node); entries past a are padding."""
    ok = tree.tokens == choice[tree.parents]  # [M]: the target would have picked this node
    if tree.live is not None:
        ok &= tree.live
    ok[0] = True
    on_path = ~(tree.ancestors & ~ok[None, :]).any(dim=-1)  # every ancestor-or-self is ok
    node = torch.arange(tree.size, device=choice.device)
    path = torch.zeros(tree.max_depth + 1, dtype=torch.long, device=choice.device)
    path = path.scatter_reduce(0, tree.depths, torch.where(on_path, node, 0), reduce="amax")
    a = torch.where(on_path, tree.depths, 0).max()
    return TreeAcceptance(num_accepted=a, tokens=choice[path], path=path)


def chain_tree(block: torch.Tensor) -> DraftTree:
    """block [q] = [last, d_1..d_{q-1}] -> the same chain as a tree (node k at depth k)."""
    q = block.shape[0]
    node = torch.arange(q, device=block.device)
    return DraftTree(tokens=block.to(torch.long), parents=(node - 1).clamp(min=0), depths=node,
                     ancestors=torch.ones(q, q, dtype=torch.bool, device=block.device).tril(),
                     max_depth=q - 1)


def attach_chain(tree: DraftTree, chain: torch.Tensor, drop_dead: bool = False) -> DraftTree:
    """Add one more branch, `chain` [L] (tokens for depths 1..L; L may exceed the tree's depth),
    to `tree`.

    The branch is merged into the tree as into a trie: its first c tokens follow the deepest
    live path of the tree that spells them (c may be 0: the root), and only tokens c..L-1 become
    new live nodes, hung below that path's end. By default the L new rows are all appended
    (shapes depend on L alone, so no value leaves the device) and the first c of them are dead
    (`live` False, attending to themselves only). `drop_dead` reads c back and appends only the
    live rows: one host read, for a CPU target, where a row costs more than a read. A new node's
    token differs from every sibling's (else the path would have been one longer), so siblings
    stay distinct and `tree_accept` stays lossless."""
    chain = chain.to(device=tree.tokens.device, dtype=torch.long)
    attach, c = _spelled_prefix(tree, chain)
    if not drop_dead:
        return _attach(tree, chain, attach, c, None)
    skip = int(c)
    return tree if skip >= chain.shape[0] else _attach(tree, chain, attach, c, skip)


def _spelled_prefix(tree: DraftTree, chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the deepest live node whose path spells chain's first tokens, its depth c)."""
    n = int(chain.shape[0])
    device = tree.tokens.device
    live = tree.live if tree.live is not None else torch.ones(tree.size, dtype=torch.bool, device=device)
    want = torch.full((max(tree.max_depth, n) + 1,), -1, dtype=torch.long, device=device)
    want[1:n + 1] = chain  # want[d]: the branch's token at depth d
    match = tree.depths == 0  # the root; then nodes whose whole path spells the branch's prefix
    spelled = (tree.tokens == want[tree.depths]) & live
    for _ in range(tree.max_depth):
        match = (tree.depths == 0) | (spelled & match[tree.parents])
    attach = torch.where(match, tree.depths, -1).argmax()
    return attach, tree.depths[attach]


def _attach(tree: DraftTree, chain: torch.Tensor, attach: torch.Tensor, c: torch.Tensor,
            skip: int | None) -> DraftTree:
    """`attach_chain`'s rows below node `attach` (depth c): all L (skip None; the spelled prefix
    dead) or chain[skip:] only."""
    m = tree.size
    device = tree.tokens.device
    live = tree.live if tree.live is not None else torch.ones(m, dtype=torch.bool, device=device)
    depth_max = max(tree.max_depth, int(chain.shape[0]))
    if skip is not None:  # only the live rows: depths skip+1 .. L
        chain = chain[skip:]
    n = int(chain.shape[0])
    assert n >= 1
    i = torch.arange(n, device=device) + (skip or 0)  # each new row's index in the whole branch
    j = torch.arange(n, device=device)  # its row among the new ones
    new_live = i >= c
    new_parents = torch.where(i == c, attach, m + j - 1).clamp(min=0)
    new_parents = torch.where(new_live, new_parents, torch.zeros_like(new_parents))
    # rows of the new nodes: the attach node's ancestors, then the live new nodes up to itself
    old_part = tree.ancestors[attach][None, :].expand(n, m) & new_live[:, None]
    new_part = (new_live[None, :] & (j[None, :] <= j[:, None]) & new_live[:, None]) | torch.eye(
        n, dtype=torch.bool, device=device)
    top = torch.cat([tree.ancestors, tree.ancestors.new_zeros(m, n)], dim=1)
    ancestors = torch.cat([top, torch.cat([old_part, new_part], dim=1)], dim=0)
    return DraftTree(tokens=torch.cat([tree.tokens, chain]), parents=torch.cat([tree.parents, new_parents]),
                     depths=torch.cat([tree.depths, i + 1]), ancestors=ancestors, max_depth=depth_max,
                     live=torch.cat([live, new_live]))
