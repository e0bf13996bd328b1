// The operations of a decode step other than attention, on CPU, fp32, for the few rows of a step (one per sequence):
// the linear layers' products (skinny_linear), RMSNorm with the residual add before it (rms_norm), rotary embedding
// of q and k in place (rotary_), and SiLU(gate) * up (silu_mul). At 32 rows of SmolLM2 each of the small operations
// is a few microseconds of arithmetic, and their cost in PyTorch is the dispatch of 20-odd kernels per layer; here
// each is one call. decode_block runs a whole block of a decode step (both norms, the products, rotary, attention over
// the cache, SiLU and the residuals) in one call, with the same functions in the same order as the Python path.
//
// skinny_linear: y = x W^T + b, W in nn.Linear's own [out, in] layout (no packed copy, so a weight updated in place
// is used as it is). x [M, K] (rows contiguous), W [N, K] (rows contiguous, any row stride), b [N] or none.
// Returns [M, N].
//
// Each output is a dot product of an x row and a W row. A tile of MR x rows and NR W rows is computed together: per
// 16-float chunk of K, MR + NR vector loads feed MR * NR fused multiply-adds, into MR * NR accumulators of 16 lanes;
// at the end the accumulators are reduced by realhf::reduce16 (csrc/common/lane_sums.h). The NR W rows stay in L1
// while every x tile passes over them, so W is read from memory once; x (a few hundred KB at most) stays in L2.
// Work is split over W row tiles; each output is computed by one thread in a fixed order, so the result does not
// depend on the thread count. With AVX-512 (checked at load time) the tile kernel is the one above; elsewhere a
// portable loop over the same tiles runs (vectorised by the compiler for what it targets).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/lane_sums.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define REALHF_X86 1
#endif

// decode attention's functions, for decode_block (compiled into this module without their own Python module)
#define REALHF_NO_PYBIND_MODULE
#include "../decode_attention/decode_attention.cpp"
#undef REALHF_NO_PYBIND_MODULE

namespace {

constexpr int kNR = 6;  // W rows per tile
constexpr int kMR = 4;  // x rows per tile (at most)
constexpr int kAcc = (kMR * kNR + 15) / 16 * 16;  // accumulators, padded to whole reduction trees

#ifdef REALHF_X86
// MR x rows (MR <= kMR) against kNR W rows over K (a multiple of 16): out[i * kNR + j] = x_i . w_j. ``pf``: ``pf_rows``
// W rows (sw apart) of the next tile, or null; their cache lines are requested into L2 during this tile's loop, so the
// next tile does not wait on memory (W is streamed once; without this the step waits on every tile's first touch).
// skinny_linear spreads the next tile's rows over the passes of its x tiles: requesting the whole tile in the first
// pass fills the core's queue of misses, and that pass waits on it (17% slower on SmolLM2's decode-step products).
template <int MR>
__attribute__((target("avx512f"))) inline void tile_avx512(const float* x, int64_t sx, const float* w, int64_t sw,
                                                          int64_t K, float* out, const float* pf, int pf_rows) {
  __m512 acc[kAcc];
  for (int t = 0; t < kAcc; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    if (pf != nullptr)
      for (int j = 0; j < pf_rows; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * sw + k), _MM_HINT_T1);
    __m512 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(x + i * sx + k);
    for (int j = 0; j < kNR; ++j) {
      const __m512 wv = _mm512_loadu_ps(w + j * sw + k);
      for (int i = 0; i < MR; ++i) acc[i * kNR + j] = _mm512_fmadd_ps(xv[i], wv, acc[i * kNR + j]);
    }
  }
  for (int g = 0; g < kAcc; g += 16) _mm512_storeu_ps(out + g, realhf::reduce16(acc + g));  // rows beyond MR: zeros
}
#endif

