"""Self-distillation data on disk: compact shards, features captured while generating,
resumption, the feature store, and a whole training run from disk on a tiny model."""

import copy
import json
import os
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import MASK, char_tokenizer, plain_greedy, taught_target

from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.errors import ConfigError, DFlashError
from dflash_robot.runtime.api import runtime_target_adapter
from dflash_robot.targets.fastpath import pack_linears
from dflash_robot.training import data as D
from dflash_robot.training import prompts as P
from dflash_robot.training.run import TrainRun, ensure_features, load_checkpoint, prompt_key, train
from dflash_robot.training.trainer import target_features

TAPS = (1, 3, 4)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    model, tok = taught_target("llama"), char_tokenizer()
    D.generate_dataset(model, tok, root, "math:1,docstring:1", 2, max_new_tokens=12, batch_size=3,
                       feature_layer_ids=TAPS)
    return root


def test_prompt_sources_are_diverse_and_not_evaluation():
    import random

    rng = random.Random(0)
    math = P.math_prompts(rng, 50)
    code = P.docstring_prompts(rng, 50)
    assert len(set(math)) > 45 and len(set(code)) > 40
    assert all(m.endswith(P.GSM8K_SUFFIX) for m in math)
    assert len(P.documented_functions()) > 500
    assert D.check_not_evaluation(math + code, D.evaluation_prompts()) == math + code


def test_docstring_requests_give_two_stubs_per_multi_paragraph_function():
    import random

    doc = "Return the sum of a and b, as an int.\n\nBoth arguments must be ints.\n\n>>> add(1, 2)\n3"
    full, summary = P.humaneval_stub("add", "(a, b)", doc), P.humaneval_stub("add", "(a, b)", doc, summary_only=True)
    assert full.startswith("def add(a, b):\n") and ">>> add(1, 2)" in full and "Both arguments" in full
    assert summary == 'def add(a, b):\n    """Return the sum of a and b, as an int.\n    """\n'
    one = "Return the sum of a and b, as an int."
    assert P.humaneval_stub("f", "(a)", one) == P.humaneval_stub("f", "(a)", one, summary_only=True)
    # both forms are drawn: some stubs carry a later paragraph of their function's docstring, some do not
    rng, docs = random.Random(1), {n: d for n, _, d in P.documented_functions()}
    stubs = [p for p in P.docstring_prompts(rng, 400) if p.startswith(P.HUMANEVAL_WRAPPER.split("\n")[0])]
    multi = [(p, docs[p.split("def ")[1].split("(")[0]]) for p in stubs
             if "\n\n" in docs.get(p.split("def ")[1].split("(")[0], "")]
    later = [p for p, d in multi if d.split("\n\n")[1].split("\n")[0].strip() in p]
    assert 0 < len(later) < len(multi)


@pytest.mark.parametrize(("sig", "plain"), [
    ("(G, H, *, backend=None, **backend_kwargs)", "(G, H)"),
    ("(*, backend=None, **backend_kwargs)", "()"),
    ("(G, *, weight='w', backend=None, **backend_kwargs)", "(G, *, weight='w')"),
    ("(a, *, axis=0)", "(a, *, axis=0)"),
    ("(x, backend=None)", "(x, backend=None)"),
])
def test_docstring_requests_drop_networkx_dispatch_parameters(sig, plain):
    assert P.plain_signature(sig) == plain


def test_shards_hold_the_targets_greedy_answers(gen_dir):
    model, tok = taught_target("llama"), char_tokenizer()
    shards = D.shard_paths(gen_dir)
    assert [p.name for p in shards] == ["shard-00000.npz", "shard-00001.npz"]
    for p in shards:
        s = D.Shard.load(p)
        assert s.tokens.dtype == np.int32 and len(s) == 3 and s.source in ("math", "docstring")
        for i in range(len(s)):
            ids, mask = s.sample(i)
            start = int(s.response_start[i])
            with torch.no_grad():  # the target's own greedy continuation of the prompt
                ref = model.generate(ids[None, :start], max_new_tokens=12, do_sample=False,
                                     attention_mask=torch.ones(1, start, dtype=torch.long),
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, start:]
            assert ids[start:].tolist() == ref.tolist()[:ids.shape[0] - start]
            assert bool(mask[start:].all()) and not bool(mask[:start].any())


