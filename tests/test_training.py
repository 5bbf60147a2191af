"""The training objective and loop, on tiny models."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from tiny import MASK, plain_greedy_cached, random_prompt, taught_target

from dflash_robot.drafts.model import build_draft
from dflash_robot.errors import ConfigError, DFlashError
from dflash_robot.training import objective
from dflash_robot.training.data import _pack, check_not_evaluation, load_dataset
from dflash_robot.training.run import batch_indices, load_checkpoint
from dflash_robot.training.trainer import DraftTrainer, OptimConfig, lr_lambda


def brute_force_mask(anchors, seq_len, q):
    n = len(anchors)
    m = torch.zeros(n * q, seq_len + n * q, dtype=torch.bool)
    for j, a in enumerate(anchors):
        for i in range(q):
            for s in range(seq_len):
                m[j * q + i, s] = s < a
            for j2 in range(n):
                for i2 in range(q):
                    m[j * q + i, seq_len + j2 * q + i2] = j2 == j
    return m


@pytest.mark.parametrize("seed", range(5))
def test_block_mask_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    s = 30
    loss_mask = torch.rand(s, generator=g) < 0.7
    anchors = objective.sample_anchors(loss_mask, 6, g)
    assert torch.equal(objective.block_mask(anchors, s, 4), brute_force_mask(anchors.tolist(), s, 4))
    # anchors are distinct, sorted, and each is followed by a response token
    assert anchors.unique().numel() == anchors.numel() and torch.equal(anchors, anchors.sort().values)
    assert bool(loss_mask[anchors + 1].all())


def test_anchors_cover_all_candidates_when_few():
    loss_mask = torch.tensor([False, False, True, True, False])
    assert objective.sample_anchors(loss_mask, 10).tolist() == [1, 2]
    assert objective.sample_anchors(torch.zeros(5, dtype=torch.bool), 10).numel() == 0


def test_loss_weights():
    w = objective.loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    for k in range(1, 16):
        assert w[k].item() == pytest.approx(math.exp(-(k - 1) / 7.0))


def test_block_inputs_labels_and_weights():
    ids = torch.arange(10, 20)
    loss_mask = torch.tensor([False] * 3 + [True] * 7)
    block_ids, pos, labels, weights = objective.block_inputs(ids, loss_mask, torch.tensor([2, 7]), 4, 99, 4.0)
    assert block_ids.tolist() == [12, 99, 99, 99, 17, 99, 99, 99]
    assert pos.tolist() == [2, 3, 4, 5, 7, 8, 9, 10]
    assert labels[:4].tolist() == [12, 13, 14, 15] and labels[4:7].tolist() == [17, 18, 19]
    w = objective.loss_weights(4, 4.0)
    assert weights[:4].tolist() == pytest.approx(w.tolist())
    assert weights[7] == 0  # past the end of the sequence


def _copy_positions_brute(ids: list[int]) -> list[bool]:
    pairs = list(zip(ids, ids[1:], strict=False))  # pairs[p - 1] ends at p
    return [False] + [pairs[p - 1] in pairs[:p - 1] for p in range(1, len(ids))]


@pytest.mark.parametrize("seed", range(6))
def test_copy_positions_match_a_brute_force_search(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3 + seed, (40,), generator=g)  # a small alphabet: many repeated bigrams
    got = objective.copy_positions(ids)
    assert got.tolist() == _copy_positions_brute(ids.tolist())
    assert got.any() and not got.all()
    assert objective.copy_positions(torch.tensor([5, 5])).tolist() == [False, False]


def test_copy_weight_scales_only_the_copied_labels():
    # "7 8 9 | 7 8 9": labels 8 and 9 of the second copy continue bigrams already in the context
    ids = torch.tensor([1, 7, 8, 9, 2, 7, 8, 9, 3])
    mask = torch.ones(9, dtype=torch.bool)
    anchors = torch.tensor([4])
    _, _, labels, plain = objective.block_inputs(ids, mask, anchors, 5, 99, 7.0)
    _, _, labels2, scaled = objective.block_inputs(ids, mask, anchors, 5, 99, 7.0, copy_weight=3.0)
    assert torch.equal(labels, labels2) and labels.tolist() == [2, 7, 8, 9, 3]
    factor = (scaled / plain.clamp(min=1e-12)).tolist()
    assert factor[1:] == pytest.approx([1.0, 3.0, 3.0, 1.0])  # 7 after 2: a new bigram; 3 after 9: new
    assert scaled[0] == 0


def _data(family="llama", n=24):
    seqs = []
    for i in range(n):
        p = random_prompt(6, 100 + i)
        ids = torch.tensor(p + plain_greedy_cached(family, tuple(p), 40))
        m = torch.zeros_like(ids, dtype=torch.bool)
        m[6:] = True
        seqs.append((ids, m))
    return seqs


def _trainer(steps=40, seed=0, lr=3e-3):
    torch.manual_seed(seed)
    model = taught_target("llama")
    draft = build_draft(model.config, 2, 8, MASK)
    return DraftTrainer(model, draft, OptimConfig(lr=lr, warmup_steps=5, total_steps=steps, blocks_per_seq=8))


def test_training_raises_acceptance():
    from dflash_robot.runtime.api import DFlashRuntime
    from dflash_robot.runtime.config import GenerationConfig

    data = _data()
    tr = _trainer(steps=80)

    def tau():
        rt = DFlashRuntime.from_models(taught_target("llama"), tr.draft.eval())
        acc = []
        for s in range(4):
            acc += rt.orchestrator.generate(random_prompt(10, 50 + s),
                                            GenerationConfig(max_new_tokens=30, block_size=8)).acceptance_lengths
        tr.draft.train()
        return sum(acc) / len(acc)

    before = tau()
    for s in range(80):
        tr.train_step(data[(s * 4) % 24:(s * 4) % 24 + 4])
    after = tau()
    assert before < 1.1 and after > before + 0.3


@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_padded_shapes_leave_the_loss_and_gradients_unchanged(distill):
    """Training pads each sequence's context and its weighted rows to a multiple of
    `shape_quantum` (fewer distinct matmul shapes); the loss, its weight, the acceptance estimate
    and every gradient equal the unpadded computation's (fp32)."""
    tr = _trainer()
    tr.cfg = dataclasses.replace(tr.cfg, distill=distill)
    if distill:
        from dflash_robot.training.trainer import TargetTail

        tr.teacher = TargetTail(tr.target, tr.draft.metadata.target_layer_ids)
    for ids, m in _data(n=3):
        plan = tr.blocks(ids, m)
        results = []
        for quantum in (1, 64):
            tr.shape_quantum = quantum
            tr.draft.zero_grad()
            loss, w, acc = tr.sequence_loss(ids, m, blocks=plan)
            loss.backward()
            results.append((loss.detach(), w, acc, [p.grad.clone() for p in tr.draft.parameters()]))
        (l1, w1, a1, g1), (l64, w64, a64, g64) = results
        assert ids.shape[0] % 64 and int((plan[4] > 0).sum()) % 64  # padding did happen
        torch.testing.assert_close(l64, l1, rtol=1e-5, atol=1e-5)
        assert float(w64) == pytest.approx(float(w1), rel=1e-6) and float(a64) == float(a1)
        for x, y in zip(g64, g1, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_resume_equals_uninterrupted(tmp_path):
    data = _data()
    batches = [data[(s * 4) % 24:(s * 4) % 24 + 4] for s in range(12)]
    a = _trainer(steps=12)
    for b in batches:
        a.train_step(b)
    b1 = _trainer(steps=12)
    for b in batches[:6]:
        b1.train_step(b)
    torch.save({"trainer": b1.state_dict()}, tmp_path / "ck.pt")
    b2 = _trainer(steps=12, seed=123)  # different init: everything must come from the checkpoint
    b2.load_state_dict(load_checkpoint(tmp_path / "ck.pt")["trainer"])
    assert b2.response_tokens_seen == sum(int(m.sum()) for b in batches[:6] for _, m in b)
    for b in batches[6:]:
        b2.train_step(b)
    for k, v in a.draft.state_dict().items():
        torch.testing.assert_close(v, b2.draft.state_dict()[k], rtol=1e-5, atol=1e-6)
    # the log's count of response tokens carries across the resume
    assert a.response_tokens_seen == b2.response_tokens_seen == sum(int(m.sum()) for b in batches for _, m in b)


def test_resume_follows_this_runs_schedule(tmp_path):
    """A resumed run may change --lr and --steps: the rate from the saved step on is the new run's
    warm-up + cosine, not the first run's peak brought back by the scheduler's saved state."""
    data = _data()
    a = _trainer(steps=12)
    for s in range(6):
        a.train_step(data[(s * 4) % 24:(s * 4) % 24 + 4])
    torch.save({"trainer": a.state_dict()}, tmp_path / "ck.pt")
    b = _trainer(steps=30, lr=1e-4)
    b.load_state_dict(load_checkpoint(tmp_path / "ck.pt")["trainer"])
    want = [1e-4 * lr_lambda(b.cfg)(k) for k in range(6, 9)]
    assert [g["lr"] for g in b.opt.param_groups] == pytest.approx([want[0]])
    got = [b.train_step(data[(s * 4) % 24:(s * 4) % 24 + 4])["lr"] for s in range(6, 9)]
    assert got == pytest.approx(want[1:] + [1e-4 * lr_lambda(b.cfg)(9)])
    assert b.opt.param_groups[0]["lr"] < 1e-4  # never the first run's 3e-3


def test_step_loss_is_the_batch_weighted_mean():
    """The gradient of one step is that of sum(weighted CE) / sum(weights) over the whole batch,
    whatever the sequences' lengths (no per-sequence or per-token renormalisation)."""
    data = [_data()[0], (_data()[1][0][:14], _data()[1][1][:14])]  # a long and a short sequence
    tr = _trainer()
    tr.cfg = dataclasses.replace(tr.cfg, grad_clip=1e9)  # unclipped, to compare
    tr.opt.step = lambda: None  # keep the weights: compare the gradients the step left
    state = tr.gen.get_state()
    logged = tr.train_step(data)["loss"]
    got = [p.grad.clone() for p in tr.draft.parameters()]
    tr.gen.set_state(state)  # the same anchors again
    tr.draft.zero_grad(set_to_none=True)
    parts = [tr.sequence_loss(ids, m) for ids, m in data]
    mean = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    mean.backward()
    assert logged == pytest.approx(float(mean), rel=1e-5)  # the logged loss is that same mean
    for g, p in zip(got, tr.draft.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)


def test_holdout_prompts_never_reach_training():
    from dflash_robot.training.run import TrainRun, split_holdout

    def sample(shard, k, prompt, response):
        ids = torch.tensor(prompt + response)
        m = torch.zeros_like(ids, dtype=torch.bool)
        m[len(prompt):] = True
        return ids, m, (shard, k, k + len(ids))

    samples = [sample("shard-00000", 0, [1, 2, 3], [4, 5]), sample("shard-00000", 5, [7, 8], [9, 9]),
               sample("shard-00001", 0, [1, 2, 3], [4, 6]),  # the held-out prompt, drawn again
               sample("shard-00001", 5, [1, 2], [3, 4])]
    hold, train = split_holdout(samples, TrainRun(out="x", data="x", holdout=1, holdout_shards="shard-00000"))
    assert [s[2] for s in hold] == [("shard-00000", 0, 5)]
    assert [s[2] for s in train] == [("shard-00000", 5, 9), ("shard-00001", 5, 9)]


def test_batch_order_is_deterministic_and_sharded():
    assert batch_indices(3, 10, 2, 0, 0, 1) == batch_indices(3, 10, 2, 0, 0, 1)
    r0, r1 = batch_indices(0, 10, 2, 0, 0, 2), batch_indices(0, 10, 2, 0, 1, 2)
    assert not set(r0) & set(r1)


def test_corrupt_checkpoint(tmp_path):
    p = tmp_path / "checkpoint.pt"
    p.write_bytes(b"not a checkpoint")
    with pytest.raises(DFlashError, match="corrupt, truncated or unsafe training checkpoint"):
        load_checkpoint(p)
    torch.save({"trainer": {"step": 1}, "evil": OptimConfig()}, p)  # an arbitrary pickled object
    with pytest.raises(DFlashError, match="unsafe"):
        load_checkpoint(p)


def test_empty_prompt_set(tmp_path):
    with pytest.raises(ConfigError, match="no training data"):
        load_dataset(tmp_path)
    _pack([[1, 2]], [[]], "self").save(tmp_path / "shard-00000.npz")
    with pytest.raises(ConfigError, match="no sample with response tokens"):
        load_dataset(tmp_path)
    (tmp_path / "shard-00000.npz").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="corrupt or truncated data shard"):
        load_dataset(tmp_path)


