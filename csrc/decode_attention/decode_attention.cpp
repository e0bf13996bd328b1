// One decode step of attention over a KV cache, on CPU, fp32 queries over an fp32 or fp16 cache: every row's new
// key/value is written at its length (rounded to fp16 in an fp16 cache), then its query heads attend to positions
// 0..lens[b] (inclusive) of the cache. An fp16 cache halves the bytes a step reads, which is what attention over a
// long cache spends its time on; the arithmetic stays fp32 (each fp16 key/value is widened as it is loaded).
//
// q [B, hq, d]; K, V [B, hkv, M, d] (any strides, the last dimension contiguous); lens [B] int64 (each < M);
// k_new, v_new [B, hkv, d]; hq a multiple of hkv (grouped-query attention: query heads j*g .. j*g+g-1 share kv
// head j). Returns [B, hq, d].
//
// The work is split over (row, kv head) pairs; each pair reads its keys and values once for all g query heads that
// share them, and only the row's own positions (a short row in a batch of long ones reads only its own length).
// Dot products accumulate in 16 independent lanes (the compiler vectorises them without reordering a sum), so the
// result does not depend on the thread count. On x86-64 with GCC the inner function is compiled for AVX-512, AVX2
// and a baseline, chosen at load time by the CPU (one binary serves a cluster of mixed machines).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/fast_exp.h"
#include "../common/lane_sums.h"

namespace {

constexpr int kLanes = 16;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define REALHF_MULTI_TARGET __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define REALHF_MULTI_TARGET
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define REALHF_AVX512 1

// 16 cached values as fp32: loaded, or fp16 widened
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Requests the cache lines of positions [t0, t1) (rows st elements apart, d elements each) ahead of their use. A
// 16-position block of fp32 keys with d = 64 is a whole 4 KiB page, and the hardware prefetchers stop at pages, so
// without this every block starts with a wait on memory.
template <typename T>
__attribute__((target("avx512f"))) inline void prefetch_rows(const T* X, int64_t st, int64_t t0, int64_t t1, int d) {
  const int64_t bytes = static_cast<int64_t>(d) * sizeof(T);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(X + t * st) + o, _MM_HINT_T0);
}

// The scores of 16 consecutive positions for one query, d a multiple of 16: one accumulator per position over the d
// chunks, then the 16 accumulators reduced into one vector (lane t = position t) by realhf::reduce16_inline. Always
// inlined, and its reduction too, so the accumulators stay in registers (GCC had kept them in a stack array it zeroed
// with ``rep stos`` at each call).
template <typename T>
__attribute__((target("avx512f"), always_inline)) inline __m512 scores16_avx512(const float* q, const T* K, int64_t st, int d) {
  __m512 a[16];
  for (int p = 0; p < 16; ++p) a[p] = _mm512_setzero_ps();
  for (int i = 0; i < d; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int p = 0; p < 16; ++p) a[p] = _mm512_fmadd_ps(qv, load16(K + p * st + i), a[p]);
  }
  return realhf::reduce16_inline(a);
}

// the scores (times scale) of the whole blocks of 16 positions, for each of g queries (query j's scores at s + j * ld),
// block by block (a block's keys come from memory once for the g queries; the next block's are requested meanwhile);
// returns the positions done
template <typename T>
__attribute__((target("avx512f"))) int64_t scores_avx512(const float* q, int g, const T* K, int64_t st, int64_t L,
                                                         int d, float scale, float* s, int64_t ld) {
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t whole = L - L % 16;
  for (int64_t t = 0; t < whole; t += 16) {
    prefetch_rows(K, st, t + 16, std::min<int64_t>(t + 32, L), d);
    for (int j = 0; j < g; ++j)
      _mm512_storeu_ps(s + j * ld + t, _mm512_mul_ps(scores16_avx512(q + j * d, K + t * st, st, d), sc));
  }
  return whole;
}

