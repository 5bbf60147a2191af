"""The lean engine's fused CPU kernels (targets/kernels.py, targets/csrc/lean_ops.cpp): the same
forward as the engine's torch path to float rounding, and row-invariant bit for bit (a verified
token equals the token decoded alone, in chains and in trees), which DFlash's losslessness needs."""

import os
import platform
import shutil

import pytest
import torch
from tiny import random_prompt, taught_target

from dflash_robot.targets import kernels
from dflash_robot.targets.lean import LeanTargetAdapter

ops = kernels.load()
NO_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is None
# Skipped only where the kernels cannot be built at all; with a compiler, a failed build fails below.
pytestmark = pytest.mark.skipif(ops is None and (NO_COMPILER or not kernels.enabled()),
                                reason=f"fused kernels unavailable: {kernels.unavailable_reason()}")


def test_the_kernels_build_where_a_compiler_is():
    assert ops is not None, f"the fused kernels failed to build: {kernels.unavailable_reason()}"

FAMILIES = ["llama", "qwen2", "qwen3"]  # qwen2: q/k/v biases; qwen3: per-head q/k RMSNorm
TAPS = (0, 2, 5)


def _pair(family, precision):
    model = taught_target(family)
    fused = LeanTargetAdapter(model, initial_capacity=16, precision=precision)
    plain = LeanTargetAdapter(model, initial_capacity=16, precision=precision, kernels=False)
    assert fused._ops is not None and plain._ops is None
    return fused, plain


def _close(a, b, tol):
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_fused_forward_matches_the_torch_path(family, precision):
    """Prefill, verifies of several widths, rollbacks and a cache regrowth: logits and features of
    the fused forward against the torch forward of the same engine (float64 attention there)."""
    fused, plain = _pair(family, precision)
    ids = torch.tensor(random_prompt(150, 3))
    tol = 1e-4 if precision == "fp32" else 2e-2  # bf16 activations into the quantized products
    a, b = fused.prefill(ids[:21], TAPS, 8), plain.prefill(ids[:21], TAPS, 8)
    _close(a.logits, b.logits, tol)
    _close(a.features, b.features, tol)
    # the last three grow the caches (64 -> 128 -> 256 slots) with live contents
    for start, q, keep in [(21, 16, 3), (24, 1, 1), (25, 8, 8), (33, 16, 0), (33, 5, 2), (35, 16, 16),
                           (51, 40, 40), (91, 50, 50)]:
        sa, sb = fused.snapshot(), plain.snapshot()
        a, b = fused.verify(ids[start:start + q], TAPS), plain.verify(ids[start:start + q], TAPS)
        _close(a.logits, b.logits, tol)
        _close(a.features, b.features, tol)
        fused.rollback(sa, keep)
        plain.rollback(sb, keep)
    assert fused._capacity == 256 and fused._k[0].shape[-1] == fused._capacity  # grown twice, K transposed


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_are_bit_identical_however_many_share_a_call(family):
    """Every verify width from 1 to 17 at context lengths that are not multiples of the kernels'
    16 lanes: each row equals the same token decoded alone."""
    eng, _ = _pair(family, "int4")
    prompt = torch.tensor(random_prompt(140, 5))
    block = torch.tensor(random_prompt(17, 6))
    for width, context in [(2, 35), (3, 34), (5, 32), (16, 21), (17, 20), (16, 55), (9, 125), (17, 120)]:
        # the last three cross the kernels' 64-slot score blocks: a slot's score must not depend on
        # whether the call's length puts it in a whole block or not
        eng.prefill(prompt[:context], TAPS)
        snap = eng.snapshot()
        batched = eng.verify(block[:width], TAPS)
        eng.rollback(snap, 0)
        single = eng.verify(block[:width], TAPS, sequential=True)
        assert torch.equal(batched.logits, single.logits), width
        assert torch.equal(batched.features, single.features), width


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_nodes_equal_their_path_decoded_token_by_token(family):
    """A tree verify (positions = depth, ancestor mask) against each root-to-node path verified
    alone as a chain (which equals decoding it token by token: the test above): the node's logits
    must be bit-identical, including nodes whose ancestors are not adjacent slots (node 4's path
    is 0 -> 2 -> 4)."""
    eng, _ = _pair(family, "int4")
    prompt = torch.tensor(random_prompt(23, 9))
    tokens = torch.tensor(random_prompt(6, 10))
    parent = [-1, 0, 0, 1, 2, 2]
    depths = torch.tensor([0, 1, 1, 2, 2, 2])
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for j in range(6):
        i = j
        while i >= 0:
            anc[j, i] = True
            i = parent[i]
    eng.prefill(prompt, TAPS)
    snap = eng.snapshot()
    tree = eng.verify_tree(tokens, depths, anc, TAPS)
    eng.rollback(snap, 0)
    for node in range(6):
        path = [i for i in range(6) if anc[node, i]]
        eng.rollback(snap, 0)
        out = eng.verify(tokens[path], TAPS)
        assert torch.equal(out.logits[-1], tree.logits[node]), node
        assert torch.equal(out.features[-1], tree.features[node]), node