// The same tile with plain loops: 16 lanes per dot product and the same tree, so results agree with the AVX-512
// tile to the rounding of its fused multiply-adds.
template <int MR>
inline void tile_portable(const float* x, int64_t sx, const float* w, int64_t sw, int64_t K, float* out) {
  float acc[kMR * kNR][16] = {};
  for (int64_t k = 0; k < K; k += 16)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kNR; ++j)
        for (int l = 0; l < 16; ++l) acc[i * kNR + j][l] += x[i * sx + k + l] * w[j * sw + k + l];
  for (int t = 0; t < kMR * kNR; ++t) out[t] = realhf::sum16(acc[t]);
}

bool cpu_has_avx512() {
#ifdef REALHF_X86
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

template <int MR>
void tile(bool avx512, const float* x, int64_t sx, const float* w, int64_t sw, int64_t K, float* out, const float* pf,
          int pf_rows) {
#ifdef REALHF_X86
  if (avx512) return tile_avx512<MR>(x, sx, w, sw, K, out, pf, pf_rows);
#endif
  (void)pf, (void)pf_rows;
  tile_portable<MR>(x, sx, w, sw, K, out);
}

void tile_any(int mr, bool avx512, const float* x, int64_t sx, const float* w, int64_t sw, int64_t K, float* out,
              const float* pf = nullptr, int pf_rows = 0) {
  switch (mr) {
    case 1: return tile<1>(avx512, x, sx, w, sw, K, out, pf, pf_rows);
    case 2: return tile<2>(avx512, x, sx, w, sw, K, out, pf, pf_rows);
    case 3: return tile<3>(avx512, x, sx, w, sw, K, out, pf, pf_rows);
    default: return tile<4>(avx512, x, sx, w, sw, K, out, pf, pf_rows);
  }
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool allow_avx512) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.stride(1) == 1,
              "skinny_linear: x must be a 2-d float32 CPU tensor with contiguous rows, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.device().is_cpu() && w.stride(1) == 1,
              "skinny_linear: the weight must be a 2-d float32 CPU tensor with contiguous rows, got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "skinny_linear: x has ", K, " columns but the weight has ", w.size(1));
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 &&
                    bias->device().is_cpu() && bias->stride(0) == 1,
                "skinny_linear: the bias must be a contiguous float32 CPU vector of ", N, " values, got ",
                bias->sizes());
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const bool avx512 = allow_avx512 && cpu_has_avx512();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sx = x.stride(0), sw = w.stride(0);
  const int64_t K16 = K / 16 * 16;  // the vector part of K; the tail (K % 16 columns) is added in scalar order
  const int64_t n_tiles = (N + kNR - 1) / kNR;
  at::parallel_for(0, n_tiles, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      // a short last tile (N % kNR) moves back to end at row N and stores only its new columns; with N < kNR the
      // tile's rows are all row j (stride 0), one column at a time
      const int64_t n0 = t * kNR, nr = std::min<int64_t>(kNR, N - n0);
      const int64_t base = nr == kNR ? n0 : std::max<int64_t>(0, N - kNR);
      const float* next = t + 1 < hi && (t + 2) * kNR <= N ? wp + (n0 + kNR) * sw : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m0));
        float out[kAcc];
        if (N >= kNR) {
          // the x tile of rows m0.. requests row m0 / kMR of the next W tile; with fewer than kNR x tiles, the last
          // one requests the rest
          const int64_t xt = m0 / kMR;
          const int pf_rows = xt >= kNR ? 0 : m0 + kMR >= M ? static_cast<int>(kNR - xt) : 1;
          tile_any(mr, avx512, xp + m0 * sx, sx, wp + base * sw, sw, K16, out,
                   next != nullptr && pf_rows > 0 ? next + xt * sw : nullptr, pf_rows);
        } else {
          for (int64_t j = 0; j < N; ++j) {
            float o1[kAcc];
            tile_any(mr, avx512, xp + m0 * sx, sx, wp + j * sw, 0, K16, o1, nullptr);
            for (int i = 0; i < mr; ++i) out[i * kNR + j] = o1[i * kNR];
          }
        }
        for (int i = 0; i < mr; ++i) {
          const float* xr = xp + (m0 + i) * sx;
          for (int64_t n = n0; n < n0 + nr; ++n) {
            const float* wr = wp + n * sw;
            float v = out[i * kNR + (n - base)];
            for (int64_t k = K16; k < K; ++k) v += xr[k] * wr[k];
            if (bp != nullptr) v += bp[n];
            yp[(m0 + i) * N + n] = v;
          }
        }
      }
    }
  });
  return y;
}

