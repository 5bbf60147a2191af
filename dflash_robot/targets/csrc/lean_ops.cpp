// Fused per-layer steps of the lean engine; dflash_robot/targets/kernels.py builds and loads this.
//
// Row invariance. Every row (token) is computed by the same instruction sequence however many rows
// share the call, so a token verified among 15 others comes out bit for bit as when it is decoded
// alone, which DFlash's lossless guarantee needs:
// - reductions (sums of squares, softmax max and sum) run over 16 fixed lanes, summed in a fixed tree;
// - a score is one FMA chain over head_dim, whatever slot it is in;
// - attention visits the keys a row sees in slot order;
// - buffers come from ATen's allocator (64-byte aligned), so no loop peels differently between calls;
// - nothing depends on the thread that runs a row.
// tests/test_kernels.py checks this (verify of T rows == T single steps, bit for bit) on every run.
//
// Denormals. Every kernel body runs with flush-to-zero and denormals-are-zero (`NoDenormals`):
// softmax weights of far-off keys, their products with values, and the lanes a vectorized select
// computes and then discards (the compiler evaluates `gate / (1 + exp(88))` for every lane of SiLU)
// fall below FLT_MIN, and on Intel cores each such operation takes a microcode assist of ~100+
// cycles. On this project's Xeon box that made SiLU 9x and attention 3-4x slower than their
// arithmetic (docs/BENCHMARKS.md, session 16). Values below 1.2e-38 become 0; every row still runs
// the same instructions, so row invariance holds.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
// The int4 product on AMX: built where -march=native turns on AMX-BF16 (Sapphire Rapids and later),
// used where the kernel also grants the process its tile state (Linux 5.16+).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define DFLASH_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// FTZ and DAZ for the calling thread while in scope, the caller's mode restored after (torch's own
// ops and the Python caller keep IEEE denormals). at::parallel_for bodies run on pool threads: each
// body takes its own guard, and no guard is held across a parallel_for (a pool thread started there
// would inherit flush-to-zero and restore it as its own mode).
struct NoDenormals {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int saved;
  NoDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }  // bit 15 FTZ, bit 6 DAZ
  ~NoDenormals() { _mm_setcsr(saved); }
#else
  NoDenormals() = default;
#endif
  NoDenormals(const NoDenormals&) = delete;
  NoDenormals& operator=(const NoDenormals&) = delete;
};

constexpr int LANES = 16;
using bf16_t = uint16_t;  // bfloat16 bits

inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const bf16_t* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(bf16_t* p, int64_t i, float v) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u = (v != v) ? 0x7FC00000u : u + 0x7FFFu + ((u >> 16) & 1u);
  p[i] = static_cast<bf16_t>(u >> 16);
}

inline float lane_sum(float* acc) {
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

inline float lane_max(const float* __restrict__ x, int64_t n) {
  float acc[LANES];
  for (int l = 0; l < LANES; ++l) acc[l] = -INFINITY;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = acc[l] > x[i + l] ? acc[l] : x[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] = acc[l] > x[i + l] ? acc[l] : x[i + l];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] > acc[l + w] ? acc[l] : acc[l + w];
  return acc[0];
}

inline float lane_total(const float* __restrict__ x, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += x[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] += x[i + l];
  return lane_sum(acc);
}

// exp for softmax and SiLU: Cody-Waite reduction and a degree-6 polynomial (Cephes' expf
// coefficients), branch-free so the loops calling it vectorize; ~1 ulp on [-87, 88].
inline float exp_f(float x) {
  x = x > -87.0f ? x : -87.0f;  // selects, not fmin/fmax: those do not vectorize with NaN semantics
  x = x < 88.0f ? x : 88.0f;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// out = w * (x * rsqrt(mean(x^2) + eps)), HF's LlamaRMSNorm order, over one row of n.
template <typename In, typename Out>
void rms_row(const In* __restrict__ x, const float* __restrict__ w, float eps, int64_t n, Out* __restrict__ out) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) { const float v = ld(x, i + l); acc[l] += v * v; }
  for (int l = 0; i + l < n; ++l) { const float v = ld(x, i + l); acc[l] += v * v; }
  const float inv = 1.0f / std::sqrt(lane_sum(acc) / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) st(out, j, w[j] * (ld(x, j) * inv));
}

template <typename T> const T* cptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T> T* mptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

bool is_bf16(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32,
              "lean kernels take fp32 or bf16 tensors, got ", t.scalar_type());
  return t.scalar_type() == torch::kBFloat16;
}