def test_captured_features_equal_a_full_forward(gen_dir):
    model = taught_target("llama")
    store = D.FeatureStore(gen_dir, TAPS, model.config.hidden_size)
    for p in D.shard_paths(gen_dir):
        s = D.Shard.load(p)
        for i in range(len(s)):
            ids, _ = s.sample(i)
            a = int(s.offsets[i])
            got = store.get(p.stem, a, a + ids.shape[0])
            ref = target_features(model, ids, TAPS)
            # the last token is never fed back while generating, so its row is not captured
            torch.testing.assert_close(got[:-1].float(), ref[:-1], rtol=2e-2, atol=2e-2)
    sub = D.FeatureStore(gen_dir, (3,), model.config.hidden_size)  # a subset of the stored taps
    full = store.get("shard-00000", 0, 5)
    assert torch.equal(sub.get("shard-00000", 0, 5), full[:, 32:64])


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])  # qwen3_5: state layers, every row runs to the end
def test_greedy_batch_drops_finished_rows_and_keeps_each_rows_answer_and_features(family):
    model, tok = taught_target(family), char_tokenizer()
    tok.padding_side, tok.pad_token = "left", tok.eos_token
    texts = ["abc", "hello world 12", "x", "the cat sat on", "q9 (", "zz top"]
    free = D.greedy_batch(model, tok, texts, 16, [MASK])[1]  # the model never writes MASK
    assert all(len(r) == 16 for r in free)
    stop = [free[0][2], free[1][6], free[3][9]]  # rows meet these at different steps
    tap = D.FeatureTap(model, TAPS)
    try:
        D.greedy_batch(model, tok, texts[:1], 4, stop)  # a forward pass recorded but not asked for
        prompts, resps, feats, width = D.greedy_batch(model, tok, texts, 16, stop, tap)
    finally:
        tap.remove()
    lengths = [len(r) for r in resps]
    assert len(set(lengths)) >= 3 and min(lengths) < 16  # rows left the batch at different steps
    rows = D._unpad_features(feats, prompts, resps, width)
    a = 0
    for p, r in zip(prompts, resps, strict=True):
        ref = plain_greedy(model, p, 16)
        cut = next((i for i, t in enumerate(ref) if t in stop), None)
        assert r == (ref[:cut + 1] if cut is not None else ref)  # the target's own greedy answer
        ids = torch.tensor(p + r)
        got = rows[a:a + len(ids)]
        # the forwards that wrote the row; its last token was never fed back, so its row is zero
        torch.testing.assert_close(got[:-1].float(), target_features(model, ids, TAPS)[:-1], rtol=2e-2, atol=2e-2)
        if family == "llama":
            assert not got[-1].any()
        a += len(ids)
    assert a == rows.shape[0]


def test_generation_resumes_after_complete_shards(gen_dir):
    before = {p.name: p.stat().st_mtime_ns for p in D.shard_paths(gen_dir)}
    D.generate_dataset(taught_target("llama"), char_tokenizer(), gen_dir, "math:1,docstring:1", 3,
                       max_new_tokens=12, batch_size=3, feature_layer_ids=TAPS)
    after = {p.name: p.stat().st_mtime_ns for p in D.shard_paths(gen_dir)}
    assert set(after) == set(before) | {"shard-00002.npz"}
    assert all(after[k] == v for k, v in before.items())


def test_generation_skips_prompts_already_in_the_data(tmp_path, monkeypatch):
    # a static source with a pool of 5 prompts: 3 shards of 3 hold each of them once, and then nothing
    pool = [f"Add {i} and {i + 1}." for i in range(5)]
    monkeypatch.setitem(P.STATIC_SOURCES, "math", lambda rng, n: [rng.choice(pool) for _ in range(n)])
    model, tok = taught_target("llama"), char_tokenizer()
    D.generate_dataset(model, tok, tmp_path, "math:1", 3, max_new_tokens=4, batch_size=3)
    keys = [prompt_key(s) for s in D.iter_samples(tmp_path)]
    assert len(keys) == len(set(keys)) == 5
    assert D.stored_prompts(tmp_path) == set(keys)
    assert [p.name for p in D.shard_paths(tmp_path)] == ["shard-00000.npz", "shard-00001.npz"]
    chats = D.chat_texts(tok, pool[:2] + pool[:2])
    assert D.fresh_prompts(tok, chats, set(), 3) == (chats[:2], 2)
    assert D.fresh_prompts(tok, chats, D.stored_prompts(tmp_path), 3) == ([], 4)


