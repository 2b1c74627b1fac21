// llmpar/math/rotary.hpp — rotary position embeddings (RoPE, Su et al. 2021): the
// frequencies, with Llama 3's scaling, and the rotation of one channel pair.
//
// In every head of q and of k, channel i < hs/2 is paired with channel i + hs/2 (the
// "rotate half" layout of GPT-NeoX and Hugging Face's Llama, so that Hugging Face
// weights load without a permutation) and the pair at position t is rotated by the
// angle t · inv_freq(i):
//
//   inv_freq(i) = theta^(-2i / hs)            (theta: Llama 2 10^4, Llama 3 5·10^5)
//
// Llama 3.1's scaling (RopeConfig::factor > 0; Hugging Face's rope_type "llama3")
// stretches the low frequencies for long contexts: with the wavelength λ = 2π / inv_freq
// and L = original_max_position, frequencies with λ > L / low_freq_factor are divided
// by factor, those with λ < L / high_freq_factor kept, and those between interpolated
// with s = (L / λ - low_freq_factor) / (high_freq_factor - low_freq_factor):
//   inv_freq ← (1 - s) inv_freq / factor + s inv_freq.
//
// Host/device, in f32 as Hugging Face computes them (the angle is the f32 product of
// the position and the frequency, then cos and sin of it), so the CPU and CUDA kernels
// and a transformers model rotate by the same angles to f32 rounding. A rotation is
// orthogonal: the backward is the rotation by -angle, and nothing is kept for it.
#pragma once

#include <math.h>

#include <cstdint>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::math {

struct RopeConfig {
  float theta = 10000.0f;  // the base of the frequencies (Hugging Face's rope_theta)
  // Llama 3 frequency scaling (rope_scaling {"rope_type": "llama3", ...}); factor 0: none.
  float factor = 0.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  std::int64_t original_max_position = 8192;

  bool scaled() const { return factor > 0.0f; }
  void validate() const {
    LLMPAR_CHECK(theta > 1.0f, "rope theta (--rope-theta) is ", theta,
                 "; rotary frequencies need a base > 1 (Llama 2: 10000, Llama 3: 500000)");
    LLMPAR_CHECK(factor == 0.0f || factor >= 1.0f, "rope scaling factor is ", factor,
                 "; give 0 (no scaling) or a factor >= 1 (Llama 3.1/3.2: 8 or 32)");
    LLMPAR_CHECK(
        !scaled() || (high_freq_factor > low_freq_factor && low_freq_factor > 0.0f && original_max_position > 0),
        "rope scaling: high_freq_factor ", high_freq_factor, " must exceed low_freq_factor ", low_freq_factor,
        " > 0 and original_max_position ", original_max_position, " must be positive (Llama 3.1: 4, 1, 8192)");
  }
  friend bool operator==(const RopeConfig&, const RopeConfig&) = default;
};

// The angle per position of channel pair i of a head of hs channels.
LLMPAR_HOST_DEVICE float rope_inv_freq(std::int64_t i, std::int64_t hs, const RopeConfig& c) {
  const float inv = 1.0f / powf(c.theta, static_cast<float>(2 * i) / static_cast<float>(hs));
  if (!(c.factor > 0.0f)) return inv;
  const float two_pi = 6.283185307179586f;
  const float wavelen = two_pi / inv;
  const float context = static_cast<float>(c.original_max_position);
  if (wavelen > context / c.low_freq_factor) return inv / c.factor;  // low frequencies: stretched
  if (wavelen < context / c.high_freq_factor) return inv;            // high frequencies: kept
  const float s = (context / wavelen - c.low_freq_factor) / (c.high_freq_factor - c.low_freq_factor);
  return (1.0f - s) * inv / c.factor + s * inv;
}

// (x0, x1) rotated by the angle whose cosine and sine are (c, s): x0 is channel i of a
// head, x1 channel i + hs/2. The backward passes -s.
template <class Acc>
LLMPAR_HOST_DEVICE void rotate_pair(Acc& x0, Acc& x1, Acc c, Acc s) {
  const Acc r0 = x0 * c - x1 * s;
  const Acc r1 = x1 * c + x0 * s;
  x0 = r0;
  x1 = r1;
}

}  // namespace llmpar::math
