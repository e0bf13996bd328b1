// The sum of 16 partial sums (lanes) in one fixed tree, shared by the C++ kernels: (8 + 8, 4 + 4, 2 + 2, 1 + 1), as
// vector shuffles and adds where a running sum would be 16 dependent scalar additions. Every kernel that reduces
// lanes uses this one order, so its results do not depend on how the work is split over threads.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace realhf {

// the sum of a[0..15]
inline float sum16(const float* a) {
  float b[8], c[4];
  for (int l = 0; l < 8; ++l) b[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) c[l] = b[l] + b[l + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

#if defined(__x86_64__) && defined(__GNUC__)
// The 16 lane-sums of the vectors a[0..15] as one vector (lane t = the sum of a[t]'s lanes), by in-lane and
// cross-lane shuffles, so no sum goes through a scalar. Always inlined, for callers whose accumulators must stay in
// registers: as a call it takes them as an array in memory, which decode attention's scores spilled and zeroed with
// ``rep stos`` for every 16 positions (28% of their time on SmolLM2, by perf).
__attribute__((target("avx512f"), always_inline)) inline __m512 reduce16_inline(const __m512* a) {
  __m512 b[8], c[4];
  for (int k = 0; k < 8; ++k)  // [p0 + p2, q0 + q2, p1 + p3, q1 + q3] in each 128-bit block
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // each 128-bit block: the block's sums of vectors 4k .. 4k+3
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44), _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// The same sums, inlined or not as the compiler sees fit: the decode ops' tile kernel measured 3.7% slower with the
// reduction forced inline (its 24 accumulators, the tile's operands and the shuffles compete for the registers).
__attribute__((target("avx512f"))) inline __m512 reduce16(const __m512* a) { return reduce16_inline(a); }
#endif

}  // namespace realhf