def test_ensure_features_fills_missing_shards(tmp_path):
    model = copy.deepcopy(taught_target("llama"))  # the cached model is shared: never change it in place
    pack_linears(model)  # as `train` does before it builds the feature engine from the same model
    ids = [list(range(5, 25)), list(range(30, 40))]
    D._pack([i[:4] for i in ids], [i[4:] for i in ids], "self").save(tmp_path / "shard-v1-00000.npz")
    built = []

    def runtime_engine():  # what `train` passes: the adapter the runtime runs this target with
        built.append(runtime_target_adapter(model, None))
        return built[-1]

    assert ensure_features(runtime_engine, tmp_path, TAPS, only={"shard-00007"}) == 0  # not a shard the run reads
    assert not built  # nothing to compute: no engine is built
    assert ensure_features(runtime_engine, tmp_path, TAPS, only={"shard-v1-00000"}) == 1
    assert type(built[0]).__name__ == "LeanTargetAdapter"  # the runtime's engine for a Llama target
    assert ensure_features(runtime_engine, tmp_path, TAPS) == 0 and len(built) == 1  # computed once
    store = D.FeatureStore(tmp_path, TAPS, 32)
    for a, seq in ((0, ids[0]), (20, ids[1])):  # every row, of every sample (none is left zero)
        got = store.get("shard-v1-00000", a, a + len(seq))
        torch.testing.assert_close(got.float(), target_features(model, torch.tensor(seq), TAPS), rtol=1e-2, atol=1e-2)


def test_ensure_features_refuses_an_adapter_that_taps_nothing(tmp_path):
    """An adapter whose prefill returns no features is a clear error, and no feature file is written."""
    D._pack([[5, 6, 7, 8]], [[9, 10, 11]], "self").save(tmp_path / "shard-v1-00000.npz")

    class Untapped:
        def input_embedding_weight(self):
            return torch.zeros(1)

        def prefill(self, ids, layer_ids, chunk):
            return types.SimpleNamespace(features=None)

    with pytest.raises(DFlashError, match=r"Untapped.prefill returned no features for layers \(1, 3, 4\)"):
        ensure_features(Untapped, tmp_path, TAPS)
    assert not list((tmp_path / "features").rglob("*.npy"))