def test_evaluation_prompts_are_refused():
    from dflash_robot.bench import datasets as bench_data
    from dflash_robot.training.data import evaluation_prompts

    he = bench_data.humaneval()
    gsm = bench_data.gsm8k()
    assert len(he) == 164 and len(gsm) == 1319
    kept = check_not_evaluation([he[0], "  " + gsm[5].upper() + " ", "Write a haiku about rain."],
                                evaluation_prompts())
    assert kept == ["Write a haiku about rain."]


def test_unwritable_output_dir(tmp_path, capsys):
    from dflash_robot.cli import main

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permission bits; use a path under a file instead
        (tmp_path / "file").write_text("")
        ro = tmp_path / "file" / "out"
    assert main(["train", "--out", str(ro), "--data", str(tmp_path)]) == 2
    assert "is not writable" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", ["4,x", "1", "4,17"])
def test_bad_eval_block_sizes_fail_before_any_work(tmp_path, capsys, sizes):
    """--eval-block-sizes must be integers from 2 to the training block size (16): refused before
    the data or the target is read (the data directory here does not even exist)."""
    from dflash_robot.cli import main

    out = tmp_path / "out"
    assert main(["train", "--out", str(out), "--data", str(tmp_path / "missing"),
                 "--eval-block-sizes", sizes]) == 2
    assert "--eval-block-sizes" in capsys.readouterr().err
    assert not out.exists()