torch::Tensor new_rows(const torch::Tensor& ref, int64_t rows, int64_t cols, bool bf16) {
  return torch::empty({rows, cols}, ref.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
}

// f.template operator()<In, Out>() for the dtypes of one input and one output
template <typename F> void dispatch(bool in_bf16, bool out_bf16, F&& f) {
  if (in_bf16) {
    if (out_bf16) f(bf16_t{}, bf16_t{}); else f(bf16_t{}, float{});
  } else {
    if (out_bf16) f(float{}, bf16_t{}); else f(float{}, float{});
  }
}

template <typename Out>
void rms_rows(const float* x, const float* w, float eps, int64_t t, int64_t h, Out* out) {
  for (int64_t r = 0; r < t; ++r) rms_row<float, Out>(x + r * h, w, eps, h, out + r * h);
}

template <typename In, typename Out>
void silu_rows(const In* __restrict__ gp, int64_t t, int64_t n, Out* __restrict__ op) {
  for (int64_t r = 0; r < t; ++r) {
    const In* g = gp + r * 2 * n;
    const In* u = g + n;
    Out* o = op + r * n;
    for (int64_t j = 0; j < n; ++j) {
      const float gv = ld(g, j);
      st(o, j, gv / (1.0f + exp_f(-gv)) * ld(u, j));
    }
  }
}

template <typename In>
void add_rows(float* __restrict__ x, const In* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += ld(y, i);
}

struct AttnArgs {
  int64_t t, nh, nkv, d, cap, start;
  const int64_t* pos;
  const bool* mask;
  const float* q_norm;
  const float* k_norm;
  const float* cos;
  const float* sin;
  float* kt;
  float* vc;
  float eps;
};

// q/k norm, RoPE, K and V into the caches; rotated queries into q [T, nh, d].
template <typename In>
void rope_and_store(const AttnArgs& a, const In* __restrict__ src, float* __restrict__ q, float* __restrict__ tmp) {
  const int64_t d = a.d, half = d / 2, nh = a.nh, nkv = a.nkv, width = (nh + 2 * nkv) * d;
  float* rot = tmp + d;
  for (int64_t i = 0; i < a.t; ++i) {
    const int64_t p = a.pos ? a.pos[i] : a.start + i;
    const float* c = a.cos + p * d;
    const float* s = a.sin + p * d;
    const In* row = src + i * width;
    for (int64_t hd = 0; hd < nh + nkv; ++hd) {
      const bool is_q = hd < nh;
      const float* nw = is_q ? a.q_norm : a.k_norm;
      if (nw != nullptr) rms_row<In, float>(row + hd * d, nw, a.eps, d, tmp);
      else for (int64_t j = 0; j < d; ++j) tmp[j] = ld(row, hd * d + j);
      float* dst = is_q ? q + (i * nh + hd) * d : rot;
      for (int64_t j = 0; j < half; ++j) dst[j] = tmp[j] * c[j] + tmp[j + half] * s[j];
      for (int64_t j = half; j < d; ++j) dst[j] = tmp[j] * c[j] + tmp[j - half] * s[j];
      if (!is_q) {
        float* col = a.kt + (hd - nh) * d * a.cap + a.start + i;
        for (int64_t j = 0; j < d; ++j) col[j * a.cap] = rot[j];
      }
    }
    for (int64_t hv = 0; hv < nkv; ++hv) {
      float* dst = a.vc + (hv * a.cap + a.start + i) * d;
      const In* v = row + (nh + nkv + hv) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = ld(v, j);
    }
  }
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, any alignment; GCC lowers
                                                                  // it to the vector width the CPU has
constexpr int64_t SLOTS = 64;  // slots per register block of the score product (4 x v16)

// q K^T for every row of one query head over slots 0 .. padded(end) - 1, unscaled, into
// s [T, padded(end)]. Every slot's score is computed by the same vector code, one FMA chain over
// c = 0 .. d - 1, in whichever block it falls: a slot's score does not depend on `end` (which grows
// with the rows in the call). The caches' capacity is a multiple of SLOTS (kernels.SLOT_ALIGN), so
// whole blocks stay inside the buffer; slots at or past `end` are never read by a row.
void scores(const AttnArgs& a, const float* __restrict__ q, const float* __restrict__ kb, int64_t padded,
            float* __restrict__ s) {
  const int64_t d = a.d, cap = a.cap, t = a.t, nh = a.nh;
  for (int64_t jb = 0; jb < padded; jb += SLOTS)
    for (int64_t i = 0; i < t; ++i) {
      const float* qv = q + i * nh * d;
      v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
      for (int64_t c = 0; c < d; ++c) {
        const v16 qc = v16{} + qv[c];
        const v16* kr = reinterpret_cast<const v16*>(kb + c * cap + jb);
        a0 += qc * kr[0];
        a1 += qc * kr[1];
        a2 += qc * kr[2];
        a3 += qc * kr[3];
      }
      v16* dst = reinterpret_cast<v16*>(s + i * padded + jb);
      dst[0] = a0;
      dst[1] = a1;
      dst[2] = a2;
      dst[3] = a3;
    }
}

// Row i of one head, from its unscaled scores over the slots: softmax over the slots it sees, in
// slot order, then the weighted sum of their values (two interleaved chains, even and odd keys).
template <typename Out>
void attend_row(const AttnArgs& a, int64_t i, const float* __restrict__ all, const float* __restrict__ vb,
                float* __restrict__ sc, int64_t* __restrict__ keys, float* __restrict__ acc, Out* __restrict__ o) {
  const int64_t d = a.d, start = a.start, t = a.t;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int64_t n = 0;
  if (a.mask) {  // the committed slots, then the new ones this node sees, in slot order
    for (int64_t j = 0; j < start; ++j) keys[n++] = j;
    for (int64_t j = 0; j < t; ++j)
      if (a.mask[i * t + j]) keys[n++] = start + j;
    for (int64_t b = 0; b < n; ++b) sc[b] = all[keys[b]] * scale;
  } else {
    n = start + i + 1;
    for (int64_t j = 0; j < n; ++j) { keys[j] = j; sc[j] = all[j] * scale; }
  }
  const float m = lane_max(sc, n);
  for (int64_t b = 0; b < n; ++b) sc[b] = exp_f(sc[b] - m);
  const float inv = 1.0f / lane_total(sc, n);
  float* acc2 = acc + d;
  int64_t j0 = 0;
  // head_dim in whole 64-float chunks, then 16-float ones, accumulated in registers: two chains
  // (even and odd keys), summed at the end
  for (; j0 + 64 <= d; j0 += 64) {
    v16 e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0}, f0 = {0}, f1 = {0}, f2 = {0}, f3 = {0};
    int64_t b = 0;
    for (; b + 2 <= n; b += 2) {
      const v16 p0 = v16{} + sc[b], p1 = v16{} + sc[b + 1];
      const v16* v0 = reinterpret_cast<const v16*>(vb + keys[b] * d + j0);
      const v16* v1 = reinterpret_cast<const v16*>(vb + keys[b + 1] * d + j0);
      e0 += p0 * v0[0]; e1 += p0 * v0[1]; e2 += p0 * v0[2]; e3 += p0 * v0[3];
      f0 += p1 * v1[0]; f1 += p1 * v1[1]; f2 += p1 * v1[2]; f3 += p1 * v1[3];
    }
    if (b < n) {
      const v16 p0 = v16{} + sc[b];
      const v16* v0 = reinterpret_cast<const v16*>(vb + keys[b] * d + j0);
      e0 += p0 * v0[0]; e1 += p0 * v0[1]; e2 += p0 * v0[2]; e3 += p0 * v0[3];
    }
    v16* dst = reinterpret_cast<v16*>(acc + j0);
    dst[0] = e0 + f0; dst[1] = e1 + f1; dst[2] = e2 + f2; dst[3] = e3 + f3;
  }
  for (; j0 + 16 <= d; j0 += 16) {
    v16 e0 = {0}, f0 = {0};
    int64_t b = 0;
    for (; b + 2 <= n; b += 2) {
      e0 += (v16{} + sc[b]) * *reinterpret_cast<const v16*>(vb + keys[b] * d + j0);
      f0 += (v16{} + sc[b + 1]) * *reinterpret_cast<const v16*>(vb + keys[b + 1] * d + j0);
    }
    if (b < n) e0 += (v16{} + sc[b]) * *reinterpret_cast<const v16*>(vb + keys[b] * d + j0);
    *reinterpret_cast<v16*>(acc + j0) = e0 + f0;
  }
  if (j0 < d) {  // a head_dim that is not a multiple of 16: the rest one float at a time, same chains
    for (int64_t j = j0; j < d; ++j) acc[j] = acc2[j] = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= n; b += 2) {
      const float p0 = sc[b], p1 = sc[b + 1];
      const float* __restrict__ v0 = vb + keys[b] * d;
      const float* __restrict__ v1 = vb + keys[b + 1] * d;
      for (int64_t j = j0; j < d; ++j) { acc[j] += p0 * v0[j]; acc2[j] += p1 * v1[j]; }
    }
    if (b < n)
      for (int64_t j = j0; j < d; ++j) acc[j] += sc[b] * vb[keys[b] * d + j];
    for (int64_t j = j0; j < d; ++j) acc[j] += acc2[j];
  }
  for (int64_t j = 0; j < d; ++j) st(o, j, acc[j] * inv);
}

}  // namespace