// out[j] for G heads of N * 16 floats at once (G * N <= 24 accumulators in registers): each value row is loaded once for
// the G heads, and the G * N independent sums keep both FMA ports busy (one head's N sums wait on the FMA latency)
template <int G, int N, typename T>
__attribute__((target("avx512f"))) void weighted_values_heads(const float* p, int64_t ld, const T* V, int64_t st,
                                                              int64_t L, float* out, bool accumulate) {
  constexpr int d = 16 * N;
  constexpr int64_t ahead = 2048 / (d * sizeof(T));  // about 2 KiB of values ahead (at least 4 rows: d <= 128)
  __m512 acc[G][N];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < N; ++c) acc[j][c] = accumulate ? _mm512_loadu_ps(out + j * d + 16 * c) : _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    if (t + ahead < L) prefetch_rows(V, st, t + ahead, t + ahead + 1, d);
    const T* vt = V + t * st;
    __m512 v[N];
    for (int c = 0; c < N; ++c) v[c] = load16(vt + 16 * c);
    for (int j = 0; j < G; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * ld + t]);
      for (int c = 0; c < N; ++c) acc[j][c] = _mm512_fmadd_ps(w, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(out + j * d + 16 * c, acc[j][c]);
}

// out[j] (g heads of d floats, d a multiple of 16, at most 128) (+)= sum over t < L of p[j * ld + t] V[t], one head
// after another, the d floats of a head held in registers; the first head's pass requests values a few positions
// ahead (the heads weighted_values_heads does not take)
template <typename T>
__attribute__((target("avx512f"))) void weighted_values_avx512_each(const float* p, int64_t ld, int g, const T* V,
                                                               int64_t st, int64_t L, int d, float* out,
                                                               bool accumulate) {
  const int n = d / 16;
  constexpr int64_t ahead = 2048 / (64 * sizeof(T));  // about 2 KiB of values ahead (d = 64)
  for (int j = 0; j < g; ++j) {
    __m512 acc[8];
    for (int c = 0; c < n; ++c) acc[c] = accumulate ? _mm512_loadu_ps(out + j * d + 16 * c) : _mm512_setzero_ps();
    const float* pj = p + j * ld;
    for (int64_t t = 0; t < L; ++t) {
      if (j == 0 && t + ahead < L) prefetch_rows(V, st, t + ahead, t + ahead + 1, d);
      const __m512 w = _mm512_set1_ps(pj[t]);
      const T* vt = V + t * st;
      for (int c = 0; c < n; ++c) acc[c] = _mm512_fmadd_ps(w, load16(vt + 16 * c), acc[c]);
    }
    for (int c = 0; c < n; ++c) _mm512_storeu_ps(out + j * d + 16 * c, acc[c]);
  }
}

// out[j] (g heads of d floats) (+)= sum over t < L of p[j * ld + t] V[t]: at d = 64 and 128 the heads in groups the
// registers hold (weighted_values_heads), the rest one by one; each output's sum runs in the same order either way
template <typename T>
__attribute__((target("avx512f"))) void weighted_values_avx512(const float* p, int64_t ld, int g, const T* V,
                                                               int64_t st, int64_t L, int d, float* out,
                                                               bool accumulate) {
  int j = 0;
  if (d == 64) {
    for (; j + 6 <= g; j += 6) weighted_values_heads<6, 4>(p + j * ld, ld, V, st, L, out + j * d, accumulate);
    for (; j + 3 <= g; j += 3) weighted_values_heads<3, 4>(p + j * ld, ld, V, st, L, out + j * d, accumulate);
    for (; j + 2 <= g; j += 2) weighted_values_heads<2, 4>(p + j * ld, ld, V, st, L, out + j * d, accumulate);
  } else if (d == 128) {
    for (; j + 3 <= g; j += 3) weighted_values_heads<3, 8>(p + j * ld, ld, V, st, L, out + j * d, accumulate);
    for (; j + 2 <= g; j += 2) weighted_values_heads<2, 8>(p + j * ld, ld, V, st, L, out + j * d, accumulate);
  }
  if (j < g) weighted_values_avx512_each(p + j * ld, ld, g - j, V, st, L, d, out + j * d, accumulate);
}
#endif