namespace {

// 16 lanes and realhf::sum16, as the tiles above: the same sum whatever the thread count
inline float sum_squares(const float* x, int64_t n) {
  float acc[16] = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[k + l] * x[k + l];
  for (int l = 0; k < n; ++k, ++l) acc[l] += x[k] * x[k];
  return realhf::sum16(acc);
}

void check_rows(const torch::Tensor& t, const char* what, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.stride(1) == 1, what,
              ": ", name, " must be a 2-d float32 CPU tensor with contiguous rows, got ", t.sizes(), " ",
              t.scalar_type(), " strides ", t.strides());
}

}  // namespace

// h = w * (x / sqrt(mean(x^2) + eps)) per row of x [T, H] (in that order of operations, as RMSNorm's PyTorch form).
// With ``residual``: x + residual is formed first, and both it and h are returned (the residual stream and its norm
// in one pass). Returns [h] or [h, x + residual].
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual) {
  check_rows(x, "rms_norm", "x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "rms_norm: the weight must be a contiguous float32 vector of ", H, " values, got ", w.sizes());
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    check_rows(*residual, "rms_norm", "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "rms_norm: residual ", residual->sizes(), " and x ", x.sizes(),
                " differ in shape");
  }
  auto h = torch::empty({T, H}, x.options());
  torch::Tensor sum = add ? torch::empty({T, H}, x.options()) : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* rp = add ? residual->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* sp = add ? sum.data_ptr<float>() : nullptr;
  const int64_t sx = x.stride(0), sr = add ? residual->stride(0) : 0;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(H, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* src = xp + t * sx;
      if (add) {
        float* s = sp + t * H;
        const float* r = rp + t * sr;
        for (int64_t i = 0; i < H; ++i) s[i] = src[i] + r[i];
        src = s;
      }
      const float scale = 1.f / std::sqrt(sum_squares(src, H) / static_cast<float>(H) + e);
      float* o = hp + t * H;
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (src[i] * scale);
    }
  });
  if (add) return {h, sum};
  return {h};
}

// In place: x[t, j] = x[t, j] * cos[t, i] + x[t, j +- d/2] * sin_signed[t, i] (rotate-half rotary embedding, sin
// already carrying the sign of the rotated half), for every head of q [T, hq, d] and k [T, hkv, d]; cos and
// sin_signed are [T, d] (any layout whose last dimension is contiguous, e.g. a [T, 1, d] table squeezed).
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin_signed) {
  for (auto* t : {&q, &k}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->stride(2) == 1,
                "rotary_: q and k must be [T, heads, d] float32 CPU tensors with contiguous heads, got ", t->sizes(),
                " strides ", t->strides());
  }
  const int64_t T = q.size(0), d = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == d && d % 2 == 0, "rotary_: q ", q.sizes(), " and k ", k.sizes(),
              " must have the same rows and an even head size");
  check_rows(cos, "rotary_", "cos");
  check_rows(sin_signed, "rotary_", "sin_signed");
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == d && sin_signed.sizes() == cos.sizes(), "rotary_: cos ", cos.sizes(),
              " and sin ", sin_signed.sizes(), " must be [", T, ", ", d, "]");
  const int64_t half = d / 2;
  auto run = [&](torch::Tensor& x, int64_t t) {
    const float* c = cos.data_ptr<float>() + t * cos.stride(0);
    const float* s = sin_signed.data_ptr<float>() + t * sin_signed.stride(0);
    float* base = x.data_ptr<float>() + t * x.stride(0);
    for (int64_t h = 0; h < x.size(1); ++h) {
      float* v = base + h * x.stride(1);
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + b * s[i];  // the rolled vector is [x2, x1]
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  };
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(d * (q.size(1) + k.size(1)), 1)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t t = lo; t < hi; ++t) run(q, t), run(k, t);
                   });
}