def test_target_draft_mismatch_refused_for_training():
    from dflash_robot.drafts.validation import check_compatible
    from dflash_robot.errors import IncompatibleDraftError
    from dflash_robot.targets.hf import HFTargetAdapter

    cfg = taught_target("llama").config
    other = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": 12})
    with pytest.raises(IncompatibleDraftError, match="target depth"):
        check_compatible(build_draft(other, 2, 8, MASK), HFTargetAdapter(taught_target("llama")))


DDP_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from tiny import taught_target, MASK
from dflash_robot.drafts.model import build_draft
from dflash_robot.training.trainer import DraftTrainer, OptimConfig
dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
m = taught_target("llama")
d = build_draft(m.config, 1, 4, MASK)
ddp = torch.nn.parallel.DistributedDataParallel(d)
cfg = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=3, blocks_per_seq=4, seed=dist.get_rank())
tr = DraftTrainer(m, d, cfg, ddp)
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(3):
    ids = torch.randint(0, 60, (20,), generator=g)
    mask = torch.ones(20, dtype=torch.bool)
    tr.train_step([(ids, mask)])
w = d.fc.weight.detach().clone()
ws = [torch.zeros_like(w) for _ in range(2)]
dist.all_gather(ws, w)
assert torch.equal(ws[0], ws[1]), "replicas diverged"
print("DDP-OK", dist.get_rank())
dist.destroy_process_group()
"""


def test_ddp_two_processes_gloo(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", "29533", str(script), os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("DDP-OK") == 2


def test_chain_replay_reproduces_real_greedy_decoding():
    """The held-out replay (`chain_acceptance`) against the runtime's own DFlash greedy decoding of
    the same prompts with the same draft: the same tokens gained at every verify step."""
    from tiny import trained_draft

    from dflash_robot.runtime.api import DFlashRuntime
    from dflash_robot.runtime.config import GenerationConfig

    model, draft = taught_target("llama"), trained_draft("llama", block_size=8)
    rt = DFlashRuntime.from_models(model, draft, engine="hf")
    tr = DraftTrainer(model, draft, OptimConfig())
    seen = []
    for s in range(4):
        prompt = random_prompt(8, 70 + s)
        for q in (8, 4, 5):  # the training block size (the default), and other decoding sizes
            res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=30, block_size=q))
            ids = torch.tensor(prompt + res.token_ids)
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[len(prompt):] = True
            got = tr.chain_acceptance(ids, mask, chunk=5, block_size=None if q == 8 else q)
            assert got == res.acceptance_lengths, q
            seen += res.acceptance_lengths
    assert max(seen) >= 3  # runs long enough to test the walk


def test_growing_a_draft_keeps_its_proposals(tmp_path):
    """--init draft:PATH with more layers and a superset of taps (in another order): the grown draft's
    logits equal the source's on the same context (new taps fed noise: their fc columns are zero)."""
    from dflash_robot.drafts.checkpoint import save_draft
    from dflash_robot.errors import IncompatibleDraftError
    from dflash_robot.training.init import init_from_draft

    model = taught_target("llama")
    torch.manual_seed(0)
    src = build_draft(model.config, 2, 8, MASK, target_layer_ids=[1, 4])
    save_draft(src, tmp_path / "src")
    grown = build_draft(model.config, 4, 8, MASK, target_layer_ids=[4, 0, 1])
    notes = init_from_draft(grown, tmp_path / "src")
    assert len(notes) == 3 and "taps" in notes[0]
    h, s, q = model.config.hidden_size, 11, 8
    g = torch.Generator().manual_seed(3)
    f1, f4, noise_tap = (torch.randn(s, h, generator=g) for _ in range(3))
    block = torch.randn(1, q, h, generator=g)
    pos, ctx = torch.arange(s, s + q)[None], torch.arange(s)[None]
    with torch.no_grad():
        a = src(block, torch.cat([f1, f4], -1)[None], pos, ctx)
        b = grown(block, torch.cat([f4, noise_tap, f1], -1)[None], pos, ctx)
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(IncompatibleDraftError, match="lack its taps"):
        init_from_draft(build_draft(model.config, 4, 8, MASK, target_layer_ids=[0, 4]), tmp_path / "src")
    with pytest.raises(IncompatibleDraftError, match="layers"):
        init_from_draft(build_draft(model.config, 1, 8, MASK, target_layer_ids=[1, 4]), tmp_path / "src")