def _reference_attention(qkv, kt, vc, cos, sin, start, nh, positions, mask, q_norm, k_norm, eps):
    """The attention block in float64 torch, from the kernel's contract (csrc/lean_ops.cpp)."""
    t, nkv, d = qkv.shape[0], vc.shape[0], vc.shape[2]
    x = qkv.double()
    q = x[:, :nh * d].view(t, nh, d)
    k = x[:, nh * d:(nh + nkv) * d].view(t, nkv, d)
    v = x[:, (nh + nkv) * d:].view(t, nkv, d)

    def norm(h, w):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    pos = positions if positions is not None else torch.arange(start, start + t)
    c, s = cos[pos].double()[:, None], sin[pos].double()[:, None]
    q, k = q * c + q.roll(d // 2, -1) * s, k * c + k.roll(d // 2, -1) * s
    keys = torch.cat([kt[:, :, :start].double().transpose(1, 2), k.transpose(0, 1)], dim=1)  # [nkv, S, d]
    vals = torch.cat([vc[:, :start].double(), v.transpose(0, 1)], dim=1)
    seen = torch.ones(t, start + t, dtype=torch.bool)
    seen[:, start:] = mask if mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
    out = torch.empty(t, nh, d, dtype=torch.float64)
    for h in range(nh):
        hk = h // (nh // nkv)
        sc = (q[:, h] @ keys[hk].T) / d ** 0.5
        out[:, h] = torch.softmax(sc.masked_fill(~seen, float("-inf")), -1) @ vals[hk]
    return out.reshape(t, nh * d), k, v


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "start"), [(24, 13), (64, 61), (80, 70), (128, 123)])
def test_attention_kernel_against_a_float64_reference(tree, dtype, d, start):
    """Head sizes of real models (64, 128; 80 = a 64-float chunk plus a 16-float one) and of the
    tiny ones, with the call's rows on both sides of a 64-slot score block."""
    g = torch.Generator().manual_seed(1)
    nh, nkv, cap, t, eps = 6, 2, 192, 5, 1e-6
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=g).to(dtype)
    kt, vc = torch.randn(nkv, d, cap, generator=g), torch.randn(nkv, cap, d, generator=g)
    cos, sin = torch.randn(cap, d, generator=g), torch.randn(cap, d, generator=g)
    qn, kn = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    positions = mask = None
    if tree:
        positions = torch.tensor([0, 1, 1, 2, 2]) + start
        mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                            dtype=torch.bool)
    ref, k, v = _reference_attention(qkv, kt, vc, cos, sin, start, nh, positions, mask, qn, kn, eps)
    out = ops.attention(qkv, kt, vc, cos, sin, start, nh, positions, mask, qn, kn, eps, False)
    _close(out, ref.float(), 1e-5)
    _close(kt[:, :, start:start + t].transpose(1, 2), k.transpose(0, 1).float(), 1e-5)  # written to the caches
    assert torch.equal(vc[:, start:start + t], v.transpose(0, 1).float())