// x [T, H] fp32 -> w * rms_norm(x), in bf16 (out_bf16) or fp32.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool out_bf16) {
  NoDenormals no_denormals;
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "lean kernels run on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: fp32 [T, H] contiguous");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == x.size(1), "w: fp32 [H]");
  const int64_t t = x.size(0), h = x.size(1);
  auto out = new_rows(x, t, h, out_bf16);
  if (out_bf16) rms_rows(cptr<float>(x), cptr<float>(w), static_cast<float>(eps), t, h, mptr<bf16_t>(out));
  else rms_rows(cptr<float>(x), cptr<float>(w), static_cast<float>(eps), t, h, mptr<float>(out));
  return out;
}

// x += y in place (y fp32 or bf16), then w * rms_norm(x).
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w, double eps,
                           bool out_bf16) {
  NoDenormals no_denormals;
  TORCH_CHECK(y.device().is_cpu(), "lean kernels run on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: fp32 [T, H] contiguous");
  TORCH_CHECK(y.sizes() == x.sizes() && y.is_contiguous(), "y: [T, H] contiguous, as x");
  if (is_bf16(y)) add_rows(mptr<float>(x), cptr<bf16_t>(y), x.numel());
  else add_rows(mptr<float>(x), cptr<float>(y), x.numel());
  return rms_norm(x, w, eps, out_bf16);
}