def test_a_training_run_from_disk_with_a_draft_vocabulary(gen_dir, tmp_path):
    model_dir = tmp_path / "target"
    taught_target("llama").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    run = TrainRun(out=str(tmp_path / "run"), data=str(gen_dir), target=str(model_dir), layers=2, block_size=8,
                   draft_vocab=24, steps=6, batch_size=2, blocks_per_seq=4, save_every=3, eval_every=3,
                   holdout=2, holdout_shards="shard-00000", mask_token_id=MASK, warmup_steps=2)
    draft_dir = train(run)
    d = load_draft(draft_dir)
    assert d.metadata.draft_vocab_size == 24 and d.metadata.target_layer_ids == (1, 3)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    # every sample whose prompt leaves a response token inside --max-len (512; the docstring pool,
    # and so the prompts' lengths, depend on the packages installed), less 2 of shard-00000 held out
    usable = sum(int((D.Shard.load(p).response_start < 512).sum()) for p in D.shard_paths(gen_dir))
    assert log[0]["train_samples"] == usable - 2 and log[0]["holdout_samples"] == 2
    assert 0 < log[0]["draft_vocab_coverage"] <= 1 and log[0]["step0_holdout_tau_est"] >= 1
    assert [r["step"] for r in log[1:]] == list(range(1, 7)) and "holdout_tau_est" in log[3]
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")  # weights_only: no pickled objects
    assert state["trainer"]["step"] == 6
    # the draft's taps (1, 3) are a subset of the stored ones: nothing was recomputed
    assert [p.name for p in (gen_dir / "features").iterdir()] == ["taps-1-3-4"]
    # resumed with arguments that build another draft: refused before the target loads (the
    # target path below does not exist, so reaching the load would raise something else)
    bad = dict(vars(run), target="/nonexistent-target")
    for change, msg in ((dict(layers=3), "--layers 3 (its draft: 2)"),
                        (dict(draft_vocab=0), "--draft-vocab 0 (its draft: 24)"),
                        (dict(target_layers="1,2"), "--target-layers [1, 2] (its draft: [1, 3])")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            train(TrainRun(**{**bad, **change}))


def test_a_grown_draft_vocabulary_keeps_the_init_drafts_tokens_and_adds_the_most_frequent(tmp_path):
    """`--draft-vocab N` above the --init draft's keeps every token that draft covers and adds the
    most frequent other response tokens of the pool (all the data not held out), not of the
    shards a stage selects."""
    from dflash_robot.drafts.checkpoint import save_draft
    from dflash_robot.drafts.model import build_draft
    from dflash_robot.training.run import _make_draft

    model, tok = taught_target("llama"), char_tokenizer()
    src = build_draft(model.config, 1, 8, MASK, draft_vocab_size=4)
    src.set_vocab(torch.tensor([5, 6, 7, 8]))
    save_draft(src, tmp_path / "src")

    def sample(*runs):  # (token, count) runs -> one sample, its first token the prompt
        ids = torch.tensor([1] + [t for t, n in runs for _ in range(n)])
        return ids, torch.arange(len(ids)) > 0, ("shard-00000", 0, len(ids))
    pool = [sample((20, 10), (21, 8)), sample((22, 6), (23, 4), (5, 1))]
    train = [sample((30, 50), (23, 2))]  # a stage's selection: 30 is frequent here only
    run = TrainRun(out=str(tmp_path / "run"), data="unused", init=f"draft:{tmp_path / 'src'}", layers=1,
                   block_size=8, draft_vocab=7, mask_token_id=MASK)
    draft, info = _make_draft(run, model, tok, train, pool)
    assert sorted(draft.vocab_ids.tolist()) == [5, 6, 7, 8, 20, 21, 22]
    assert info["draft_vocab_grown_from"] == 4
    # a vocabulary as large as the init draft's is that draft's; a new one ranks the pool alone
    same, _ = _make_draft(TrainRun(**{**vars(run), "draft_vocab": 4}), model, tok, train, pool)
    assert sorted(same.vocab_ids.tolist()) == [5, 6, 7, 8]
    fresh, _ = _make_draft(TrainRun(**{**vars(run), "init": "random"}), model, tok, train, pool)
    assert sorted(fresh.vocab_ids.tolist())[2:] == [5, 20, 21, 22, 23] and 30 not in fresh.vocab_ids.tolist()


def test_prompt_vocab_is_set_inherited_and_refused_without_a_vocabulary(tmp_path):
    """`--prompt-vocab` marks the draft; without the flag a run keeps its --init draft's setting,
    `--no-prompt-vocab` clears it, and a draft without a vocabulary is refused."""
    import dataclasses

    from dflash_robot.drafts.checkpoint import save_draft
    from dflash_robot.drafts.model import build_draft
    from dflash_robot.training.run import _make_draft

    model, tok = taught_target("llama"), char_tokenizer()
    src = build_draft(model.config, 1, 8, MASK, draft_vocab_size=4)
    src.set_vocab(torch.tensor([5, 6, 7, 8]))
    src.metadata = dataclasses.replace(src.metadata, prompt_vocab=True)
    save_draft(src, tmp_path / "src")
    ids = torch.tensor([1, 5, 6, 20, 7])
    pool = [(ids, torch.arange(5) > 0, ("shard-00000", 0, 5))]
    run = TrainRun(out=str(tmp_path / "run"), data="unused", init=f"draft:{tmp_path / 'src'}", layers=1,
                   block_size=8, mask_token_id=MASK)
    for flag, want in ((None, True), (False, False), (True, True)):
        draft, info = _make_draft(TrainRun(**{**vars(run), "prompt_vocab": flag}), model, tok, pool, pool)
        assert draft.metadata.prompt_vocab is want
        assert info["draft_vocab_coverage"] == 0.75  # 5, 6, 7 of 5, 6, 20, 7
        assert info.get("prompt_vocab_coverage") == (0.75 if want else None)  # 20 is not in the prompt [1]
    pool = [(torch.tensor([20, 5, 6, 20, 7]), torch.arange(5) > 0, ("shard-00000", 0, 5))]
    assert _make_draft(run, model, tok, pool, pool)[1]["prompt_vocab_coverage"] == 1.0
    full, _ = _make_draft(TrainRun(**{**vars(run), "draft_vocab": 0}), model, tok, pool, pool)  # drops both
    assert full.metadata.draft_vocab_size is None and full.metadata.prompt_vocab is False
    with pytest.raises(ConfigError, match="--prompt-vocab needs a draft vocabulary"):
        _make_draft(TrainRun(**{**vars(run), "init": "random", "prompt_vocab": True}), model, tok, pool, pool)
    with pytest.raises(ConfigError, match="--draft-vocab 0 is the full vocabulary"):
        train(TrainRun(**{**vars(run), "prompt_vocab": True, "draft_vocab": 0}))


@pytest.mark.parametrize("change,msg", [
    (dict(init="targt"), "--init must be random, target or draft:PATH, got 'targt'"),
    (dict(init="draft:/no/such/draft"), "--init draft:/no/such/draft: /no/such/draft does not exist"),
    (dict(log="/no/such/dir/x.jsonl"), "--log /no/such/dir/x.jsonl: directory /no/such/dir does not exist"),
    (dict(anchors="onpolicy"), "--anchors must be uniform or on-policy, got 'onpolicy'"),
    (dict(train_shards="214-"), "--train-shards '214-': '214-' is not a shard number"),
    (dict(distill=1.5), "--distill must be from 0 (hard labels) to 1 (the target's distribution), got 1.5"),
    (dict(copy_weight=0.0), "--copy-weight must be a positive number, got 0.0"),
    (dict(copy_weight=float("nan")), "--copy-weight must be a positive number, got nan"),
])
def test_train_arguments_are_checked_before_any_slow_work(gen_dir, tmp_path, change, msg):
    run = TrainRun(out=str(tmp_path / "run"), data=str(gen_dir), target="/nonexistent-target", **change)
    with pytest.raises(ConfigError, match=re.escape(msg)):
        train(run)
    assert not (tmp_path / "run").exists()  # nothing written


def test_data_of_another_target_is_refused(gen_dir, tmp_path):
    """`data` records its target (vocabulary size, tokenizer digest) in dataset.json; resuming
    generation or training with another target is refused before any work."""
    saved = json.loads((gen_dir / D.MANIFEST).read_text())
    assert saved["vocab_size"] == 64 and len(saved["tokenizer_sha256"]) == 64
    model, tok = taught_target("llama"), char_tokenizer()
    D.check_data_target(gen_dir, model, tok)  # its own target: accepted
    other = char_tokenizer()
    other.add_tokens(["<extra>"])  # another vocabulary listing, same size of model vocabulary: a warning
    with pytest.warns(UserWarning, match="tokenizer whose vocabulary differs"):
        D.generate_dataset(model, other, gen_dir, "math:1", 2, max_new_tokens=4, batch_size=2)  # nothing to add
    model_dir = tmp_path / "target"
    big = copy.deepcopy(taught_target("llama"))  # the cached model is shared: never change it in place
    big.resize_token_embeddings(80)
    big.save_pretrained(model_dir)
    run = TrainRun(out=str(tmp_path / "run"), data=str(gen_dir), target=str(model_dir), layers=1, steps=1,
                   holdout=1, holdout_shards="shard-00000", mask_token_id=MASK)
    with pytest.raises(ConfigError, match="its vocabulary has 64 tokens, this target's 80"):
        train(run)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_feature_store_reads_each_shard_from_a_tap_set_that_has_it(tmp_path):
    a = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 6).to(torch.bfloat16)
    b = -a
    D._save_features(D.taps_dir(tmp_path, (1, 2, 3)) / "shard-00000.npy", a)  # ids 1, 2, 3, hidden 2
    D._save_features(D.taps_dir(tmp_path, (1, 3, 5)) / "shard-00001.npy", b)
    store = D.FeatureStore(tmp_path, (1, 3), 2)
    assert torch.equal(store.get("shard-00000", 1, 3), torch.cat([a[1:3, 0:2], a[1:3, 4:6]], dim=-1))
    assert torch.equal(store.get("shard-00001", 0, 2), torch.cat([b[0:2, 0:2], b[0:2, 2:4]], dim=-1))
    assert store.get("shard-00002", 0, 1) is None


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is POSIX-only")
def test_feature_store_prefetch_names_exactly_the_rows_get_reads(tmp_path, monkeypatch):
    """`prefetch` hints the byte range of rows a..b of the shard's file (what `get` reads
    next); it changes nothing `get` returns, and shards without features or empty ranges
    (which `posix_fadvise` would read as "to the end of the file") are skipped."""
    a = torch.arange(10 * 6, dtype=torch.float32).view(10, 6).to(torch.bfloat16)
    path = D.taps_dir(tmp_path, (1, 2, 3)) / "shard-00000.npy"
    D._save_features(path, a)
    store = D.FeatureStore(tmp_path, (1, 3), 2)
    before = store.get("shard-00000", 3, 7)
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: calls.append(a) or real(*a))
    store.prefetch([("shard-00000", 3, 7), ("shard-00009", 0, 4), ("shard-00000", 5, 5)])
    assert len(calls) == 1 and calls[0][3] == os.POSIX_FADV_WILLNEED
    _, off, n, _ = calls[0]
    raw = np.frombuffer(path.read_bytes()[off:off + n], dtype=np.uint16).reshape(4, 6)  # all stored taps
    assert torch.equal(torch.from_numpy(raw.copy()).view(torch.bfloat16), a[3:7])
    assert torch.equal(store.get("shard-00000", 3, 7), before)