namespace {

#ifdef REALHF_X86
// silu(a) * u for 16 lanes: realhf::fast_exp's steps as AVX-512 instructions (the auto-vectorised loop of the
// scalar form measured 10x slower on random inputs: its SSE code path stalled on denormal garbage).
__attribute__((target("avx512f"))) inline __m512 silu_mul16(__m512 a, __m512 u) {
  __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), a);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic);
  const __m512 n = _mm512_sub_ps(t, magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

__attribute__((target("avx512f"))) void silu_mul_row_avx512(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(o + i, m, silu_mul16(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i)));
  }
}
#endif

void silu_mul_row(bool avx512, const float* g, const float* u, float* o, int64_t n) {
#ifdef REALHF_X86
  if (avx512) return silu_mul_row_avx512(g, u, o, n);
#endif
  (void)avx512;
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

}  // namespace

// silu(gate) * up, elementwise, for gate and up [T, I] (rows contiguous; e.g. two halves of one product).
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up, bool allow_avx512) {
  check_rows(gate, "silu_mul", "gate");
  check_rows(up, "silu_mul", "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate ", gate.sizes(), " and up ", up.sizes(), " differ in shape");
  const int64_t T = gate.size(0), I = gate.size(1);
  auto y = torch::empty({T, I}, gate.options());
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = y.data_ptr<float>();
  const int64_t sg = gate.stride(0), su = up.stride(0);
  const bool avx512 = allow_avx512 && cpu_has_avx512();
  // rows split over the threads from 16K values up (a decode step's 32 x 1536 ran on one thread: 0.9 ms a SmolLM2 step
  // against 0.55 ms on two, most of it the divisions)
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) silu_mul_row(avx512, g + t * sg, u + t * su, o + t * I, I);
  });
  return y;
}

bool has_avx512() { return cpu_has_avx512(); }

namespace {

// One row of greedy_sample: the first index of the row's maximum among the allowed tokens (``ban``: 1 = banned, or
// null), and its log-prob under the whole row's softmax. Three passes over the row (in L2): the maximum, the first
// allowed index holding it (a full scan for the maximum of the allowed tokens only where every maximum is banned),
// and the sum of exp(x - max) in 16 lanes.
REALHF_MULTI_TARGET
void greedy_row(const float* __restrict__ x, int64_t V, const uint8_t* __restrict__ ban, int64_t* tok, float* lp) {
  float mx[kLanes];
  for (int l = 0; l < kLanes; ++l) mx[l] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes)
    for (int l = 0; l < kLanes; ++l) mx[l] = x[i + l] > mx[l] ? x[i + l] : mx[l];
  for (; i < V; ++i) mx[0] = x[i] > mx[0] ? x[i] : mx[0];
  float top = mx[0];
  for (int l = 1; l < kLanes; ++l) top = mx[l] > top ? mx[l] : top;
  int64_t best_i = -1;
  for (i = 0; i < V; ++i)
    if (x[i] == top && (ban == nullptr || !ban[i])) {
      best_i = i;
      break;
    }
  float best = top;
  if (best_i < 0) {  // every maximum is banned: the maximum of the allowed tokens (the first of equal ones)
    best = -INFINITY;
    best_i = 0;
    for (i = 0; i < V; ++i)
      if (!ban[i] && x[i] > best) best = x[i], best_i = i;
  }
  float s[kLanes] = {0};
  for (i = 0; i + kLanes <= V; i += kLanes)
    for (int l = 0; l < kLanes; ++l) s[l] += realhf::fast_exp(x[i + l] - top);
  for (int l = 0; i < V; ++i, ++l) s[l] += realhf::fast_exp(x[i] - top);
  *tok = best_i;
  *lp = best - (top + std::log(realhf::sum16(s)));
}

}  // namespace