def test_successor_anchors():
    """a + run + 1, kept only where the next token is a response token, sorted and distinct."""
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    anchors = torch.tensor([1, 2, 3, 4, 6, 9])
    runs = torch.tensor([2, 1, 0, 3, 5, 1])
    # successors 4, 4, 4, 8, 12, 11: 4 (mask[5]) kept once, 8 dropped (mask[9] is 0),
    # 12 dropped (the last position has no next token), 11 kept (mask[12])
    assert objective.successor_anchors(anchors, runs, mask).tolist() == [4, 11]


def test_on_policy_anchors_are_where_decoding_starts_blocks():
    """The successors of every candidate anchor hold every block start of the chain replay (itself
    checked against real decoding above) after the first, and only anchor candidates; on-policy
    `blocks` draws them, topped up with uniform anchors to `blocks_per_seq`."""
    from tiny import trained_draft

    model, draft = taught_target("llama"), trained_draft("llama", block_size=8)
    tr = DraftTrainer(model, draft, OptimConfig(blocks_per_seq=12, anchors="on-policy"))
    longest = 0
    for s in range(4):
        prompt = random_prompt(8, 90 + s)
        ids = torch.tensor(prompt + plain_greedy_cached("llama", tuple(prompt), 30))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[len(prompt):] = True
        gains = tr.chain_acceptance(ids, mask)
        starts = (len(prompt) + torch.tensor(gains).cumsum(0))[:-1]  # the blocks after the first
        cands = torch.nonzero(mask[1:], as_tuple=True)[0]
        nxt = tr.successors(ids, mask, cands)
        assert set(starts.tolist()) <= set(nxt.tolist())
        assert bool(mask[nxt + 1].all()) and len(nxt) < len(cands)  # runs of 1+ make successors fewer
        longest = max(longest, max(gains))
        anchors = tr.blocks(ids, mask)[0]
        assert len(anchors) == 12 and len(set(anchors.tolist())) == 12 and bool(mask[anchors + 1].all())
    assert longest >= 3  # the draft gets runs right, so successors skip ahead
    assert 0 < tr._drawn[0] < tr._drawn[1]  # some anchors came from successors, some topped up