def test_feature_store_reads_rows_without_mapping_the_file(tmp_path):
    """`get` reads exactly rows a..b (checked against `np.load`), leaves no mapping of the file
    in the process (a training run visits every shard; maps of them all slowed each step), and
    refuses rows outside the file and a file cut short, instead of returning fewer rows."""
    a = torch.randn(50, 6).to(torch.bfloat16)
    path = D.taps_dir(tmp_path, (1, 2, 3)) / "shard-00000.npy"
    D._save_features(path, a)
    store = D.FeatureStore(tmp_path, (1, 2, 3), 2)
    ref = torch.from_numpy(np.load(path)).view(torch.bfloat16)
    for lo, hi in ((0, 50), (17, 18), (49, 50), (3, 3)):
        assert torch.equal(store.get("shard-00000", lo, hi), ref[lo:hi])
    if Path("/proc/self/maps").exists():
        assert str(path) not in Path("/proc/self/maps").read_text()
    with pytest.raises(ValueError, match=re.escape("rows 45..51 requested, the file holds 50")):
        store.get("shard-00000", 45, 51)
    path.write_bytes(path.read_bytes()[:-12])  # the last row lost
    with pytest.raises(ConfigError, match="file ends before row 50"):
        store.get("shard-00000", 40, 50)
    assert torch.equal(store.get("shard-00000", 40, 49), ref[40:49])
    (tmp_path / "features" / "taps-1-2-3" / "shard-00001.npy").write_bytes(b"not an array")
    with pytest.raises(ConfigError, match="shard-00001.npy: not a feature file"):
        store.get("shard-00001", 0, 1)