def test_elementwise_kernels_against_torch():
    g = torch.Generator().manual_seed(2)
    x, y, w = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    ref = torch.nn.functional.rms_norm(x, (40,), w, 1e-5)
    _close(ops.rms_norm(x, w, 1e-5, False), ref, 1e-6)
    assert torch.equal(ops.rms_norm(x, w, 1e-5, True), ops.rms_norm(x, w, 1e-5, False).bfloat16())
    x2 = x.clone()
    out = ops.add_rms_norm(x2, y.bfloat16(), w, 1e-5, False)
    assert torch.equal(x2, x + y.bfloat16().float())
    _close(out, torch.nn.functional.rms_norm(x2, (40,), w, 1e-5), 1e-6)
    gu = torch.randn(3, 80, generator=g) * 8
    gate, up = gu.chunk(2, dim=-1)
    _close(ops.silu_mul(gu, False), torch.nn.functional.silu(gate) * up, 1e-6)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64", "i686"),
                    reason="the flush-to-zero guard is x86's MXCSR")
def test_kernels_flush_denormals_inside_and_leave_the_callers_mode_alone():
    """Inside a kernel, results below FLT_MIN are 0 (flush-to-zero: on Intel cores every denormal
    costs a microcode assist, which made SiLU 9x slower); after it, torch's own ops in the calling
    thread still see and produce denormals (the guard restores the caller's MXCSR)."""
    tiny = torch.tensor([1e-39])
    assert float(tiny[0]) != 0.0  # a denormal, stored as one
    gu = torch.tensor([[-10.0, 1e-35]])  # silu(-10) * 1e-35 ~ -4.5e-39: a denormal in IEEE arithmetic
    assert float(torch.nn.functional.silu(gu[:, :1]) * gu[:, 1:]) != 0.0
    assert float(ops.silu_mul(gu, False)[0, 0]) == 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # so that kernels and torch's ops below run on pool threads too
    try:
        many = torch.full((1 << 22,), 1e-39)
        for _ in range(2):  # after kernel calls that ran pool threads, IEEE denormals on every thread
            assert float((tiny * 1.0)[0]) != 0.0 and float((tiny / 2)[0]) != 0.0
            qkv = torch.randn(4, 18 * 16)  # 16 query heads, 1 kv head, d 16, 4 rows: one task per head
            kt, vc = torch.zeros(1, 16, 64), torch.zeros(1, 64, 16)
            cos, sin = torch.ones(8, 16), torch.zeros(8, 16)
            ops.attention(qkv, kt, vc, cos, sin, 0, 16, None, None, None, None, 1e-6, False)
            if AMX is not None:
                w4 = _int4_weight(4096, 64, seed=9)
                packed = AMX.q4_pack(w4.q.to(torch.int32).contiguous(), w4.scale.contiguous(), w4.zero.contiguous())
                AMX.q4_mm(torch.randn(3, 64).bfloat16(), packed, False)
            assert bool((many * 1.0).ne(0).all())  # a multi-threaded elementwise op over 4M denormals
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused_not_read_out_of_bounds():
    """Every refusal comes before anything is written: the caches are left as they were."""
    kt, vc = torch.zeros(2, 8, 64), torch.zeros(2, 64, 8)
    cos = sin = torch.zeros(64, 8)
    with pytest.raises(RuntimeError, match="cache too small"):
        ops.attention(torch.ones(3, 8 * 8), kt, vc, cos, sin, 62, 4, None, None, None, None, 1e-6, False)
    with pytest.raises(RuntimeError, match="head counts"):
        ops.attention(torch.ones(1, 7 * 8), kt, vc, cos, sin, 0, 4, None, None, None, None, 1e-6, False)
    with pytest.raises(RuntimeError, match="RoPE table"):
        ops.attention(torch.ones(1, 8 * 8), kt, vc, cos, sin, 0, 4, torch.tensor([64]), None, None, None, 1e-6,
                      False)
    with pytest.raises(RuntimeError, match="see itself"):
        ops.attention(torch.ones(2, 8 * 8), kt, vc, cos, sin, 0, 4, None, torch.tensor([[1, 0], [1, 0]]).bool(),
                      None, None, 1e-6, False)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.attention(torch.ones(1, 8 * 8), torch.zeros(2, 8, 40), torch.zeros(2, 40, 8), cos, sin, 0, 4, None,
                      None, None, None, 1e-6, False)
    assert not kt.any() and not vc.any()


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_error", None)
    monkeypatch.setenv("DFLASH_ROBOT_KERNELS", "0")
    assert kernels.load() is None and "DFLASH_ROBOT_KERNELS" in (kernels.unavailable_reason() or "")
    eng = LeanTargetAdapter(taught_target("llama"), initial_capacity=16)
    assert eng._ops is None and eng._k[0].shape[1] == 16  # the torch path, K not transposed