// the dot product of d floats, in 16 lanes summed by sum16
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int d) {
  float acc[kLanes] = {0};
  int i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float sum = realhf::sum16(acc);
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// s[j * ld + t] = scale * q[j] . K[t] (t < L) for the g query heads of one (row, kv head)
REALHF_MULTI_TARGET
void scores(const float* __restrict__ q, int g, const float* __restrict__ K, int64_t st, int64_t L, int d, float scale,
            float* __restrict__ s, int64_t ld, bool avx512) {
  int64_t t0 = 0;
#ifdef REALHF_AVX512
  if (avx512) t0 = scores_avx512(q, g, K, st, L, d, scale, s, ld);
#endif
  for (int64_t t = t0; t < L; ++t)
    for (int j = 0; j < g; ++j) s[j * ld + t] = dot(q + j * d, K + t * st, d) * scale;
}

// each of the g rows of s (L scores, rows ld apart) becomes its softmax
REALHF_MULTI_TARGET
void softmax_rows(float* __restrict__ s, int g, int64_t L, int64_t ld) {
  for (int j = 0; j < g; ++j) {
    float* sj = s + j * ld;
    float mx[kLanes], zs[kLanes];
    for (int l = 0; l < kLanes; ++l) mx[l] = -INFINITY, zs[l] = 0.f;
    int64_t t0 = 0;
    for (; t0 + kLanes <= L; t0 += kLanes)
      for (int l = 0; l < kLanes; ++l) mx[l] = sj[t0 + l] > mx[l] ? sj[t0 + l] : mx[l];
    for (int64_t t = t0; t < L; ++t) mx[t - t0] = sj[t] > mx[t - t0] ? sj[t] : mx[t - t0];
    float m = mx[0];
    for (int l = 1; l < kLanes; ++l) m = mx[l] > m ? mx[l] : m;
    for (int64_t t = 0; t < L; ++t) sj[t] = realhf::fast_exp(sj[t] - m);
    for (t0 = 0; t0 + kLanes <= L; t0 += kLanes)
      for (int l = 0; l < kLanes; ++l) zs[l] += sj[t0 + l];
    for (int64_t t = t0; t < L; ++t) zs[t - t0] += sj[t];
    const float inv = 1.f / realhf::sum16(zs);
    for (int64_t t = 0; t < L; ++t) sj[t] *= inv;
  }
}

// out[j] (+)= sum over t < L of p[j * ld + t] V[t], in plain loops (fp16 values widened as they are read)
template <typename T>
inline void weighted_values_loop(const float* __restrict__ p, int64_t ld, int g, const T* __restrict__ V, int64_t st,
                                 int64_t L, int d, float* __restrict__ out, bool accumulate) {
  if (!accumulate)
    for (int j = 0; j < g * d; ++j) out[j] = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    const T* vt = V + t * st;
    for (int j = 0; j < g; ++j) {
      const float w = p[j * ld + t];
      float* oj = out + j * d;
      for (int i = 0; i < d; ++i) oj[i] += w * static_cast<float>(vt[i]);
    }
  }
}

// out[j] (+)= sum over t < L of p[j * ld + t] V[t]
REALHF_MULTI_TARGET
void weighted_values(const float* __restrict__ p, int64_t ld, int g, const float* __restrict__ V, int64_t st,
                     int64_t L, int d, float* __restrict__ out, bool accumulate, bool avx512) {
#ifdef REALHF_AVX512
  if (avx512) return weighted_values_avx512(p, ld, g, V, st, L, d, out, accumulate);
#endif
  weighted_values_loop(p, ld, g, V, st, L, d, out, accumulate);
}

// scores and weighted_values over an fp16 cache: the AVX-512 kernels, else plain loops widening each value (the same
// 16-lane sums as the fp32 loops)
void scores(const float* q, int g, const at::Half* K, int64_t st, int64_t L, int d, float scale, float* s, int64_t ld,
            bool avx512) {
  int64_t t0 = 0;
#ifdef REALHF_AVX512
  if (avx512) t0 = scores_avx512(q, g, K, st, L, d, scale, s, ld);
#endif
  std::vector<float> kt(static_cast<size_t>(d));
  for (int64_t t = t0; t < L; ++t) {
    for (int i = 0; i < d; ++i) kt[i] = static_cast<float>(K[t * st + i]);
    for (int j = 0; j < g; ++j) s[j * ld + t] = dot(q + j * d, kt.data(), d) * scale;
  }
}

void weighted_values(const float* p, int64_t ld, int g, const at::Half* V, int64_t st, int64_t L, int d, float* out,
                     bool accumulate, bool avx512) {
#ifdef REALHF_AVX512
  if (avx512) return weighted_values_avx512(p, ld, g, V, st, L, d, out, accumulate);
#endif
  weighted_values_loop(p, ld, g, V, st, L, d, out, accumulate);
}