// gu [T, 2I] (gate | up) -> silu(gate) * up [T, I], computed in fp32.
torch::Tensor silu_mul(const torch::Tensor& gu, bool out_bf16) {
  NoDenormals no_denormals;
  TORCH_CHECK(gu.device().is_cpu(), "lean kernels run on the CPU");
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "gu: [T, 2I] contiguous");
  const int64_t t = gu.size(0), n = gu.size(1) / 2;
  auto out = new_rows(gu, t, n, out_bf16);
  dispatch(is_bf16(gu), out_bf16, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    silu_rows<In, Out>(cptr<In>(gu), t, n, mptr<Out>(out));
  });
  return out;
}

// One attention block of a decoder layer, after the [q; k; v] product:
//   qkv [T, (nh + 2 nkv) d] (fp32 or bf16) -> per-head RMSNorm of q and k (when weights are given),
//   RoPE at `positions` (or start + i), K/V written to the caches at slots start .. start + T - 1,
//   then softmax(q k^T / sqrt(d)) v for every query head, each row over the keys it sees: slots
//   0 .. start - 1, plus the new slots j <= i (causal) or with mask[i, j] (tree), in slot order.
// kt [nkv, d, cap] holds K transposed (a row's scores are then vector FMAs along the slots, each
// slot's score one fixed chain over d); vc [nkv, cap, d]. cos, sin [n >= every position + 1, d]
// fp32, sin with rotate_half's sign folded in.
// -> [T, nh d] in bf16 (out_bf16) or fp32; query head h reads kv head h / (nh / nkv), as HF's GQA.
torch::Tensor attention(const torch::Tensor& qkv, torch::Tensor& kt, torch::Tensor& vc, const torch::Tensor& cos,
                        const torch::Tensor& sin, int64_t start, int64_t n_heads,
                        const c10::optional<torch::Tensor>& positions, const c10::optional<torch::Tensor>& mask,
                        const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                        double eps, bool out_bf16) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv: [T, (nh + 2 nkv) d] contiguous");
  TORCH_CHECK(kt.dim() == 3 && vc.dim() == 3 && kt.is_contiguous() && vc.is_contiguous() &&
                  kt.scalar_type() == torch::kFloat32 && vc.scalar_type() == torch::kFloat32 &&
                  kt.size(0) == vc.size(0) && kt.size(1) == vc.size(2) && kt.size(2) == vc.size(1),
              "kt: fp32 [nkv, d, cap], vc: fp32 [nkv, cap, d]");
  TORCH_CHECK(qkv.device().is_cpu() && kt.device().is_cpu() && vc.device().is_cpu() && cos.device().is_cpu() &&
                  sin.device().is_cpu(), "lean kernels run on the CPU");
  AttnArgs a{};
  a.t = qkv.size(0), a.nkv = vc.size(0), a.cap = vc.size(1), a.d = vc.size(2), a.nh = n_heads, a.start = start;
  const int64_t t = a.t, nh = a.nh, d = a.d, end = start + t;
  TORCH_CHECK(nh > 0 && a.nkv > 0 && nh % a.nkv == 0 && d > 0 && d % 2 == 0 && qkv.size(1) == (nh + 2 * a.nkv) * d,
              "qkv width / head counts do not match");
  TORCH_CHECK(start >= 0 && end <= a.cap, "cache too small");
  TORCH_CHECK(a.cap % SLOTS == 0, "cache capacity must be a multiple of ", SLOTS);
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos/sin: fp32 [n, d]");
  if (positions.has_value()) {
    TORCH_CHECK(positions->scalar_type() == torch::kInt64 && positions->numel() == t && positions->is_contiguous(),
                "positions: int64 [T]");
    a.pos = positions->data_ptr<int64_t>();
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 2 && mask->size(0) == t && mask->size(1) == t &&
                    mask->is_contiguous(), "mask: bool [T, T]");
    a.mask = mask->data_ptr<bool>();
    for (int64_t i = 0; i < t; ++i) TORCH_CHECK(a.mask[i * t + i], "mask: every row must see itself");
  }
  for (int64_t i = 0; i < t; ++i) {
    const int64_t p = a.pos ? a.pos[i] : start + i;
    TORCH_CHECK(p >= 0 && p < cos.size(0), "position beyond the RoPE table");
  }
  for (const auto* w : {&q_norm, &k_norm})
    if (w->has_value())
      TORCH_CHECK((*w)->scalar_type() == torch::kFloat32 && (*w)->numel() == d && (*w)->is_contiguous(),
                  "q/k norm weight: fp32 [d]");
  a.q_norm = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  a.k_norm = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
  a.kt = kt.data_ptr<float>(), a.vc = vc.data_ptr<float>();
  a.eps = static_cast<float>(eps);

  auto q = torch::empty({t * nh * d + 2 * d}, torch::kFloat32);  // rotated queries [T, nh, d], then scratch
  float* qp = q.data_ptr<float>();
  {  // the serial part's own guard, ended before the pool runs: a pool thread created during the
     // parallel_for copies its creator's MXCSR, and would otherwise keep flush-to-zero for good
    NoDenormals no_denormals;
    if (is_bf16(qkv)) rope_and_store(a, cptr<bf16_t>(qkv), qp, qp + t * nh * d);
    else rope_and_store(a, cptr<float>(qkv), qp, qp + t * nh * d);
  }

  auto out = new_rows(qkv, t, nh * d, out_bf16);
  const int64_t g = nh / a.nkv;
  const int64_t padded = (end + SLOTS - 1) / SLOTS * SLOTS;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, t * end * d));
  at::parallel_for(0, nh, grain, [&](int64_t hb, int64_t he) {  // one query head, all rows, per task
    NoDenormals pool_thread_no_denormals;
    auto scratch = torch::empty({t * padded + end + 2 * d}, torch::kFloat32);  // 64-byte aligned
    auto keys = torch::empty({end}, torch::kInt64);
    float* s = scratch.data_ptr<float>();
    float* sc = s + t * padded;
    float* acc = sc + end;
    for (int64_t h = hb; h < he; ++h) {
      const int64_t hk = h / g;
      scores(a, qp + h * d, a.kt + hk * d * a.cap, padded, s);
      const float* vb = a.vc + hk * a.cap * d;
      for (int64_t i = 0; i < t; ++i) {
        if (out_bf16)
          attend_row(a, i, s + i * padded, vb, sc, keys.data_ptr<int64_t>(), acc, mptr<bf16_t>(out) + (i * nh + h) * d);
        else
          attend_row(a, i, s + i * padded, vb, sc, keys.data_ptr<int64_t>(), acc, mptr<float>(out) + (i * nh + h) * d);
      }
    }
  });
  return out;
}