// Greedy sampling of each row of logits [B, V] (fp32, rows contiguous): the most likely token other than the
// ``banned`` ids (int64 [n]) or the True entries of ``ban`` (bool [V]), the first of equal maxima as an argmax, and
// its log-prob under the unmodified distribution. Returns (tokens int64 [B], log-probs fp32 [B]). Rows run in
// parallel; each row's result comes from one thread, so it does not depend on the thread count.
std::vector<torch::Tensor> greedy_sample(torch::Tensor logits, c10::optional<torch::Tensor> banned,
                                         c10::optional<torch::Tensor> ban) {
  check_rows(logits, "greedy_sample", "logits");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "greedy_sample: logits over an empty vocabulary");
  std::vector<uint8_t> mask;
  if (banned.has_value() && banned->defined() && banned->numel() > 0) {
    TORCH_CHECK(banned->dim() == 1 && banned->scalar_type() == torch::kInt64 && banned->device().is_cpu(),
                "greedy_sample: banned must be a 1-D int64 CPU tensor of token ids");
    mask.assign(static_cast<size_t>(V), 0);
    auto bc = banned->contiguous();
    const int64_t* b = bc.data_ptr<int64_t>();
    for (int64_t j = 0; j < bc.numel(); ++j) {
      TORCH_CHECK(b[j] >= 0 && b[j] < V, "greedy_sample: banned token ", b[j], " outside the vocabulary [0, ", V, ")");
      mask[static_cast<size_t>(b[j])] = 1;
    }
  }
  if (ban.has_value() && ban->defined()) {
    TORCH_CHECK(ban->dim() == 1 && ban->size(0) == V && ban->scalar_type() == torch::kBool && ban->device().is_cpu(),
                "greedy_sample: ban must be a bool CPU mask [", V, "], got ", ban->sizes(), " ", ban->scalar_type());
    if (mask.empty()) mask.assign(static_cast<size_t>(V), 0);
    auto mc = ban->contiguous();
    const bool* m = mc.data_ptr<bool>();
    for (int64_t j = 0; j < V; ++j) mask[static_cast<size_t>(j)] |= m[j] ? 1 : 0;
  }
  auto tok = torch::empty({B}, logits.options().dtype(torch::kInt64));
  auto lp = torch::empty({B}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const int64_t sx = logits.stride(0);
  const uint8_t* mp = mask.empty() ? nullptr : mask.data();
  int64_t* tp = tok.data_ptr<int64_t>();
  float* lpp = lp.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) greedy_row(xp + r * sx, V, mp, tp + r, lpp + r);
  });
  return {tok, lp};
}

using OptT = c10::optional<torch::Tensor>;

