"""Drafts as GGUF files: the llama.cpp `dflash` schema, lossless round trips, generation with
f32 / f16 / bf16 / Q8_0 drafts, and clear errors for bad files."""

import copy
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType
from safetensors.torch import load_file
from tiny import MASK, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.cli import main
from dflash_robot.drafts.checkpoint import load_draft, save_draft
from dflash_robot.drafts.gguf import save_gguf_draft
from dflash_robot.drafts.model import build_draft
from dflash_robot.errors import DraftLoadError, IncompatibleDraftError, UnsupportedModelError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig

PROMPTS = [random_prompt(8, 500 + s) for s in range(4)]
N_NEW = 40


def vocab_draft():
    """A draft whose head covers 20 of the 64 target tokens (d2t / t2d)."""
    torch.manual_seed(3)
    d = build_draft(taught_target("llama").config, 2, 8, MASK, draft_vocab_size=20)
    d.set_vocab(torch.randperm(64)[:20])
    return d


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The trained tiny draft as a z-lab directory and as GGUF files of every outtype."""
    root = tmp_path_factory.mktemp("gguf")
    save_draft(trained_draft("llama"), root / "draft")
    for outtype in ("f32", "f16", "bf16", "q8_0"):
        assert main(["convert", str(root / "draft"), str(root / f"draft-{outtype}.gguf"), "--outtype", outtype]) == 0
    return root


def fields_of(path):
    return {k: f for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


# --- schema and round trips ------------------------------------------------------------------

def test_keys_and_tensor_names_follow_llama_cpp(saved):
    path = saved / "draft-q8_0.gguf"
    f = fields_of(path)
    meta = trained_draft("llama").metadata
    assert f["general.architecture"].contents() == "dflash"
    assert f["dflash.target_layers"].contents() == [i + 1 for i in meta.target_layer_ids]  # llama.cpp: id + 1
    assert f["dflash.target_layers"].types == [VType.ARRAY, VType.INT32]
    assert f["dflash.block_size"].contents() == 16 and f["dflash.block_size"].types == [VType.UINT32]
    assert f["tokenizer.ggml.mask_token_id"].contents() == MASK
    assert f["dflash.attention.layer_norm_rms_epsilon"].types == [VType.FLOAT32]
    assert f["dflash_robot.training_block_size"].contents() == 16
    assert f["dflash_robot.num_target_layers"].contents() == 6
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    expected = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(2) for n in per_layer}
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert set(tensors) == expected
    for name, t in tensors.items():  # norms stay F32 when quantizing, as in llama.cpp
        assert t.tensor_type == (QType.F32 if len(t.shape) == 1 else QType.Q8_0), name
    assert [int(s) for s in tensors["fc.weight"].shape] == [64, 32]  # ggml order: {n_embd_inp, n_embd}


def _same_dirs(a, b):
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.mark.parametrize("kind", ["trained", "bf16", "vocab"])
def test_f32_roundtrip_is_bit_identical(tmp_path, kind):
    draft = {"trained": lambda: trained_draft("llama"),
             "bf16": lambda: copy.deepcopy(trained_draft("llama")).to(torch.bfloat16),  # never the cached one
             "vocab": vocab_draft}[kind]()
    save_draft(draft, tmp_path / "a")
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "a.gguf"), "--outtype", "f32"]) == 0
    assert main(["convert", str(tmp_path / "a.gguf"), str(tmp_path / "b")]) == 0
    _same_dirs(tmp_path / "a", tmp_path / "b")
    assert load_draft(tmp_path / "a.gguf").metadata == draft.metadata


def test_vocab_mapping_uses_llama_cpp_d2t(tmp_path):
    draft = vocab_draft()
    save_gguf_draft(draft, tmp_path / "v.gguf", "q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "v.gguf").tensors}
    assert tensors["d2t"].tensor_type == QType.I64  # absolute target ids, as llama.cpp scatters with
    assert np.array(tensors["d2t"].data).tolist() == draft.vocab_ids.tolist()
    assert "dflash_robot.t2d" not in tensors  # rebuilt from d2t; llama.cpp loads no unknown tensor
    back = load_draft(tmp_path / "v.gguf")
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)
    assert back.metadata.draft_vocab_size == 20


def test_older_files_with_a_t2d_tensor_still_load(tmp_path):
    """Files written before t2d was dropped carry `dflash_robot.t2d`: read, and checked against d2t."""
    draft = vocab_draft()
    save_gguf_draft(draft, tmp_path / "v.gguf", "f32")
    t2d = draft.t2d.numpy().astype(np.int8)
    back = load_draft(rewrite(tmp_path / "v.gguf", tmp_path / "old.gguf", tensors={"dflash_robot.t2d": t2d}))
    assert torch.equal(back.t2d, draft.t2d) and torch.equal(back.d2t, draft.d2t)
    with pytest.raises(DraftLoadError, match="disagree"):
        load_draft(rewrite(tmp_path / "v.gguf", tmp_path / "bad.gguf", tensors={"dflash_robot.t2d": 0 * t2d}))


def test_file_with_only_llama_cpp_keys_loads(tmp_path):
    """No dflash_robot.* keys, no t2d, the first converter's dflash.mask_token_id: defaults fill in."""
    draft = vocab_draft()
    save_gguf_draft(draft, tmp_path / "v.gguf", "f32")
    ours = [k for k in fields_of(tmp_path / "v.gguf") if k.startswith("dflash_robot.")]
    rewrite(tmp_path / "v.gguf", tmp_path / "plain.gguf", drop_keys=[*ours, "tokenizer.ggml.mask_token_id"],
            drop_tensors=["dflash_robot.t2d"], set_keys={"dflash.mask_token_id": (MASK, VType.UINT32)})
    back = load_draft(tmp_path / "plain.gguf")
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)  # t2d rebuilt from d2t
    m = back.metadata
    assert (m.draft_vocab_size, m.mask_token_id, m.target_layer_ids) == (20, MASK, draft.metadata.target_layer_ids)
    assert m.training_block_size == m.block_size == 8 and m.loss_decay == 4.0
    assert m.num_target_layers == max(m.target_layer_ids) + 1  # unknown without our key (see DRAFT_FORMAT.md)