// ---------------------------------------------------------------------------------------------
// int4 and int8 x bf16 products on AMX (`q4_pack`, `q4_mm`; `q8_pack`, `q8_mm`)
//
// w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q in 0..15, groups g of 32 along K (the form of
// `quant.Int4Weight`, and of torch's int4 kernel). For row m of x (bf16):
//   y[m, n] = sum over g, in order, of  zero[n, g] * sx[m, g]  +  scale[n, g] * C_g[m, n]
// with sx[m, g] the group's sum of x (fp32, 16 lanes then a fixed tree) and C_g = x_g (q_g - 8) one
// AMX tile product (bf16 products are exact in fp32; q - 8 is exact in bf16). Each output row is
// computed from its own x row only, by the same instructions however many rows share the call (the
// tile rows are independent, and a call of more than 16 rows runs 16 at a time), so a verified
// token equals the token decoded alone, as the lean engine needs. Unlike torch's int4 kernel
// (`_weight_int4pack_mm_for_cpu`, one FMA per weight per row) the cost hardly grows with the rows:
// 16 rows cost ~1.8x one (docs/BENCHMARKS.md, session 16).
//
// Packed layout, per block of 16 output columns b and group g: 256 bytes of nibbles, byte
// r * 32 + 2c + e (r < 8, column c, e in {0, 1}) holding q[c, 32g + 2r + e] (low) and
// q[c, 32g + 2(r + 8) + e] (high), so that unpacking gives the B tile's rows (pairs of k, VNNI order)
// directly; then scale and zero as bf16 [16] each (the precision torch's kernel keeps them in).
// Q8 (`q8_pack`: GGUF's Q8_0, w = scale * q, q int8) is the same product without the zero term,
// its B tiles converted from int8 (exact in bf16) and its scales kept in fp32 (Q8_0's fp16 exactly).
constexpr int64_t Q4_BLOCK = 16 * 32 / 2 + 2 * 16 * 2;  // nibbles, then scale and zero in bf16: 320 bytes
constexpr int64_t Q8_BLOCK = 16 * 32 + 16 * 4;          // int8 q, then scale in fp32: 576 bytes