def test_on_policy_training_step():
    data = _data()
    tr = _trainer(steps=4)
    tr.cfg = dataclasses.replace(tr.cfg, anchors="on-policy")
    stats = tr.train_step(data[:4])
    assert 0 < stats["on_policy_share"] <= 1 and math.isfinite(stats["loss"])


@pytest.mark.parametrize("family,shortcut", [("llama", True), ("qwen3", True), ("gemma3", False), ("qwen3_5", False)])
def test_target_tail_gives_the_targets_own_logits(family, shortcut):
    """The distillation teacher from the deepest tap: the target's remaining layers (plain causal
    attention) or, for sliding-window / hybrid tails, the full forward; either way the target's
    own next-token logits at every position."""
    from dflash_robot.training.trainer import TargetTail, target_features

    model = taught_target(family)
    ids = torch.tensor(random_prompt(30, 7))
    layer_ids = (1, 3)
    tail = TargetTail(model, layer_ids)
    assert tail.shortcut is shortcut
    hidden = tail.hidden(ids, target_features(model, ids, layer_ids))
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(model.get_output_embeddings()(hidden), want, rtol=1e-4, atol=1e-4)


def test_distill_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    labels, w = torch.randint(0, 10, (6,), generator=g), torch.rand(6, generator=g)
    hard = objective.weighted_cross_entropy(logits, labels, w)
    torch.testing.assert_close(objective.distill_cross_entropy(logits, teacher, labels, w, 0.0), hard)
    # alpha 1: the teacher's cross-entropy = KL(p || q) + H(p), weighted
    p = teacher.softmax(-1)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), p, reduction="none").sum(-1)
    ent = -(p * p.log()).sum(-1)
    soft, _ = objective.distill_cross_entropy(logits, teacher, labels, w, 1.0)
    torch.testing.assert_close(soft, ((kl + ent) * w).sum())
    half, _ = objective.distill_cross_entropy(logits, teacher, labels, w, 0.5)
    torch.testing.assert_close(half, 0.5 * hard[0] + 0.5 * soft)