// One decode step of a pre-norm block with RMSNorm, rotary embedding and a SiLU-gated MLP (Llama, Qwen2, SmolLM2,
// Mistral), for x [T, H] (one row per cache row):
//   h = rms_norm(x); q, k, v = h Wq^T + bq, ...; rotary(q, k); a = attention over the cache (new k, v written first);
//   s = x + (a Wo^T + bo); h2 = rms_norm(s); returns s + (silu(h2 Wg^T + bg) * (h2 Wu^T + bu)) Wd^T + bd
// The attention is decode_attention over K, V [B, hkv, M, d] at ``lens``; or, with ``pk`` given,
// shared_prefix_decode_attention over the prompts' PK/PV and the rows' own K/V (``lens`` then holds the rows' own
// positions). The same functions run in the same order as realhf's Python decode path, so the result is the same
// to the bit.
torch::Tensor decode_block(torch::Tensor x, torch::Tensor attn_norm_w, double attn_eps, torch::Tensor wq, OptT bq,
                           torch::Tensor wk, OptT bk, torch::Tensor wv, OptT bv, torch::Tensor wo, OptT bo,
                           torch::Tensor mlp_norm_w, double mlp_eps, torch::Tensor wg, OptT bg, torch::Tensor wu, OptT bu,
                           torch::Tensor wd, OptT bd, OptT cos, OptT sin_signed, torch::Tensor K, torch::Tensor V,
                           torch::Tensor lens, double scale, int64_t hq, int64_t hkv, OptT pk, OptT pv, OptT plens,
                           OptT row_order, OptT row_starts) {
  check_rows(x, "decode_block", "x");
  TORCH_CHECK(K.dim() == 4 && hq > 0 && hkv > 0, "decode_block: K must be [B, hkv, positions, d], got ", K.sizes());
  TORCH_CHECK(cos.has_value() == sin_signed.has_value(), "decode_block: give both cos and sin_signed, or neither");
  const int64_t T = x.size(0), d = K.size(3);
  auto h = rms_norm(x, attn_norm_w, attn_eps, c10::nullopt)[0];
  auto q = skinny_linear(h, wq, bq, true).view({T, hq, d});
  auto k = skinny_linear(h, wk, bk, true).view({T, hkv, d});
  auto v = skinny_linear(h, wv, bv, true).view({T, hkv, d});
  if (cos.has_value()) rotary_(q, k, *cos, *sin_signed);
  torch::Tensor a;
  if (pk.has_value()) {
    TORCH_CHECK(pv.has_value() && plens.has_value() && row_order.has_value() && row_starts.has_value(),
                "decode_block: a shared-prefix cache needs pk, pv, plens, row_order and row_starts");
    a = shared_prefix_decode_attention(q, *pk, *pv, *plens, K, V, lens, k, v, *row_order, *row_starts, scale, true);
  } else {
    a = decode_attention(q, K, V, lens, k, v, scale, true);
  }
  auto o = skinny_linear(a.view({T, hq * d}), wo, bo, true);
  auto hs = rms_norm(o, mlp_norm_w, mlp_eps, x);  // h2 = norm(x + o), and x + o
  auto gate = skinny_linear(hs[0], wg, bg, true);
  auto up = skinny_linear(hs[0], wu, bu, true);
  auto y = skinny_linear(silu_mul(gate, up, true), wd, bd, true);
  return y.add_(hs[1]);
}

// The decode step of a stack of such blocks in one call, layer after layer, each layer as decode_block runs it (so
// the result is the same to the bit). It saves the Python-level work and argument conversion of one call per layer
// (about 0.1 ms each). The blocks' parameters are held from construction on: the same tensors as the model's, so a
// weight updated in place, or a parameter given new storage through ``.data``, is what the next step reads. Each step
// passes the caches of every layer (they are replaced as rows come and go).
class DecodeLayers {
 public:
  // ``params``: per layer [attn_norm_w, wq, bq, wk, bk, wv, bv, wo, bo, mlp_norm_w, wg, bg, wu, bu, wd, bd] (biases
  // may be None); ``eps``: per layer [attn_eps, mlp_eps]
  DecodeLayers(std::vector<std::vector<OptT>> params, std::vector<std::vector<double>> eps, double scale, int64_t hq,
               int64_t hkv)
      : params_(std::move(params)), eps_(std::move(eps)), scale_(scale), hq_(hq), hkv_(hkv) {
    TORCH_CHECK(!params_.empty() && params_.size() == eps_.size(), "DecodeLayers: ", params_.size(),
                " layers of parameters and ", eps_.size(), " of eps; give one entry per layer, at least one");
    for (size_t l = 0; l < params_.size(); ++l) {
      TORCH_CHECK(params_[l].size() == 16 && eps_[l].size() == 2, "DecodeLayers: layer ", l,
                  " needs 16 parameters and 2 eps, got ", params_[l].size(), " and ", eps_[l].size());
      for (int i : {0, 1, 3, 5, 7, 9, 10, 12, 14})
        TORCH_CHECK(params_[l][i].has_value() && params_[l][i]->defined(), "DecodeLayers: layer ", l,
                    " lacks parameter ", i, " (only biases may be None)");
    }
  }