def test_partial_shard_files_are_not_data(tmp_path):
    """A write cut off by a crash (this version's hidden temp file, or an older version's
    `shard-N.tmp.npz`) is never read as a shard."""
    D._pack([[1, 2]], [[3, 4]], "self").save(tmp_path / "shard-00000.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00000.npz"]  # the temp file was renamed
    (tmp_path / "shard-00001.tmp.npz").write_bytes(b"cut off")
    (tmp_path / ".shard-00002.tmp.npz").write_bytes(b"cut off")
    assert [p.name for p in D.shard_paths(tmp_path)] == ["shard-00000.npz"]
    assert len(D.load_dataset(tmp_path)) == 1


def test_shard_selection():
    from dflash_robot.training.run import shard_selection

    sel = shard_selection("2-4, 9,shard-v1-00000")
    assert [n for n in ("shard-00001", "shard-00002", "shard-00004", "shard-00005", "shard-00009",
                        "shard-v1-00000", "shard-v1-00002") if sel(n)] == \
        ["shard-00002", "shard-00004", "shard-00009", "shard-v1-00000"]
    for bad in ("5-3", "x", "3-", "", "1,,2"):
        with pytest.raises(ConfigError, match="--train-shards"):
            shard_selection(bad)
    with pytest.raises(ConfigError, match="there is no shard named 'shard-0300'"):  # a typo selects nothing
        shard_selection("2-4,shard-0300", ["shard-00002", "shard-00300"])