def test_q8_0_falls_back_to_f16_for_odd_rows(tmp_path):
    cfg = taught_target("llama").config
    cfg2 = type(cfg)(**{**cfg.to_dict(), "hidden_size": 48, "head_dim": 12})
    save_gguf_draft(build_draft(cfg2, 2, 8, MASK), tmp_path / "odd.gguf", "q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "odd.gguf").tensors}
    assert types["fc.weight"] == QType.Q8_0 and types["blk.0.attn_q.weight"] == QType.F16  # 96 vs 48 columns
    assert load_draft(tmp_path / "odd.gguf").fc.weight.dtype == torch.float32


# --- generation --------------------------------------------------------------------------------

def _generate(draft):
    rt = DFlashRuntime.from_models(taught_target("llama"), draft)
    return [rt.orchestrator.generate(p, GenerationConfig(max_new_tokens=N_NEW, block_size=16)) for p in PROMPTS]


def test_gguf_draft_generates_like_the_safetensors_draft(saved):
    ref = _generate(load_draft(saved / "draft"))
    got = _generate(load_draft(saved / "draft-f32.gguf"))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in ref]


def test_quantized_drafts_are_lossless(saved, capsys):
    want = [plain_greedy_cached("llama", tuple(p), N_NEW) for p in PROMPTS]
    f32 = load_draft(saved / "draft-f32.gguf")
    q8 = load_draft(saved / "draft-q8_0.gguf", dtype=torch.float32)
    assert not torch.equal(q8.fc.weight, f32.fc.weight)  # really quantized
    assert torch.equal(q8.norm.weight, f32.norm.weight)  # norms kept F32
    rows = []
    for outtype in ("f32", "f16", "bf16", "q8_0"):
        results = _generate(load_draft(saved / f"draft-{outtype}.gguf", dtype=torch.float32))
        assert [r.token_ids for r in results] == want, outtype  # the target decides
        acc = [a for r in results for a in r.acceptance_lengths]
        rows.append((outtype, sum(acc) / len(acc)))
    with capsys.disabled():
        print("\nGGUF draft acceptance (mean tokens per target pass, tiny llama, 4 prompts x 40 tokens): "
              + ", ".join(f"{t} {a:.2f}" for t, a in rows))
    assert rows[-1][1] >= 0.9 * rows[0][1]  # Q8_0 keeps (nearly) all of f32's acceptance


