// exp(x) as plain float arithmetic that the compiler vectorises in a loop (std::exp stays a scalar call without
// -ffast-math; the selects need -fno-trapping-math, which the kernels' builds pass), to about 2 ulp, for x <= 88
// (exp(88) ~ 1.65e38, near the largest float); below -87 it returns exp(-87) ~ 1.6e-38 (the smallest normal float,
// 0 within the rounding of any sum it joins). x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor
// polynomial, 2^n put into the exponent bits. Used by decode attention's softmax; the decode ops' SiLU runs the same
// steps as AVX-512 instructions (silu_mul16).
#pragma once

#include <cstdint>
#include <cstring>

namespace realhf {

inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;  // two plain selects (a nested one is control flow the vectoriser gives up on)
  x = x > 88.0f ? 88.0f : x;
  // round x / ln2 to the nearest integer n by adding 1.5 * 2^23: n is then also the low bits of t's representation
  // (read as an integer, no float-to-int conversion, which the vectoriser does not take after the selects above)
  const float t = x * 1.44269504088896341f + 12582912.f;
  const float n = t - 12582912.f;
  int32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;  // ln2 in two parts
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (t_bits - 0x4B400000 + 127) << 23;  // 0x4B400000: the bits of 1.5 * 2^23
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace realhf