// a new key or value into the cache: copied, or rounded to fp16
inline void store_row(const float* src, float* dst, int64_t d) { std::copy(src, src + d, dst); }
inline void store_row(const float* src, at::Half* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = at::Half(src[i]);
}

// whether this CPU runs the AVX-512 paths (head sizes that are multiples of 16, up to 128)
bool use_avx512(int64_t d) {
#ifdef REALHF_AVX512
  static const bool cpu = __builtin_cpu_supports("avx512f");
  return cpu && d % 16 == 0 && d <= 128;
#else
  return false;
#endif
}

// ``fn``: the calling function's name, which starts every message
void check_cache(const char* fn, const torch::Tensor& X, const char* name, int64_t B, int64_t d) {
  TORCH_CHECK(X.dim() == 4 && X.size(0) == B && X.size(3) == d, fn, ": ", name, " must be [", B, ", hkv, positions, ",
              d, "], got ", X.sizes());
  TORCH_CHECK((X.scalar_type() == torch::kFloat32 || X.scalar_type() == torch::kHalf) && X.device().is_cpu(), fn,
              ": ", name, " must be a float32 or float16 CPU tensor, got ", X.scalar_type());
  TORCH_CHECK(X.stride(3) == 1, fn, ": the last dimension of ", name, " must be contiguous");
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor K, torch::Tensor V, torch::Tensor lens,
                               torch::Tensor k_new, torch::Tensor v_new, double scale, bool allow_avx512) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu(),
              "decode_attention: q must be a float32 CPU tensor [B, hq, d], got ", q.sizes(), " ", q.scalar_type());
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2);
  check_cache("decode_attention", K, "K", B, d);
  check_cache("decode_attention", V, "V", B, d);
  TORCH_CHECK(V.sizes() == K.sizes() && V.strides() == K.strides() && V.scalar_type() == K.scalar_type(),
              "decode_attention: K and V must have the same shape, strides and dtype, got ", K.sizes(), K.strides(),
              " ", K.scalar_type(), " and ", V.sizes(), V.strides(), " ", V.scalar_type());
  const int64_t hkv = K.size(1), M = K.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "decode_attention: ", hq, " query heads do not divide into ", hkv,
              " kv heads");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == torch::kInt64 && lens.device().is_cpu(),
              "decode_attention: lens must be an int64 CPU tensor [B]");
  for (const auto* x : {&k_new, &v_new})
    TORCH_CHECK(x->sizes() == torch::IntArrayRef({B, hkv, d}) && x->scalar_type() == torch::kFloat32,
                "decode_attention: the new keys/values must be float32 [B, hkv, d] = [", B, ", ", hkv, ", ", d,
                "], got ", x->sizes());
  auto lc = lens.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] < M, "decode_attention: row ", b, " writes position ", lp[b],
                " outside the cache of ", M, " positions");
  auto qc = q.contiguous(), kc = k_new.contiguous(), vc = v_new.contiguous();
  auto out = torch::empty({B, hq, d}, q.options());
  const float *qp = qc.data_ptr<float>(), *knp = kc.data_ptr<float>(), *vnp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = K.stride(0), sh = K.stride(1), st = K.stride(2);
  const int g = static_cast<int>(hq / hkv);
  const bool avx512 = allow_avx512 && use_avx512(d);
  auto run = [&](auto* Kp, auto* Vp) {  // float or at::Half keys/values
    at::parallel_for(0, B * hkv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> s;
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t b = w / hkv, h = w % hkv, L = lp[b] + 1;
        auto* Kbh = Kp + b * sb + h * sh;
        auto* Vbh = Vp + b * sb + h * sh;
        store_row(knp + w * d, Kbh + lp[b] * st, d);
        store_row(vnp + w * d, Vbh + lp[b] * st, d);
        s.resize(static_cast<size_t>(g * L));
        scores(qp + w * g * d, g, Kbh, st, L, static_cast<int>(d), static_cast<float>(scale), s.data(), L, avx512);
        softmax_rows(s.data(), g, L, L);
        weighted_values(s.data(), L, g, Vbh, st, L, static_cast<int>(d), op + w * g * d, false, avx512);
      }
    });
  };
  if (K.scalar_type() == torch::kHalf)
    run(K.data_ptr<at::Half>(), V.data_ptr<at::Half>());
  else
    run(K.data_ptr<float>(), V.data_ptr<float>());
  return out;
}