def test_cli_generate_with_a_gguf_draft(saved, tmp_path, capsys):
    taught_target("llama").save_pretrained(tmp_path / "target")
    assert main(["generate", "--target", str(tmp_path / "target"), "--draft", str(saved / "draft-q8_0.gguf"),
                 "--input-ids", "1,2,3", "--max-new-tokens", "20", "--block-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain_greedy_cached("llama", (1, 2, 3), 40)[:20]


# --- bad files -----------------------------------------------------------------------------------

def rewrite(src, dst, arch="dflash", drop_keys=(), set_keys=None, drop_tensors=(), tensors=None):
    """Copy an f32 GGUF draft with keys / tensors dropped or replaced."""
    set_keys, tensors = set_keys or {}, tensors or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in drop_keys or k in set_keys:
            continue
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == VType.ARRAY else None)
    for k, (val, vtype, *sub) in set_keys.items():
        w.add_key_value(k, val, vtype, *sub)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, tensors.get(t.name, np.array(t.data)))
    for name, data in tensors.items():
        if name not in {t.name for t in r.tensors}:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("change,match", [
    (dict(drop_keys=["dflash.target_layers"]), "required GGUF key 'dflash.target_layers' is missing"),
    (dict(drop_keys=["tokenizer.ggml.mask_token_id"]), "'tokenizer.ggml.mask_token_id' is missing"),
    (dict(drop_keys=["dflash.embedding_length"]), "'dflash.embedding_length' is missing"),
    (dict(arch="llama"), "architecture 'llama' is not a DFlash draft"),
    (dict(set_keys={"dflash.block_count": ("two", VType.STRING)}), "'dflash.block_count' has a bad value"),
    (dict(set_keys={"dflash.target_layers": ([0, 4], VType.ARRAY, VType.INT32)}), "layer ids >= 1"),
    (dict(tensors={"blk.0.attn_q.weight": np.zeros((16, 32), np.float32)}),
     r"blk.0.attn_q.weight \(layers.0.self_attn.q_proj.weight\) has shape \(16, 32\), the metadata implies \(32, 32\)"),
    (dict(drop_tensors=["blk.1.ffn_up.weight"]), r"missing \['blk.1.ffn_up.weight'\]"),
    (dict(tensors={"blk.2.attn_q.weight": np.zeros((32, 32), np.float32)}), r"unexpected \['blk.2.attn_q.weight'\]"),
])
def test_bad_gguf_draft(saved, tmp_path, change, match):
    bad = rewrite(saved / "draft-f32.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(DraftLoadError, match=match):
        load_draft(bad)


@pytest.mark.parametrize("key,value,match", [
    ("dflash.attention.sliding_window", (8, VType.UINT32), "sliding-window"),
    ("dflash.attention.causal", (True, VType.BOOL), "causal"),
    ("dflash.selector_rank", (16, VType.UINT32), "DFlash-2"),
])
def test_llama_cpp_variants_we_do_not_run_are_refused(saved, tmp_path, key, value, match):
    bad = rewrite(saved / "draft-f32.gguf", tmp_path / "v.gguf", set_keys={key: value})
    with pytest.raises(UnsupportedModelError, match=match):
        load_draft(bad)


@pytest.mark.parametrize("keep", [0, 10, 200, 0.5, -100])
def test_truncated_gguf(saved, tmp_path, keep):
    data = (saved / "draft-f32.gguf").read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    (tmp_path / "cut.gguf").write_bytes(data[:n])
    with pytest.raises(DraftLoadError, match="truncated"):
        load_draft(tmp_path / "cut.gguf")
    assert (tmp_path / "cut.gguf").stat().st_size == n  # left as it was


def test_not_a_gguf(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file" * 50)
    with pytest.raises(DraftLoadError, match="corrupt or truncated GGUF"):
        load_draft(tmp_path / "junk.gguf")


@pytest.mark.parametrize("change,match", [
    (dict(set_keys={"dflash.target_layers": ([2, 8], VType.ARRAY, VType.INT32)}),
     r"target_layer_ids \[7\] are beyond the target's depth"),
    (dict(set_keys={"dflash_robot.num_target_layers": (12, VType.UINT32)}), "built for 12 layers, target has 6"),
])
def test_gguf_draft_that_does_not_fit_the_target(saved, tmp_path, change, match):
    draft = load_draft(rewrite(saved / "draft-f32.gguf", tmp_path / "x.gguf", **change))
    with pytest.raises(IncompatibleDraftError, match=match):
        DFlashRuntime.from_models(taught_target("llama"), draft)


def test_gguf_draft_for_another_hidden_size(tmp_path):
    cfg = taught_target("llama").config
    cfg2 = type(cfg)(**{**cfg.to_dict(), "hidden_size": 48, "head_dim": 12})
    save_gguf_draft(build_draft(cfg2, 1, 8, MASK), tmp_path / "h48.gguf")
    with pytest.raises(IncompatibleDraftError, match="hidden size: draft 48, target 32"):
        DFlashRuntime.from_models(taught_target("llama"), load_draft(tmp_path / "h48.gguf"))


@pytest.mark.parametrize("args,match", [
    (["{d}", "{t}/out"], "must be a .gguf file"),
    (["{g}", "{t}/out.gguf"], "must be a directory"),
    (["{g}", "{t}/out", "--outtype", "q8_0"], "q8_0 is a GGUF storage type"),
    (["{t}/nope", "{t}/out.gguf"], "does not exist"),
    (["{g}", "{d}"], "exists and is not empty"),  # never over an existing draft
])
def test_convert_cli_errors(saved, tmp_path, capsys, args, match):
    paths = dict(d=saved / "draft", g=saved / "draft-f32.gguf", t=tmp_path)
    assert main(["convert", *(a.format(**paths) for a in args)]) == 2
    assert match in capsys.readouterr().err


def _tokenizer_gguf(path, n_tokens):
    """A stand-in target GGUF holding only a tokenizer (llama.cpp's keys) of n_tokens tokens."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_mask_token_id(0)  # the target's own mask (if any) must not replace the draft's
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_convert_copies_the_targets_tokenizer(saved, tmp_path):
    tok = _tokenizer_gguf(tmp_path / "target.gguf", 64)
    out = tmp_path / "with-tok.gguf"
    assert main(["convert", str(saved / "draft"), str(out), "--tokenizer-from", str(tok)]) == 0
    fields = gguf.GGUFReader(out).fields
    src = gguf.GGUFReader(tok).fields
    for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        assert fields[k].contents() == src[k].contents() and fields[k].types == src[k].types
    assert fields["tokenizer.ggml.mask_token_id"].contents() == MASK  # the draft's mask token
    back = load_draft(out)  # and the runtime reads the file as before
    assert back.metadata == load_draft(saved / "draft").metadata


@pytest.mark.parametrize("args,match", [
    (["--tokenizer-from", "/nonexistent.gguf"], "is not a file"),
    (["--tokenizer-from", "WRONG"], "not this draft's target"),
])
def test_convert_refuses_a_wrong_tokenizer(saved, tmp_path, capsys, args, match):
    args = [str(_tokenizer_gguf(tmp_path / "t48.gguf", 48)) if a == "WRONG" else a for a in args]
    assert main(["convert", str(saved / "draft"), str(tmp_path / "x.gguf"), *args]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.e2e
def test_the_shipped_draft_loads_in_llama_cpp(tmp_path):
    """With the target's tokenizer copied in, llama.cpp (llama-cpp-python, installed with the
    default target) loads our GGUF draft as its `dflash` architecture, d2t vocabulary included."""
    llama_cpp = pytest.importorskip("llama_cpp")
    out = tmp_path / "smollm2-draft.gguf"
    from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT

    assert main(["convert", str(SHIPPED_DRAFT), str(out), "--tokenizer-from", "default"]) == 0
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(out).encode(), params)
    assert model, "llama.cpp refused the draft"
    try:
        assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)) == 49152
        assert llama_cpp.llama_model_n_embd(model) == 576
        assert llama_cpp.llama_model_n_layer(model) == load_draft(out).shape.num_layers
    finally:
        llama_cpp.llama_model_free(model)