#if DFLASH_AMX
namespace {

struct __attribute__((packed, aligned(64))) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

constexpr int Q4_BATCH = 8;                          // groups whose B tiles are unpacked at once (8 KB)

inline __m512 bf16x16_to_f32(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// one tile product of group (gb + J): A rows of x, the unpacked B tile J, into C (rotating tiles, so
// consecutive groups do not wait on each other), stored for the FMAs
#define DFLASH_Q4_STEP(J, TA, TB, TC)                           \
  if ((J) < nbatch) {                                           \
    _tile_loadd(TA, xrow + (gb + (J)) * 32, k * 2);             \
    _tile_loadd(TB, bbuf + (J) * 512, 64);                      \
    _tile_zero(TC);                                             \
    _tile_dpbf16ps(TC, TA, TB);                                 \
    _tile_stored(TC, cbuf + (J) * 256, 64);                     \
  }

}  // namespace
#endif

bool amx_available() {
#if DFLASH_AMX
  return amx_granted();
#else
  return false;
#endif
}

// q int32 [N, K] in 0..15, scale and zero fp32 [N, K / 32] -> packed uint8 [N / 16, K / 32, 320]
torch::Tensor q4_pack(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt32 && q.is_contiguous(), "q: int32 [N, K] contiguous");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0 && n > 0 && k > 0, "q4_pack: N a multiple of 16, K of 32");
  const int64_t g = k / 32, nb = n / 16;
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == g, "scale, zero: fp32 [N, K / 32] contiguous");
  auto packed = torch::empty({nb, g, Q4_BLOCK}, torch::kUInt8);
  const int32_t* qp = q.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n * k; ++i) TORCH_CHECK(qp[i] >= 0 && qp[i] <= 15, "q: values 0..15");
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t gi = 0; gi < g; ++gi) {
        uint8_t* dst = out + (b * g + gi) * Q4_BLOCK;
        for (int r = 0; r < 8; ++r)
          for (int j = 0; j < 32; ++j) {
            const int64_t row = (b * 16 + j / 2) * k + gi * 32 + (j % 2);
            dst[r * 32 + j] = static_cast<uint8_t>(qp[row + 2 * r] | (qp[row + 2 * (r + 8)] << 4));
          }
        bf16_t* sz = reinterpret_cast<bf16_t*>(dst + 256);
        for (int c = 0; c < 16; ++c) {
          st(sz, c, sp[(b * 16 + c) * g + gi]);
          st(sz, 16 + c, zp[(b * 16 + c) * g + gi]);
        }
      }
  });
  return packed;
}

// The product for both formats: Q8 (int8 q, w = scale * q, `q8_pack`) or Q4 (above).
template <bool Q8>
torch::Tensor quant_mm(const torch::Tensor& x, const torch::Tensor& packed, bool out_bf16) {
  constexpr int64_t record = Q8 ? Q8_BLOCK : Q4_BLOCK;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "lean kernels run on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: bf16 [M, K] contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.size(2) == record && packed.size(1) * 32 == x.size(1),
              "packed: uint8 [N / 16, K / 32, ", record, "] from ", Q8 ? "q8_pack" : "q4_pack", ", K matching x");