  torch::Tensor run(torch::Tensor x, OptT cos, OptT sin_signed, const std::vector<torch::Tensor>& K,
                    const std::vector<torch::Tensor>& V, torch::Tensor lens,
                    c10::optional<std::vector<torch::Tensor>> pk, c10::optional<std::vector<torch::Tensor>> pv,
                    OptT plens, OptT row_order, OptT row_starts) const {
    const size_t n = params_.size();
    TORCH_CHECK(K.size() == n && V.size() == n, "DecodeLayers.run: ", n, " layers but caches of ", K.size(), " and ",
                V.size());
    TORCH_CHECK(pk.has_value() == pv.has_value() && (!pk.has_value() || (pk->size() == n && pv->size() == n)),
                "DecodeLayers.run: give the prompts' keys and values of every layer, or neither");
    for (size_t l = 0; l < n; ++l) {
      const auto& p = params_[l];
      x = decode_block(x, *p[0], eps_[l][0], *p[1], p[2], *p[3], p[4], *p[5], p[6], *p[7], p[8], *p[9], eps_[l][1],
                       *p[10], p[11], *p[12], p[13], *p[14], p[15], cos, sin_signed, K[l], V[l], lens, scale_, hq_,
                       hkv_, pk.has_value() ? OptT((*pk)[l]) : OptT(), pv.has_value() ? OptT((*pv)[l]) : OptT(),
                       plens, row_order, row_starts);
    }
    return x;
  }

  int64_t n_layers() const { return static_cast<int64_t>(params_.size()); }

 private:
  std::vector<std::vector<OptT>> params_;
  std::vector<std::vector<double>> eps_;
  double scale_;
  int64_t hq_, hkv_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x W^T + b for a few rows of x (fp32, CPU)", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none(), py::arg("allow_avx512") = true);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, with an optional residual added first", py::arg("x"),
        py::arg("w"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rotary_", &rotary_, "rotate-half rotary embedding of q and k, in place", py::arg("q"), py::arg("k"),
        py::arg("cos"), py::arg("sin_signed"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::arg("gate"), py::arg("up"), py::arg("allow_avx512") = true);
  m.def("has_avx512", &has_avx512, "whether this CPU runs the AVX-512 tile");
  m.def("greedy_sample", &greedy_sample, "greedy token and its log-prob for each row of fp32 logits",
        py::arg("logits"), py::arg("banned") = py::none(), py::arg("ban") = py::none());
  m.def("decode_block", &decode_block, "one decode step of a RMSNorm / rotary / SiLU-gated block, in one call",
        py::arg("x"), py::arg("attn_norm_w"), py::arg("attn_eps"), py::arg("wq"), py::arg("bq"), py::arg("wk"),
        py::arg("bk"), py::arg("wv"), py::arg("bv"), py::arg("wo"), py::arg("bo"), py::arg("mlp_norm_w"),
        py::arg("mlp_eps"), py::arg("wg"), py::arg("bg"), py::arg("wu"), py::arg("bu"), py::arg("wd"), py::arg("bd"),
        py::arg("cos"), py::arg("sin_signed"), py::arg("K"), py::arg("V"), py::arg("lens"), py::arg("scale"),
        py::arg("hq"), py::arg("hkv"), py::arg("pk") = py::none(), py::arg("pv") = py::none(),
        py::arg("plens") = py::none(), py::arg("row_order") = py::none(), py::arg("row_starts") = py::none());
  py::class_<DecodeLayers>(m, "DecodeLayers", "a stack of decode_block layers run in one call per step")
      .def(py::init<std::vector<std::vector<OptT>>, std::vector<std::vector<double>>, double, int64_t, int64_t>(),
           py::arg("params"), py::arg("eps"), py::arg("scale"), py::arg("hq"), py::arg("hkv"))
      .def("run", &DecodeLayers::run, py::arg("x"), py::arg("cos"), py::arg("sin_signed"), py::arg("K"), py::arg("V"),
           py::arg("lens"), py::arg("pk") = py::none(), py::arg("pv") = py::none(), py::arg("plens") = py::none(),
           py::arg("row_order") = py::none(), py::arg("row_starts") = py::none())
      .def_property_readonly("n_layers", &DecodeLayers::n_layers);
}