def test_a_damaged_build_is_rebuilt_not_trusted(monkeypatch, tmp_path):
    """A library left half-written (an interrupted build) is deleted and built again; a good one is
    loaded directly, without running the build."""
    from dflash_robot.targets.loading import cache_root

    name = kernels.build_name()
    built_lib = cache_root() / "kernels" / name / f"{name}.so"  # where this process's build was moved
    monkeypatch.setenv("DFLASH_ROBOT_CACHE", str(tmp_path))
    lib = tmp_path / "kernels" / name / f"{name}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF truncated")
    built = []

    def fake_build(**kw):
        built.append(kw["name"])
        return ops

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    assert kernels._load() is ops and built == [name] and not lib.exists()
    lib.write_bytes(built_lib.read_bytes())  # a good library under this build's name
    assert kernels._load().attention is not None and built == [name]


@pytest.mark.parametrize("d", [64, 128])
def test_attention_rows_are_bit_identical_at_real_head_sizes(d):
    """The attention kernel alone at SmolLM2's and Llama's head sizes: T rows in one call against
    the same rows one call each (causal), from 50 cached slots, so the calls end on both sides of
    the 64-slot block."""
    g = torch.Generator().manual_seed(5)
    nh, nkv, cap, start, t = 9, 3, 128, 50, 17
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=g).bfloat16()
    kt, vc = torch.randn(nkv, d, cap, generator=g), torch.randn(nkv, cap, d, generator=g)
    cos, sin = torch.randn(cap, d, generator=g), torch.randn(cap, d, generator=g)
    kt1, vc1 = kt.clone(), vc.clone()
    batched = ops.attention(qkv, kt, vc, cos, sin, start, nh, None, None, None, None, 1e-6, True)
    single = torch.cat([ops.attention(qkv[i:i + 1].contiguous(), kt1, vc1, cos, sin, start + i, nh, None, None,
                                      None, None, 1e-6, True) for i in range(t)])
    assert torch.equal(batched, single)
    assert torch.equal(kt, kt1) and torch.equal(vc, vc1)


AMX = kernels.amx()
needs_amx = pytest.mark.skipif(AMX is None, reason="this CPU (or OS) has no AMX-BF16; the int4 products stay torch's")


def _int4_weight(n, k, seed):
    from dflash_robot.targets.quant import quantize_int4

    g = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(n, k, generator=g) * 0.05)


def _q4_reference(w4, x):
    """x [M, K] bf16 times w = (q - 8) * scale + zero, scale and zero rounded to bf16 (as both
    kernels keep them), in float64."""
    s = w4.scale.bfloat16().double().repeat_interleave(32, dim=1)
    z = w4.zero.bfloat16().double().repeat_interleave(32, dim=1)
    return x.double() @ ((w4.q.double() - 8) * s + z).T