#if DFLASH_AMX
  TORCH_CHECK(amx_granted(), "the OS did not grant this process AMX tile state");
  const int64_t m_all = x.size(0), k = x.size(1), nb = packed.size(0), g = packed.size(1), n = nb * 16;
  auto y = new_rows(x, m_all, n, out_bf16);
  if (m_all == 0) return y;
  const bf16_t* xp = cptr<bf16_t>(x);
  torch::Tensor sums;
  if (!Q8) {  // each group's sum of x (the zero term): 16 lanes, then one fixed reduction
    sums = torch::empty({m_all * g}, torch::kFloat32);
    float* sp = sums.data_ptr<float>();
    NoDenormals no_denormals;  // scoped: ends before the parallel_for (see NoDenormals)
    for (int64_t i = 0; i < m_all * g; ++i)
      sp[i] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_to_f32(xp + i * 32), bf16x16_to_f32(xp + i * 32 + 16)));
  }
  const float* sxp = Q8 ? nullptr : sums.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  // Per block of 16 columns: each batch of 8 groups is unpacked once and used for every 16-row
  // chunk of x (a prefill of hundreds of rows unpacks each weight once), the rows' accumulators
  // kept across the batches. A row's instructions do not depend on its chunk or on the others.
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    NoDenormals pool_thread_no_denormals;
    alignas(64) bf16_t bbuf[Q4_BATCH * 512];
    alignas(64) float cbuf[Q4_BATCH * 256];
    alignas(64) bf16_t lut[32];  // bf16 of q - 8 for q = 0..15 (twice: vpermw reads 32 lanes)
    for (int i = 0; i < 32; ++i) st(lut, i, static_cast<float>((i & 15) - 8));
    const __m512i table = _mm512_load_si512(lut);
    const __m512i low4 = _mm512_set1_epi16(0x000F);
    auto acc_t = torch::empty({m_all * 16 + 16}, torch::kFloat32);  // + 16: room to align to 64 bytes
    float* acc = acc_t.data_ptr<float>();
    acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc) + 63) & ~uintptr_t{63});
    // The thread's tile configuration as we found it, restored after: libraries that configure
    // tiles once per thread and keep using them (ggml's AMX kernels, in llama.cpp) would otherwise
    // fault on their next tile instruction after our configuration or release.
    alignas(64) TileConfig caller{};
    _tile_storeconfig(&caller);
    int configured = -1;  // the row count the tiles are configured for
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(acc, acc + m_all * 16, 0.0f);
      for (int64_t gb = 0; gb < g; gb += Q4_BATCH) {
        const int nbatch = static_cast<int>(std::min<int64_t>(Q4_BATCH, g - gb));
        for (int j = 0; j < nbatch; ++j) {  // unpack the batch's B tiles to bf16: q - 8 (Q4) or q (Q8)
          const uint8_t* src = pp + (b * g + gb + j) * record;
          if (b + 1 < b1)  // the same group of the next block, one block (g records) ahead
            for (int l = 0; l < record; l += 64) _mm_prefetch(reinterpret_cast<const char*>(src + g * record + l), _MM_HINT_T0);
          bf16_t* bt = bbuf + j * 512;
          if (Q8) {
            for (int r = 0; r < 16; ++r) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * 32));
              const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
              const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
              _mm512_store_si512(bt + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // exact: |q| <= 128
            }
          } else {
            for (int r = 0; r < 8; ++r) {
              const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * 32)));
              _mm512_store_si512(bt + r * 32, _mm512_permutexvar_epi16(_mm512_and_si512(v, low4), table));
              _mm512_store_si512(bt + (r + 8) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
            }
          }
        }
        for (int64_t m0 = 0; m0 < m_all; m0 += 16) {
          const int mr = static_cast<int>(std::min<int64_t>(16, m_all - m0));
          if (mr != configured) {
            TileConfig cfg{};
            cfg.palette = 1;
            for (int t = 0; t < 6; ++t) { cfg.rows[t] = mr; cfg.colsb[t] = 64; }  // C 0-3 (fp32 [mr, 16]), A 4-5
            for (int t = 6; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  // B 6-7: 16 pairs of k x 16 columns
            _tile_loadconfig(&cfg);
            configured = mr;
          }
          const bf16_t* xrow = xp + m0 * k;
          DFLASH_Q4_STEP(0, 4, 6, 0) DFLASH_Q4_STEP(1, 5, 7, 1) DFLASH_Q4_STEP(2, 4, 6, 2) DFLASH_Q4_STEP(3, 5, 7, 3)
          DFLASH_Q4_STEP(4, 4, 6, 0) DFLASH_Q4_STEP(5, 5, 7, 1) DFLASH_Q4_STEP(6, 4, 6, 2) DFLASH_Q4_STEP(7, 5, 7, 3)
          for (int j = 0; j < nbatch; ++j) {
            const uint8_t* rec = pp + (b * g + gb + j) * record;
            float* am = acc + m0 * 16;
            if (Q8) {
              const __m512 sc = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 512));
              for (int m = 0; m < mr; ++m)
                _mm512_store_ps(am + m * 16, _mm512_fmadd_ps(sc, _mm512_load_ps(cbuf + j * 256 + m * 16),
                                                             _mm512_load_ps(am + m * 16)));
            } else {
              const bf16_t* sz = reinterpret_cast<const bf16_t*>(rec + 256);
              const __m512 sc = bf16x16_to_f32(sz), zr = bf16x16_to_f32(sz + 16);
              for (int m = 0; m < mr; ++m) {
                __m512 a = _mm512_load_ps(am + m * 16);
                a = _mm512_fmadd_ps(zr, _mm512_set1_ps(sxp[(m0 + m) * g + gb + j]), a);
                a = _mm512_fmadd_ps(sc, _mm512_load_ps(cbuf + j * 256 + m * 16), a);
                _mm512_store_ps(am + m * 16, a);
              }
            }
          }
        }
      }
      for (int64_t m = 0; m < m_all; ++m) {
        if (out_bf16)  // round to nearest even, as `st` and torch's .to(bfloat16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(mptr<bf16_t>(y) + m * n + b * 16),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 16)));
        else std::memcpy(mptr<float>(y) + m * n + b * 16, acc + m * 16, 16 * sizeof(float));
      }
    }
    if (caller.palette != 0) _tile_loadconfig(&caller);
    else _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "these kernels were built without AMX (this CPU or compiler lacks AMX-BF16)");
  return x;