def test_distilled_loss_uses_the_targets_distribution_one_position_back():
    """With --distill 1 each block token at position p is trained towards the target's own
    distribution for p, i.e. its logits at p - 1 (checked against a full target forward)."""
    data = _data()
    tr = _trainer(steps=4)
    tr.cfg = dataclasses.replace(tr.cfg, distill=1.0)
    from dflash_robot.training.trainer import TargetTail

    tr.teacher = TargetTail(tr.target, tr.draft.metadata.target_layer_ids)
    ids, mask = data[0]
    plan = tr.blocks(ids, mask)
    seen, logits_fn = [], tr.draft.logits

    def record(hidden, head, extra=None):
        seen.append(logits_fn(hidden, head, extra))
        return seen[-1]

    tr.draft.logits = record
    loss, w_sum, _ = tr.sequence_loss(ids, mask, blocks=plan)
    _, _, pos, labels, weights, _ = plan
    keep = weights > 0
    with torch.no_grad():
        want = tr.target(input_ids=ids[None]).logits[0][pos[keep] - 1]
    n = int(keep.sum())  # rows past n pad the matmul shapes (`shape_quantum`), weighted 0
    assert seen[0].shape[0] % tr.shape_quantum == 0 and seen[0].shape[0] > n
    draft_logits, teacher_logits = (x[:n] for x in seen)
    torch.testing.assert_close(teacher_logits, want, rtol=1e-4, atol=1e-4)
    expect = -(want.softmax(-1) * draft_logits.float().log_softmax(-1)).sum(-1)
    torch.testing.assert_close(loss, (expect * weights[keep]).sum(), rtol=1e-4, atol=1e-4)
    assert float(w_sum) == pytest.approx(float(weights.sum()))
    del tr.draft.logits
    stats = tr.train_step(data[:4])  # and a full step runs
    assert math.isfinite(stats["loss"])
    # the held-out estimate needs only the draft's acceptance: it never runs the teacher, and it
    # equals the hard-label trainer's estimate
    from dflash_robot.training.run import holdout_estimate

    def no_teacher(*a, **k):
        raise AssertionError("the teacher ran for an acceptance estimate")

    tr.teacher.hidden = no_teacher
    est = holdout_estimate(tr, data[:3])
    tr.cfg, tr.teacher = dataclasses.replace(tr.cfg, distill=0.0), None
    assert est == pytest.approx(holdout_estimate(tr, data[:3]))