@needs_amx
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (960, 576), (576, 1536)])
def test_amx_int4_product_against_float64(n, k):
    """The AMX product: each group's bf16 products exact, summed in fp32: within fp32 rounding of
    the exact product, where torch's int4 kernel (its bf16 output) is within bf16's."""
    w4 = _int4_weight(n, k, seed=n + k)
    packed = AMX.q4_pack(w4.q.to(torch.int32).contiguous(), w4.scale.contiguous(), w4.zero.contiguous())
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = _q4_reference(w4, x)
    out = AMX.q4_mm(x, packed, False)
    assert out.dtype == torch.float32 and out.shape == (7, n)
    assert float((out.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(AMX.q4_mm(x, packed, True), out.bfloat16())  # bf16 output: the same, rounded to nearest even


@needs_amx
def test_amx_int4_rows_are_bit_identical_however_many_share_a_call():
    """Row invariance across the kernel's 16-row tiles: 40 rows at once, in 16 + 16 + 8, equal each
    row alone and any other split, bit for bit."""
    w4 = _int4_weight(576, 1536, seed=3)
    packed = AMX.q4_pack(w4.q.to(torch.int32).contiguous(), w4.scale.contiguous(), w4.zero.contiguous())
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = AMX.q4_mm(x, packed, False)
    assert torch.equal(torch.cat([AMX.q4_mm(x[i:i + 1].contiguous(), packed, False) for i in range(40)]), whole)
    assert torch.equal(torch.cat([AMX.q4_mm(x[:5].contiguous(), packed, False),
                                  AMX.q4_mm(x[5:].contiguous(), packed, False)]), whole)
    threads = torch.get_num_threads()
    try:  # nor on how the columns are split between threads
        torch.set_num_threads(1)
        assert torch.equal(AMX.q4_mm(x, packed, False), whole)
    finally:
        torch.set_num_threads(threads)
    assert AMX.q4_mm(x[:0].contiguous(), packed, False).shape == (0, 576)


@needs_amx
def test_int4_linear_uses_the_amx_product_and_agrees_with_torchs(monkeypatch):
    """`quant.int4_linear` runs on AMX where it can, and torch's int4 kernel with DFLASH_ROBOT_AMX=0
    (and for widths that are not whole 16-column blocks); the two agree to bf16 rounding."""
    from dflash_robot.targets.quant import int4_linear

    w4 = _int4_weight(96, 64, seed=5)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    packed = AMX.q4_pack(w4.q.to(torch.int32).contiguous(), w4.scale.contiguous(), w4.zero.contiguous())
    assert torch.equal(int4_linear(w4, None)(x), AMX.q4_mm(x.bfloat16(), packed, False))
    monkeypatch.setenv("DFLASH_ROBOT_AMX", "0")
    assert kernels.amx() is None
    torch_out = int4_linear(w4, None)(x)
    ref = _q4_reference(w4, x.bfloat16())
    assert float((torch_out.double() - ref).abs().max()) <= 1e-2 * float(ref.abs().max())
    assert not torch.equal(torch_out, AMX.q4_mm(x.bfloat16(), packed, False))  # it really is the other kernel


@needs_amx
def test_amx_int4_refuses_bad_inputs():
    w4 = _int4_weight(32, 64, seed=7)
    q, s, z = w4.q.to(torch.int32).contiguous(), w4.scale.contiguous(), w4.zero.contiguous()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        AMX.q4_pack(q[:24].contiguous(), s[:24].contiguous(), z[:24].contiguous())
    with pytest.raises(RuntimeError, match="0..15"):
        AMX.q4_pack(q + 8, s, z)
    packed = AMX.q4_pack(q, s, z)
    with pytest.raises(RuntimeError, match="bf16"):
        AMX.q4_mm(torch.randn(2, 64), packed, False)
    with pytest.raises(RuntimeError, match="K matching"):
        AMX.q4_mm(torch.randn(2, 96).bfloat16(), packed, False)


@needs_amx
def test_amx_int8_product_exact_and_row_invariant():
    """`q8_mm` (the GGUF's Q8_0 head on AMX): int8 q times fp32 group scales, within fp32 rounding of
    the float64 product, bf16 output the fp32 one rounded, and row-invariant across 16-row tiles."""
    from dflash_robot.targets.quant import Int8GroupWeight, q8_linear

    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (96, 320), generator=g, dtype=torch.int8)  # 10 groups: a second batch of 8
    scale = (torch.rand(96, 10, generator=g) * 1e-2).half().float()  # Q8_0's fp16 scales
    w8 = Int8GroupWeight(q, scale)
    packed = AMX.q8_pack(q, scale)
    x = torch.randn(35, 320, generator=g).bfloat16()
    ref = x.double() @ w8.dequantize().double().T
    out = AMX.q8_mm(x, packed, False)
    assert float((out.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(AMX.q8_mm(x, packed, True), out.bfloat16())
    assert torch.equal(torch.cat([AMX.q8_mm(x[i:i + 1].contiguous(), packed, False) for i in range(35)]), out)
    assert torch.equal(q8_linear(w8, None)(x.float()), out)
    with pytest.raises(RuntimeError, match="int8"):
        AMX.q8_pack(q.int(), scale)
    with pytest.raises(RuntimeError, match="q8_pack"):
        AMX.q8_mm(x, AMX.q4_pack(torch.zeros(96, 320, dtype=torch.int32), scale, scale), False)
    assert AMX.q8_mm(x[:0].contiguous(), packed, False).shape == (0, 96)