// The decode step of a cache whose rows share their prompt's keys/values (realhf's SharedPrefixCache): row b attends
// to the first plens[p] positions of its prompt p's PK/PV [P, hkv, Lp, d] and to its own positions 0..own[b] of K/V
// [B, hkv, Mo, d] (its new key/value written at own[b] first), under one softmax. row_order lists the rows prompt by
// prompt, row_starts [P + 1] where each prompt's rows begin in it. The work is split over (prompt, kv head) pairs and
// the rows of a prompt run one after another on one thread, so a prompt's keys/values come from memory once and
// from the core's cache for its other rows.
torch::Tensor shared_prefix_decode_attention(torch::Tensor q, torch::Tensor PK, torch::Tensor PV, torch::Tensor plens,
                                             torch::Tensor K, torch::Tensor V, torch::Tensor own, torch::Tensor k_new,
                                             torch::Tensor v_new, torch::Tensor row_order, torch::Tensor row_starts,
                                             double scale, bool allow_avx512) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu(),
              "shared_prefix_decode_attention: q must be a float32 CPU tensor [B, hq, d], got ", q.sizes());
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2), P = PK.size(0);
  check_cache("shared_prefix_decode_attention", PK, "PK", P, d);
  check_cache("shared_prefix_decode_attention", PV, "PV", P, d);
  check_cache("shared_prefix_decode_attention", K, "K", B, d);
  check_cache("shared_prefix_decode_attention", V, "V", B, d);
  TORCH_CHECK(PV.sizes() == PK.sizes() && PV.strides() == PK.strides() && V.sizes() == K.sizes() &&
              V.strides() == K.strides() && PK.size(1) == K.size(1) && PK.scalar_type() == K.scalar_type() &&
              PV.scalar_type() == K.scalar_type() && V.scalar_type() == K.scalar_type(),
              "shared_prefix_decode_attention: PK/PV and K/V must match in shape, strides and dtype, with the same kv "
              "heads");
  const int64_t hkv = K.size(1), Lp = PK.size(2), Mo = K.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "shared_prefix_decode_attention: ", hq, " query heads do not divide into ",
              hkv, " kv heads");
  for (const auto* x : {&plens, &own, &row_order, &row_starts})
    TORCH_CHECK(x->dim() == 1 && x->scalar_type() == torch::kInt64 && x->device().is_cpu(),
                "shared_prefix_decode_attention: plens, own, row_order and row_starts must be 1-D int64 CPU tensors");
  TORCH_CHECK(plens.size(0) == P && own.size(0) == B && row_order.size(0) == B && row_starts.size(0) == P + 1,
              "shared_prefix_decode_attention: expected plens [", P, "], own [", B, "], row_order [", B,
              "], row_starts [", P + 1, "]");
  for (const auto* x : {&k_new, &v_new})
    TORCH_CHECK(x->sizes() == torch::IntArrayRef({B, hkv, d}) && x->scalar_type() == torch::kFloat32,
                "shared_prefix_decode_attention: the new keys/values must be float32 [", B, ", ", hkv, ", ", d,
                "], got ", x->sizes());
  auto plc = plens.contiguous(), owc = own.contiguous(), orc = row_order.contiguous(), stc = row_starts.contiguous();
  const int64_t *pl = plc.data_ptr<int64_t>(), *ow = owc.data_ptr<int64_t>(), *order = orc.data_ptr<int64_t>(),
                *starts = stc.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[P] == B, "shared_prefix_decode_attention: row_starts must run from 0 to ", B);
  std::vector<char> seen(static_cast<size_t>(B), 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(starts[p] <= starts[p + 1], "shared_prefix_decode_attention: row_starts must not decrease");
    TORCH_CHECK(pl[p] >= 0 && pl[p] <= Lp, "shared_prefix_decode_attention: prompt ", p, " has ", pl[p],
                " positions, the prompt cache ", Lp);
  }
  for (int64_t i = 0; i < B; ++i) {
    const int64_t b = order[i];
    TORCH_CHECK(b >= 0 && b < B && !seen[b], "shared_prefix_decode_attention: row_order must list each of the ", B,
                " rows once");
    seen[b] = 1;
    TORCH_CHECK(ow[b] >= 0 && ow[b] < Mo, "shared_prefix_decode_attention: row ", b, " writes position ", ow[b],
                " outside its own cache of ", Mo, " positions");
  }
  auto qc = q.contiguous(), kc = k_new.contiguous(), vc = v_new.contiguous();
  auto out = torch::empty({B, hq, d}, q.options());
  const float *qp = qc.data_ptr<float>(), *knp = kc.data_ptr<float>(), *vnp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t psb = PK.stride(0), psh = PK.stride(1), pst = PK.stride(2);
  const int64_t sb = K.stride(0), sh = K.stride(1), st = K.stride(2);
  const int g = static_cast<int>(hq / hkv), di = static_cast<int>(d);
  const float sc = static_cast<float>(scale);
  const bool avx512 = allow_avx512 && use_avx512(d);
  auto run = [&](auto* PKp, auto* PVp, auto* Kp, auto* Vp) {  // float or at::Half keys/values
    at::parallel_for(0, P * hkv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> s;
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t p = w / hkv, h = w % hkv, Lpp = pl[p];
        const auto* PKh = PKp + p * psb + h * psh;
        const auto* PVh = PVp + p * psb + h * psh;
        for (int64_t i = starts[p]; i < starts[p + 1]; ++i) {
          const int64_t b = order[i], Lo = ow[b] + 1, Lt = Lpp + Lo, r = b * hkv + h;
          auto* Kh = Kp + b * sb + h * sh;
          auto* Vh = Vp + b * sb + h * sh;
          store_row(knp + r * d, Kh + ow[b] * st, d);
          store_row(vnp + r * d, Vh + ow[b] * st, d);
          s.resize(static_cast<size_t>(g * Lt));
          const float* qb = qp + r * g * d;
          float* ob = op + r * g * d;
          scores(qb, g, PKh, pst, Lpp, di, sc, s.data(), Lt, avx512);
          scores(qb, g, Kh, st, Lo, di, sc, s.data() + Lpp, Lt, avx512);
          softmax_rows(s.data(), g, Lt, Lt);
          weighted_values(s.data(), Lt, g, PVh, pst, Lpp, di, ob, false, avx512);
          weighted_values(s.data() + Lpp, Lt, g, Vh, st, Lo, di, ob, true, avx512);
        }
      }
    });
  };
  if (K.scalar_type() == torch::kHalf)
    run(PK.data_ptr<at::Half>(), PV.data_ptr<at::Half>(), K.data_ptr<at::Half>(), V.data_ptr<at::Half>());
  else
    run(PK.data_ptr<float>(), PV.data_ptr<float>(), K.data_ptr<float>(), V.data_ptr<float>());
  return out;
}

#ifndef REALHF_NO_PYBIND_MODULE  // defined where another module compiles this file into itself (decode_ops.cpp)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "one decode step of grouped-query attention over a KV cache (fp32 queries, fp32 or fp16 cache, CPU); writes "
        "the new keys/values first (allow_avx512=False: the portable path, for tests)",
        pybind11::arg("q"), pybind11::arg("K"), pybind11::arg("V"), pybind11::arg("lens"), pybind11::arg("k_new"),
        pybind11::arg("v_new"), pybind11::arg("scale"), pybind11::arg("allow_avx512") = true);
  m.def("shared_prefix_decode_attention", &shared_prefix_decode_attention,
        "one decode step over prompts' shared keys/values and each row's own (fp32 queries, fp32 or fp16 cache, CPU); "
        "writes the new keys/values first",
        pybind11::arg("q"), pybind11::arg("PK"), pybind11::arg("PV"), pybind11::arg("plens"), pybind11::arg("K"),
        pybind11::arg("V"), pybind11::arg("own"), pybind11::arg("k_new"), pybind11::arg("v_new"),
        pybind11::arg("row_order"), pybind11::arg("row_starts"), pybind11::arg("scale"),
        pybind11::arg("allow_avx512") = true);
}
#endif