#endif
}

// x [M, K] bf16, packed from q4_pack -> x w^T [M, N] in bf16 (out_bf16) or fp32
torch::Tensor q4_mm(const torch::Tensor& x, const torch::Tensor& packed, bool out_bf16) {
  return quant_mm<false>(x, packed, out_bf16);
}

// q int8 [N, K], scale fp32 [N, K / 32] (w = scale * q, GGUF's Q8_0) -> packed uint8 [N / 16, K / 32, 576]:
// per block of 16 columns and group, 512 bytes of q in the B tile's order (byte r * 32 + 2c + e holds
// q[c, 32g + 2r + e]), then the 16 scales in fp32 (Q8_0's fp16 scales are exact in it)
torch::Tensor q8_pack(const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q: int8 [N, K] contiguous");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0 && n > 0 && k > 0, "q8_pack: N a multiple of 16, K of 32");
  const int64_t g = k / 32, nb = n / 16;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n && scale.size(1) == g, "scale: fp32 [N, K / 32] contiguous");
  auto packed = torch::empty({nb, g, Q8_BLOCK}, torch::kUInt8);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t gi = 0; gi < g; ++gi) {
        uint8_t* dst = out + (b * g + gi) * Q8_BLOCK;
        for (int r = 0; r < 16; ++r)
          for (int j = 0; j < 32; ++j)
            dst[r * 32 + j] = static_cast<uint8_t>(qp[(b * 16 + j / 2) * k + gi * 32 + 2 * r + (j % 2)]);
        float* sc = reinterpret_cast<float*>(dst + 512);
        for (int c = 0; c < 16; ++c) sc[c] = sp[(b * 16 + c) * g + gi];
      }
  });
  return packed;
}

// x [M, K] bf16, packed from q8_pack -> x w^T [M, N] in bf16 (out_bf16) or fp32
torch::Tensor q8_mm(const torch::Tensor& x, const torch::Tensor& packed, bool out_bf16) {
  return quant_mm<true>(x, packed, out_bf16);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * rms_norm(x)");
  m.def("add_rms_norm", &add_rms_norm, "x += y in place, then w * rms_norm(x)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attention", &attention, "q/k norm, RoPE, cache write and attention of one layer");
  m.def("amx_available", &amx_available, "built with AMX-BF16 and granted tile state by the OS");
  m.def("q4_pack", &q4_pack, "int4 weight (q, scale, zero) -> the AMX product's packed layout");
  m.def("q4_mm", &q4_mm, "x [M, K] bf16 times a packed int4 weight, on AMX");
  m.def("q8_pack", &q8_pack, "int8 weight in groups of 32 (q, scale) -> the AMX product's packed layout");
  m.def("q8_mm", &q8_mm, "x [M, K] bf16 times a packed int8 weight, on AMX");
}