def test_a_training_run_on_selected_shards(gen_dir, tmp_path):
    """--train-shards trains on those shards only; the held-out samples are unchanged; a selection
    that holds no training sample is refused before any feature is computed or step taken."""
    model_dir = tmp_path / "target"
    taught_target("llama").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    base = dict(data=str(gen_dir), target=str(model_dir), layers=1, block_size=4, steps=1, batch_size=2,
                blocks_per_seq=2, holdout=2, holdout_shards="shard-00000", mask_token_id=MASK, warmup_steps=1)
    train(TrainRun(out=str(tmp_path / "run"), train_shards="1", **base))
    head = json.loads((tmp_path / "run" / "train_log.jsonl").read_text().splitlines()[0])
    assert head["train_samples"] == 3 and head["holdout_samples"] == 2  # shard-00001's 3 samples
    with pytest.raises(ConfigError, match="no training sample in .* is in those shards"):
        train(TrainRun(out=str(tmp_path / "run2"), train_shards="77-80", **base))
    assert not (tmp_path / "run2" / "checkpoint.pt").exists()


def test_a_directory_from_before_the_record_is_checked_before_it_is_recorded(tmp_path):
    """Shards without a dataset.json (written before 2026-12-01): resuming generation there with a
    target whose vocabulary cannot hold their ids is refused, and nothing is recorded; ids that fit
    get this target recorded."""
    model, tok = taught_target("llama"), char_tokenizer()
    big, fits = tmp_path / "big", tmp_path / "fits"
    for d, top in ((big, 70), (fits, 40)):
        d.mkdir()
        D._pack([[1, 2, 3]], [[4, top]], "self").save(d / "shard-00000.npz")
    with pytest.raises(ConfigError, match="token id 70, outside this target's vocabulary \\(64\\)"):
        D.check_data_target(big, model, tok, write=True)
    assert not (big / D.MANIFEST).exists()
    D.check_data_target(fits, model, tok, write=True)
    assert json.loads((fits / D.MANIFEST).read_text())["vocab_size"] == 64


def test_online_features_train_as_cached_ones_do_and_write_nothing(tmp_path):
    """--online-features (the GPU run's mode): each step runs the target for its taps, no feature is
    written, and the run follows one on cached features (the same taps, rounded to bf16 on disk)."""
    model, tok = taught_target("llama"), char_tokenizer()
    data, model_dir = tmp_path / "data", tmp_path / "target"
    D.generate_dataset(model, tok, data, "math:1", 2, max_new_tokens=12, batch_size=3)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    base = dict(data=str(data), target=str(model_dir), layers=1, block_size=4, steps=4, batch_size=2,
                blocks_per_seq=3, holdout=2, holdout_shards="shard-00000", mask_token_id=MASK, warmup_steps=1,
                eval_every=2, save_every=2, eval_block_sizes="2")
    train(TrainRun(out=str(tmp_path / "online"), online_features=True, **base))
    assert not (data / "features").exists()
    train(TrainRun(out=str(tmp_path / "cached"), **base))
    assert len(list((data / "features").iterdir())) == 1  # the cached run wrote its taps
    online, cached = ([json.loads(line) for line in (tmp_path / r / "train_log.jsonl").read_text().splitlines()]
                      for r in ("online", "cached"))
    assert len(online) == len(cached) == 5
    # bf16 autocast rounds the draft's inputs to bf16, which is what the cache stores: the same run
    for a, b in zip(online[1:], cached[1:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
    assert online[0]["step0_holdout_tau_est"] == pytest.approx(cached[0]["step0_holdout_tau_est"], rel=1e-6)
    for key in ("holdout_tau_est", "holdout_tau_chain_b2"):
        assert online[-1][key] == pytest.approx(cached[-1][key], rel=1e-6)
