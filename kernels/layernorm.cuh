// llmpar/kernels/layernorm.cuh — LayerNorm and RMSNorm on CUDA, forward (optionally fused
// with the residual add) and backward.
//
//   LayerNorm: out = (x - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)  (biased var)
//   RMSNorm:   out = x * rstd * weight,                  rstd = 1 / sqrt(mean(x^2) + eps)
//
// This is backend/cpu/layernorm.hpp and backend/cpu/rmsnorm.hpp for the CUDA backend:
// same formulas, same conventions (mean and rstd saved as float per row, either may be
// null in forward; dx overwritten, or accumulated into with accumulate_dx; dweight and
// dbias accumulated into, in f32 whatever T is: they are the parameters' main grads).
//
// Why this shape. Normalisation is memory-bound: the forward must read x once and write
// out once. A row is handled by a "group" of threads: one warp for C <= 512, more warps
// (a power of two, up to the block) for longer rows; a block of kBlockThreads runs
// kBlockThreads / group rows at once, so short rows still fill the machine. Each thread
// loads its 16-byte chunks of the row with vector loads (when C is a multiple of the
// vector width and every pointer is 16-byte aligned; otherwise element by element, with
// bounds on the ragged tail) and keeps 16 elements of them in registers, so the
// normalising pass reads no memory but the weights. Only a row longer than 512 * 16
// (C > 8192) reads its excess chunks a second time (from L1/L2, most likely), and in
// backward accumulates the excess columns' dweight/dbias in the workspace instead of in
// registers. The element path and the vector path compute the same sums in the same
// order: results do not depend on alignment.
//
// Statistics. LayerNorm's mean and variance are per-chunk corrected two-pass states
// merged with math::Welford::combine — the merge the CPU kernel does between its
// chunks — then across the lanes of a warp in a fixed shuffle tree and across the warps
// of a group in warp order. Welford never forms E[x^2] - E[x]^2, which cancels
// catastrophically in float on rows whose mean is large against their spread (a
// residual stream at 1000 +- 0.1). RMSNorm's mean square has no such cancellation and
// is a plain sum. Every reduction has a fixed order, so results are bitwise reproducible.
//
// Backward. dx needs whole-row sums (of g = dout * weight and of g * norm), dweight and
// dbias whole-column sums over rows. One kernel does both: a block owns a fixed range
// of rows; each thread owns fixed columns (its chunks) and accumulates their
// dweight/dbias contributions in registers over the rows of its group; at the end the
// block adds its groups' partials in group order and writes one partial row per block
// into the caller's workspace. A second kernel adds the per-block partials in block
// order into dweight/dbias. No float atomics anywhere, and the partition depends on
// (rows, C, T) only, so the result is the same on every run and every GPU.
// Workspace: <op>_backward_workspace(rows, C) floats, at most 256 partial rows.
//
// Residual gradient. residual_rmsnorm_backward adds the residual stream's gradient into
// dx as it writes it (Llama's block: dx = norm backward + dresidual), with the roundings
// of the unfused rmsnorm_backward then add_inplace (which accumulate_dx, adding before
// the one rounding to T, does not have in bf16).
//
// Aliasing. residual_*_forward may write `sum` over `a` or `b` (the in-place residual
// update x += f(x)); `out` must not overlap `sum`, `a` or `b`. In layernorm_forward and
// rmsnorm_forward `out` may equal `x`. In backward dx must not overlap dout or x
// (residual_rmsnorm_backward's dresidual may equal dx).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "llmpar/core/error.hpp"
#include "llmpar/kernels/common.cuh"
#include "llmpar/math/welford.hpp"

namespace llmpar::kernels {

namespace detail::norm {

enum class Norm { layer, rms };

inline constexpr int kBlockThreads = 512;
inline constexpr int kWarpsPerBlock = kBlockThreads / kWarp;
// At most this many blocks (and so partial rows of dweight/dbias) in backward: about two
// per SM of an H100/H200 (one resident at a time at ~120 registers a thread), enough to
// fill it, few enough that the partials (written and read once) stay small.
inline constexpr std::int64_t kBackwardBlocks = 256;
inline constexpr int kFinalThreads = 256;
inline constexpr std::int64_t kMaxGridX = std::numeric_limits<int>::max();
// Columns are indexed with int inside a row (int64 indices cost registers): 2 C must
// stay below 2^31 (backward addresses a (2, C) partial row).
inline constexpr std::int64_t kMaxColumns = std::int64_t{1} << 30;

// How a row of C is cut: `group` threads per row (a power of two, whole warps, at most
// a block), `groups` rows per block, `chunks` 16-byte chunks per row, chunk j belonging
// to thread j % group of the row's group.
struct Geometry {
  int group;
  int groups;
  std::int64_t chunks;
};

// 16-byte chunks a thread keeps in registers: 16 elements. Forward keeps one pack per
// chunk, within 64 registers (two blocks of 512 per SM); backward keeps x and dout packs
// and a dweight and a dbias float per element, within 128.
template <Storage T>
inline constexpr int kForwardCached = 16 / Pack<T>::kSize;
template <Storage T>
inline constexpr int kBackwardCached = 16 / Pack<T>::kSize;

template <Storage T>
Geometry geometry(std::int64_t C, int cached) {
  const std::int64_t chunks = ceil_div(C, Pack<T>::kSize);
  int group = kWarp;
  while (group < kBlockThreads && std::int64_t{group} * cached < chunks) group *= 2;
  return {group, kBlockThreads / group, chunks};
}

// The backward partition: blocks of rows_per_block rows (a multiple of groups), in order.
struct BackwardPlan {
  Geometry geo;
  std::int64_t rows_per_block;
  std::int64_t blocks;
};

template <Storage T>
BackwardPlan backward_plan(std::int64_t rows, std::int64_t C) {
  const Geometry geo = geometry<T>(C, kBackwardCached<T>);
  if (rows == 0) return {geo, geo.groups, 0};
  const std::int64_t target = std::min(kBackwardBlocks, ceil_div(rows, geo.groups));
  const std::int64_t rows_per_block = ceil_div(ceil_div(rows, target), geo.groups) * geo.groups;
  return {geo, rows_per_block, ceil_div(rows, rows_per_block)};
}

// An upper bound of BackwardPlan::blocks for every storage type.
inline std::int64_t backward_blocks_bound(std::int64_t rows) { return std::min(rows, kBackwardBlocks); }

inline void check_shape(const char* who, std::int64_t rows, std::int64_t C) {
  LLMPAR_CHECK(rows >= 0 && C >= 1, who, ": rows = ", rows, ", C = ", C, "; need rows >= 0 and C >= 1");
  LLMPAR_CHECK(C <= kMaxColumns, who, ": C = ", C, " is more than ", kMaxColumns, " columns a row may have");
  LLMPAR_CHECK(rows <= std::numeric_limits<std::int64_t>::max() / C, who, ": rows * C = ", rows, " * ", C,
               " overflows int64");
}

inline void check_eps(const char* who, float eps) {
  LLMPAR_CHECK(eps >= 0.0f, who, ": eps = ", eps, "; it must be >= 0 (and not NaN)");
}

inline void check_pointer(const char* who, const void* p, const char* name) {
  LLMPAR_CHECK(p != nullptr, who, ": ", name, " is null; pass a device buffer (rows > 0)");
}

#if defined(LLMPAR_DEVICE_CODE)

// Per-warp partials in shared memory (plain arrays: a __shared__ variable cannot have
// the default member initialisers of math::Welford).
struct WelfordSlots {
  float mean[kWarpsPerBlock];
  float m2[kWarpsPerBlock];
  std::int64_t count[kWarpsPerBlock];
};

// The Welford state of the whole warp, combined in a fixed tree into lane 0 and
// broadcast (combine is not bitwise commutative, so a butterfly would leave the lanes
// with different bits).
__device__ __forceinline__ math::Welford<float> warp_welford(math::Welford<float> w) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const math::Welford<float> other{__shfl_down_sync(0xFFFFFFFFu, w.mean, offset),
                                     __shfl_down_sync(0xFFFFFFFFu, w.m2, offset),
                                     __shfl_down_sync(0xFFFFFFFFu, w.count, offset)};
    w.combine(other);
  }
  return {__shfl_sync(0xFFFFFFFFu, w.mean, 0), __shfl_sync(0xFFFFFFFFu, w.m2, 0), __shfl_sync(0xFFFFFFFFu, w.count, 0)};
}

// The Welford state of the thread's group (its row), the same bits in every thread of
// the group: warps combined in warp order. Contains a __syncthreads when group > 32, so
// every thread of the block must call it. Called once per kernel (slots are not reused).
__device__ __forceinline__ math::Welford<float> group_welford(math::Welford<float> w, WelfordSlots& slots, int group) {
  w = warp_welford(w);
  const int warps = group / kWarp;
  if (warps == 1) return w;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  if (threadIdx.x % kWarp == 0) {
    slots.mean[warp] = w.mean;
    slots.m2[warp] = w.m2;
    slots.count[warp] = w.count;
  }
  __syncthreads();
  const int first = static_cast<int>(threadIdx.x) / group * warps;
  math::Welford<float> total{slots.mean[first], slots.m2[first], slots.count[first]};
  for (int i = 1; i < warps; ++i) total.combine({slots.mean[first + i], slots.m2[first + i], slots.count[first + i]});
  return total;
}

// Sums (a, b) over the thread's group, the same bits in every thread of the group:
// butterfly within the warp (float + is commutative, so every lane agrees), then warps in
// order. slots: (2, kWarpsPerBlock), not read again before the next call's barrier... so
// a caller in a loop alternates two of them (see the backward kernel).
__device__ __forceinline__ void group_sum2(float& a, float& b, float (*slots)[kWarpsPerBlock], int group) {
  a = warp_sum(a);
  b = warp_sum(b);
  const int warps = group / kWarp;
  if (warps == 1) return;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  if (threadIdx.x % kWarp == 0) {
    slots[0][warp] = a;
    slots[1][warp] = b;
  }
  __syncthreads();
  const int first = static_cast<int>(threadIdx.x) / group * warps;
  a = slots[0][first];
  b = slots[1][first];
  for (int i = 1; i < warps; ++i) {
    a += slots[0][first + i];
    b += slots[1][first + i];
  }
}

// A chunk's corrected two-pass mean and M2 (as backend/cpu/layernorm.hpp does for its
// chunks), merged into the thread's state. n: valid elements of the chunk, >= 1.
template <Storage T>
__device__ __forceinline__ void accumulate(math::Welford<float>& st, const Pack<T>& pk, int n) {
  constexpr int kVec = Pack<T>::kSize;
  float v[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = load(pk.v[i]);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kVec; ++i)
    if (i < n) sum += v[i];
  const float inv_n = 1.0f / static_cast<float>(n);
  const float chunk_mean = sum * inv_n;
  float m2 = 0.0f, dev = 0.0f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    if (i < n) {
      const float d = v[i] - chunk_mean;
      m2 += d * d;
      dev += d;
    }
  }
  m2 -= dev * dev * inv_n;
  st.combine(math::Welford<float>{chunk_mean, m2 > 0.0f ? m2 : 0.0f, n});
}

// RMSNorm: the sum of squares (padding elements are 0 and add nothing).
template <Storage T>
__device__ __forceinline__ void accumulate(float& st, const Pack<T>& pk, int /*n*/) {
#pragma unroll
  for (int i = 0; i < Pack<T>::kSize; ++i) {
    const float v = load(pk.v[i]);
    st += v * v;
  }
}

// One row per group. out, sum: (rows, C); x (or a), b: (rows, C); weight, bias: (C);
// mean, rstd: (rows) or null. With kResidual the normalised row is sum = T(a + b),
// rounded to T first (so backward, which reads the stored sum, sees the same values).
template <Storage T, Norm kNorm, bool kResidual>
__global__ void __launch_bounds__(kBlockThreads, 2)
    norm_forward_kernel(T* out, T* sum, float* mean, float* rstd, const T* x, const T* b, const T* weight,
                        const T* bias, std::int64_t rows, int C, float eps, int group, bool vectorized) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  using Stats = std::conditional_t<kNorm == Norm::layer, math::Welford<float>, float>;
  static_assert(kBlockThreads % kWarp == 0, "blocks are whole warps");
  __shared__ WelfordSlots welford_slots;
  __shared__ float sum_slots[2][kWarpsPerBlock];

  const int groups = kBlockThreads / group;
  const int lane = static_cast<int>(threadIdx.x) % group;  // thread's index in its group
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * groups + static_cast<int>(threadIdx.x) / group;
  const bool active = row < rows;  // uniform over each warp (group >= 32)
  const int chunks = (C + kVec - 1) / kVec;
  const std::int64_t base = active ? row * C : 0;

  // Where a chunk's input values come from; for the residual form this also writes sum.
  const auto load_input = [&](int c0) {
    if constexpr (kResidual) {
      const P pa = load_pack(x + base, c0, C, vectorized);
      const P pb = load_pack(b + base, c0, C, vectorized);
      P s;
#pragma unroll
      for (int i = 0; i < kVec; ++i) s.v[i] = store<T>(load(pa.v[i]) + load(pb.v[i]));
      store_pack(sum + base, c0, C, vectorized, s);
      return s;
    } else {
      return load_pack(x + base, c0, C, vectorized);
    }
  };
  const auto valid = [&](int c0) { return C - c0 < kVec ? C - c0 : kVec; };

  // Pass 1: statistics; the first kForwardCached chunks of each thread stay in registers.
  constexpr int kCached = kForwardCached<T>;
  P cache[kCached];  // (kCached, kVec)
  Stats st{};
  if (active) {
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int c0 = (lane + k * group) * kVec;
      if (c0 < C) {
        cache[k] = load_input(c0);
        accumulate(st, cache[k], valid(c0));
      }
    }
    for (int chunk = lane + kCached * group; chunk < chunks; chunk += group) {
      const P pk = load_input(chunk * kVec);
      accumulate(st, pk, valid(chunk * kVec));
    }
  }
  float m = 0.0f, s;
  if constexpr (kNorm == Norm::layer) {
    st = group_welford(st, welford_slots, group);
    m = st.mean;
    s = 1.0f / sqrtf(st.variance() + eps);
  } else {
    float unused = 0.0f;
    group_sum2(st, unused, sum_slots, group);
    s = 1.0f / sqrtf(st / static_cast<float>(C) + eps);
  }
  if (!active) return;  // no barrier follows
  if (lane == 0) {
    if (mean != nullptr) mean[row] = m;
    if (rstd != nullptr) rstd[row] = s;
  }

  // Pass 2: normalise. out = (v - m) * s * w + b (LayerNorm) or v * s * w (RMSNorm).
  const auto write = [&](const P& pk, int c0) {
    const P w = load_pack(weight, c0, C, vectorized);
    P o;
    if constexpr (kNorm == Norm::layer) {
      const P bb = load_pack(bias, c0, C, vectorized);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float norm = (load(pk.v[i]) - m) * s;
        o.v[i] = store<T>(norm * load(w.v[i]) + load(bb.v[i]));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) o.v[i] = store<T>(load(pk.v[i]) * s * load(w.v[i]));
    }
    store_pack(out + base, c0, C, vectorized, o);
  };
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int c0 = (lane + k * group) * kVec;
    if (c0 < C) write(cache[k], c0);
  }
  // Rows too long for the registers: the excess is read again (this thread's own writes
  // of sum, for the residual form, so sum may have overwritten a or b).
  const T* again = kResidual ? sum : x;
  for (int chunk = lane + kCached * group; chunk < chunks; chunk += group)
    write(load_pack(again + base, chunk * kVec, C, vectorized), chunk * kVec);
}

// dx, dout, x: (rows, C); weight: (C); mean (LayerNorm only), rstd: (rows);
// partials: (gridDim.x, kParts, C), this block's partial dweight (and dbias) sums.
// With kResidual, dx = T(T(norm's dx) + dresidual) (rows, C): the unfused add_inplace's
// roundings, the add kept out of an FMA (__fadd_rn), so the bits are the unfused
// sequence's (backend/cpu/rmsnorm.hpp); dresidual may equal dx.
// Block blockIdx.x owns rows [blockIdx.x * rows_per_block, +rows_per_block); group g of
// the block takes rows g, g + groups, ... of them.
template <Storage T, Norm kNorm, bool kResidual>
__global__ void __launch_bounds__(kBlockThreads)
    norm_backward_kernel(T* dx, float* partials, const T* dout, const T* dresidual, const T* x, const T* weight,
                         const float* mean, const float* rstd, std::int64_t rows, int C, std::int64_t rows_per_block,
                         int group, bool vectorized, bool accumulate_dx) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  constexpr int kParts = kNorm == Norm::layer ? 2 : 1;  // dweight, dbias
  constexpr int kCached = kBackwardCached<T>;
  __shared__ float sum_slots[2][2][kWarpsPerBlock];  // (parity, 2, warps): row sums
  __shared__ float exchange[kVec][kBlockThreads];    // (kVec, threads): groups' partials

  const int groups = kBlockThreads / group;
  const int g = static_cast<int>(threadIdx.x) / group;
  const int lane = static_cast<int>(threadIdx.x) % group;
  const int chunks = (C + kVec - 1) / kVec;
  const std::int64_t row_begin = static_cast<std::int64_t>(blockIdx.x) * rows_per_block;
  const std::int64_t row_end = row_begin + rows_per_block < rows ? row_begin + rows_per_block : rows;
  const std::int64_t iterations = rows_per_block / groups;  // rows_per_block is a multiple of groups
  float* part = partials + static_cast<std::int64_t>(blockIdx.x) * kParts * C;  // (kParts, C)

  // Column sums of the thread's cached chunks, over the rows of its group.
  float acc[kParts][kCached][kVec];  // (kParts, kCached, kVec)
#pragma unroll
  for (int p = 0; p < kParts; ++p)
#pragma unroll
    for (int k = 0; k < kCached; ++k)
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[p][k][i] = 0.0f;
  // Chunks past the registers exist only when group == kBlockThreads (one group per
  // block, see geometry()), so the thread owns those columns of `part` outright and
  // accumulates into them in place.
  for (int chunk = lane + kCached * group; chunk < chunks; chunk += group)
    for (int i = 0; i < kVec && chunk * kVec + i < C; ++i)
#pragma unroll
      for (int p = 0; p < kParts; ++p) part[static_cast<std::int64_t>(p) * C + chunk * kVec + i] = 0.0f;

  for (std::int64_t it = 0; it < iterations; ++it) {
    const std::int64_t row = row_begin + it * groups + g;
    const bool active = row < row_end;  // uniform over each warp
    const std::int64_t base = active ? row * C : 0;
    const float m = kNorm == Norm::layer && active ? mean[row] : 0.0f;
    const float s = active ? rstd[row] : 0.0f;
    float sum_g = 0.0f, sum_g_norm = 0.0f;
    P xs[kCached], gs[kCached];  // (kCached, kVec) x and dout of the cached chunks

    // g = dout * w, norm = (x - m) * s (LayerNorm) or x * s (RMSNorm); padding elements
    // read as 0, so g = 0 and dout = 0 there and they add nothing.
    const auto visit = [&](const P& xp, const P& gp, int c0, float* dw_acc, float* db_acc) {
      const P w = load_pack(weight, c0, C, vectorized);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float d = load(gp.v[i]);
        const float norm = (load(xp.v[i]) - m) * s;
        const float gv = d * load(w.v[i]);
        sum_g += gv;
        sum_g_norm += gv * norm;
        dw_acc[i] += d * norm;
        if constexpr (kParts == 2) db_acc[i] += d;
      }
    };
    if (active) {
#pragma unroll
      for (int k = 0; k < kCached; ++k) {
        const int c0 = (lane + k * group) * kVec;
        if (c0 < C) {
          xs[k] = load_pack(x + base, c0, C, vectorized);
          gs[k] = load_pack(dout + base, c0, C, vectorized);
          visit(xs[k], gs[k], c0, acc[0][k], acc[kParts - 1][k]);
        }
      }
      for (int chunk = lane + kCached * group; chunk < chunks; chunk += group) {
        const int c0 = chunk * kVec;
        float dw_acc[kVec] = {}, db_acc[kVec] = {};
        visit(load_pack(x + base, c0, C, vectorized), load_pack(dout + base, c0, C, vectorized), c0, dw_acc, db_acc);
        for (int i = 0; i < kVec && c0 + i < C; ++i) {
          part[c0 + i] += dw_acc[i];
          if constexpr (kParts == 2) part[C + c0 + i] += db_acc[i];
        }
      }
    }
    group_sum2(sum_g, sum_g_norm, sum_slots[it & 1], group);
    if (!active) continue;  // the next barrier is reached by every thread: iterations is uniform

    // dx = s * (g - mean(g) - norm * mean(g * norm)); RMSNorm has no mean(g) term.
    const float mean_g = kNorm == Norm::layer ? sum_g / static_cast<float>(C) : 0.0f;
    const float mean_g_norm = sum_g_norm / static_cast<float>(C);
    const auto write = [&](const P& xp, const P& gp, int c0) {
      const P w = load_pack(weight, c0, C, vectorized);
      P old;
      if (accumulate_dx) old = load_pack(dx + base, c0, C, vectorized);
      P o;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float norm = (load(xp.v[i]) - m) * s;
        const float gv = load(gp.v[i]) * load(w.v[i]);
        float d = (gv - mean_g - norm * mean_g_norm) * s;
        if (accumulate_dx) d += load(old.v[i]);
        o.v[i] = store<T>(d);
      }
      if constexpr (kResidual) {
        const P r = load_pack(dresidual + base, c0, C, vectorized);
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.v[i] = store<T>(__fadd_rn(load(o.v[i]), load(r.v[i])));
      }
      store_pack(dx + base, c0, C, vectorized, o);
    };
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int c0 = (lane + k * group) * kVec;
      if (c0 < C) write(xs[k], gs[k], c0);
    }
    for (int chunk = lane + kCached * group; chunk < chunks; chunk += group) {
      const int c0 = chunk * kVec;
      write(load_pack(x + base, c0, C, vectorized), load_pack(dout + base, c0, C, vectorized), c0);
    }
  }

  // The block's partial column sums: its groups' registers added in group order.
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) exchange[i][threadIdx.x] = acc[p][k][i];
      __syncthreads();
      const int c0 = (lane + k * group) * kVec;
      if (g == 0 && c0 < C) {
        for (int i = 0; i < kVec && c0 + i < C; ++i) {
          float total = exchange[i][lane];
          for (int other = 1; other < groups; ++other) total += exchange[i][other * group + lane];
          part[static_cast<std::int64_t>(p) * C + c0 + i] = total;
        }
      }
      __syncthreads();  // before the next round overwrites exchange
    }
  }
}

// dweight (and dbias) += the per-block partials, added in block order.
// partials: (blocks, kParts, C); dweight, dbias: (C) f32 main grads.
template <int kParts>
__global__ void __launch_bounds__(kFinalThreads)
    norm_param_grad_kernel(float* dweight, float* dbias, const float* partials, int blocks, std::int64_t C) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kFinalThreads + threadIdx.x;
  if (i >= kParts * C) return;
  const int p = static_cast<int>(i / C);
  const std::int64_t c = i % C;
  float total = 0.0f;
#pragma unroll 8
  for (int blk = 0; blk < blocks; ++blk) total += partials[(static_cast<std::int64_t>(blk) * kParts + p) * C + c];
  float* dst = p == 0 ? dweight : dbias;
  dst[c] += total;
}

template <Storage T, Norm kNorm, bool kResidual>
void launch_forward(cudaStream_t stream, const char* who, T* out, T* sum, float* mean, float* rstd, const T* x,
                    const T* b, const T* weight, const T* bias, std::int64_t rows, std::int64_t C, float eps) {
  const Geometry geo = geometry<T>(C, kForwardCached<T>);
  const std::int64_t blocks = ceil_div(rows, geo.groups);
  LLMPAR_CHECK(blocks <= kMaxGridX, who, ": rows = ", rows, " needs ", blocks,
               " blocks, more than a CUDA grid holds; normalise the rows in several calls");
  const bool vectorized = C % Pack<T>::kSize == 0 && aligned16(out) && aligned16(sum) && aligned16(x) && aligned16(b) &&
                          aligned16(weight) && aligned16(bias);
  launch_kernel(&norm_forward_kernel<T, kNorm, kResidual>, static_cast<unsigned>(blocks), kBlockThreads, 0, stream, out,
                sum, mean, rstd, x, b, weight, bias, rows, static_cast<int>(C), eps, geo.group, vectorized);
  LLMPAR_CHECK_LAUNCH(who);
}

template <Storage T, Norm kNorm, bool kResidual>
void launch_backward(cudaStream_t stream, const char* who, T* dx, float* dweight, float* dbias, const T* dout,
                     const T* dresidual, const T* x, const T* weight, const float* mean, const float* rstd,
                     float* workspace, std::int64_t rows, std::int64_t C, bool accumulate_dx) {
  constexpr int kParts = kNorm == Norm::layer ? 2 : 1;
  const BackwardPlan plan = backward_plan<T>(rows, C);
  const bool vectorized = C % Pack<T>::kSize == 0 && aligned16(dx) && aligned16(dout) && aligned16(dresidual) &&
                          aligned16(x) && aligned16(weight);
  launch_kernel(&norm_backward_kernel<T, kNorm, kResidual>, static_cast<unsigned>(plan.blocks), kBlockThreads, 0,
                stream, dx, workspace, dout, dresidual, x, weight, mean, rstd, rows, static_cast<int>(C),
                plan.rows_per_block, plan.geo.group, vectorized, accumulate_dx);
  LLMPAR_CHECK_LAUNCH(who);
  const std::int64_t final_blocks = ceil_div(kParts * C, kFinalThreads);
  LLMPAR_CHECK(final_blocks <= kMaxGridX, who, ": C = ", C, " is too large for one grid");
  launch_kernel(&norm_param_grad_kernel<kParts>, static_cast<unsigned>(final_blocks), kFinalThreads, 0, stream, dweight,
                dbias, workspace, static_cast<int>(plan.blocks), C);
  LLMPAR_CHECK_LAUNCH(who);
}

#endif  // LLMPAR_DEVICE_CODE

}  // namespace detail::norm

// Floats of workspace layernorm_backward needs for (rows, C).
inline std::int64_t layernorm_backward_workspace(std::int64_t rows, std::int64_t C) {
  detail::norm::check_shape("layernorm_backward_workspace", rows, C);
  return detail::norm::backward_blocks_bound(rows) * 2 * C;
}

// Floats of workspace rmsnorm_backward needs for (rows, C).
inline std::int64_t rmsnorm_backward_workspace(std::int64_t rows, std::int64_t C) {
  detail::norm::check_shape("rmsnorm_backward_workspace", rows, C);
  return detail::norm::backward_blocks_bound(rows) * C;
}

#if defined(LLMPAR_DEVICE_CODE)

// out, x: (rows, C); weight, bias: (C); mean, rstd: (rows) or null.
template <Storage T>
void layernorm_forward(cudaStream_t stream, T* out, float* mean, float* rstd, const T* x, const T* weight,
                       const T* bias, std::int64_t rows, std::int64_t C, float eps = 1e-5f) {
  constexpr const char* kWho = "layernorm_forward";
  detail::norm::check_shape(kWho, rows, C);
  detail::norm::check_eps(kWho, eps);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, out, "out");
  detail::norm::check_pointer(kWho, x, "x");
  detail::norm::check_pointer(kWho, weight, "weight");
  detail::norm::check_pointer(kWho, bias, "bias");
  detail::norm::launch_forward<T, detail::norm::Norm::layer, false>(stream, kWho, out, nullptr, mean, rstd, x, nullptr,
                                                                    weight, bias, rows, C, eps);
}

// Fused residual: sum = T(a + b) is written to `sum` (rows, C) and normalised into out
// (rows, C). sum may equal a or b; it may not alias out. weight, bias: (C);
// mean, rstd: (rows) or null.
template <Storage T>
void residual_layernorm_forward(cudaStream_t stream, T* sum, T* out, float* mean, float* rstd, const T* a, const T* b,
                                const T* weight, const T* bias, std::int64_t rows, std::int64_t C, float eps = 1e-5f) {
  constexpr const char* kWho = "residual_layernorm_forward";
  detail::norm::check_shape(kWho, rows, C);
  detail::norm::check_eps(kWho, eps);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, sum, "sum");
  detail::norm::check_pointer(kWho, out, "out");
  detail::norm::check_pointer(kWho, a, "a");
  detail::norm::check_pointer(kWho, b, "b");
  detail::norm::check_pointer(kWho, weight, "weight");
  detail::norm::check_pointer(kWho, bias, "bias");
  LLMPAR_CHECK(sum != out, kWho, ": sum and out are the same buffer; the residual sum must be kept for backward");
  detail::norm::launch_forward<T, detail::norm::Norm::layer, true>(stream, kWho, out, sum, mean, rstd, a, b, weight,
                                                                   bias, rows, C, eps);
}

// dx, dout, x: (rows, C); weight: (C); dweight, dbias: (C) f32; mean, rstd: (rows) from
// forward; workspace: layernorm_backward_workspace(rows, C) floats.
// dx = LN backward (overwritten), or dx += LN backward when accumulate_dx (the residual
// stream's gradient, fused); dweight, dbias +=.
template <Storage T>
void layernorm_backward(cudaStream_t stream, T* dx, float* dweight, float* dbias, const T* dout, const T* x,
                        const T* weight, const float* mean, const float* rstd, float* workspace, std::int64_t rows,
                        std::int64_t C, bool accumulate_dx = false) {
  constexpr const char* kWho = "layernorm_backward";
  detail::norm::check_shape(kWho, rows, C);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, dx, "dx");
  detail::norm::check_pointer(kWho, dweight, "dweight");
  detail::norm::check_pointer(kWho, dbias, "dbias");
  detail::norm::check_pointer(kWho, dout, "dout");
  detail::norm::check_pointer(kWho, x, "x");
  detail::norm::check_pointer(kWho, weight, "weight");
  detail::norm::check_pointer(kWho, mean, "mean (saved by layernorm_forward)");
  detail::norm::check_pointer(kWho, rstd, "rstd (saved by layernorm_forward)");
  detail::norm::check_pointer(kWho, workspace, "workspace (layernorm_backward_workspace(rows, C) floats)");
  detail::norm::launch_backward<T, detail::norm::Norm::layer, false>(
      stream, kWho, dx, dweight, dbias, dout, nullptr, x, weight, mean, rstd, workspace, rows, C, accumulate_dx);
}

// RMSNorm (LLaMA): out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps).
// out, x: (rows, C); weight: (C); rstd: (rows) or null.
template <Storage T>
void rmsnorm_forward(cudaStream_t stream, T* out, float* rstd, const T* x, const T* weight, std::int64_t rows,
                     std::int64_t C, float eps = 1e-5f) {
  constexpr const char* kWho = "rmsnorm_forward";
  detail::norm::check_shape(kWho, rows, C);
  detail::norm::check_eps(kWho, eps);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, out, "out");
  detail::norm::check_pointer(kWho, x, "x");
  detail::norm::check_pointer(kWho, weight, "weight");
  detail::norm::launch_forward<T, detail::norm::Norm::rms, false>(stream, kWho, out, nullptr, nullptr, rstd, x, nullptr,
                                                                  weight, nullptr, rows, C, eps);
}

// sum = T(a + b) (rows, C), out = RMSNorm(sum) (rows, C); sum may equal a or b, not out.
template <Storage T>
void residual_rmsnorm_forward(cudaStream_t stream, T* sum, T* out, float* rstd, const T* a, const T* b, const T* weight,
                              std::int64_t rows, std::int64_t C, float eps = 1e-5f) {
  constexpr const char* kWho = "residual_rmsnorm_forward";
  detail::norm::check_shape(kWho, rows, C);
  detail::norm::check_eps(kWho, eps);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, sum, "sum");
  detail::norm::check_pointer(kWho, out, "out");
  detail::norm::check_pointer(kWho, a, "a");
  detail::norm::check_pointer(kWho, b, "b");
  detail::norm::check_pointer(kWho, weight, "weight");
  LLMPAR_CHECK(sum != out, kWho, ": sum and out are the same buffer; the residual sum must be kept for backward");
  detail::norm::launch_forward<T, detail::norm::Norm::rms, true>(stream, kWho, out, sum, nullptr, rstd, a, b, weight,
                                                                 nullptr, rows, C, eps);
}

// dx, dout, x: (rows, C); weight: (C); dweight: (C) f32; rstd: (rows) from forward;
// workspace: rmsnorm_backward_workspace(rows, C) floats. dx overwritten (or += with
// accumulate_dx); dweight +=.
template <Storage T>
void rmsnorm_backward(cudaStream_t stream, T* dx, float* dweight, const T* dout, const T* x, const T* weight,
                      const float* rstd, float* workspace, std::int64_t rows, std::int64_t C,
                      bool accumulate_dx = false) {
  constexpr const char* kWho = "rmsnorm_backward";
  detail::norm::check_shape(kWho, rows, C);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, dx, "dx");
  detail::norm::check_pointer(kWho, dweight, "dweight");
  detail::norm::check_pointer(kWho, dout, "dout");
  detail::norm::check_pointer(kWho, x, "x");
  detail::norm::check_pointer(kWho, weight, "weight");
  detail::norm::check_pointer(kWho, rstd, "rstd (saved by rmsnorm_forward)");
  detail::norm::check_pointer(kWho, workspace, "workspace (rmsnorm_backward_workspace(rows, C) floats)");
  detail::norm::launch_backward<T, detail::norm::Norm::rms, false>(
      stream, kWho, dx, dweight, nullptr, dout, nullptr, x, weight, nullptr, rstd, workspace, rows, C, accumulate_dx);
}

// dx (rows, C) = RMSNorm backward(dout) + dresidual, in one pass (the residual stream's
// gradient added as dx is written; bitwise rmsnorm_backward then add_inplace).
// dresidual: (rows, C), may equal dx; dx must not overlap dout or x. Otherwise as
// rmsnorm_backward (dweight +=; workspace: rmsnorm_backward_workspace(rows, C) floats).
template <Storage T>
void residual_rmsnorm_backward(cudaStream_t stream, T* dx, float* dweight, const T* dout, const T* dresidual,
                               const T* x, const T* weight, const float* rstd, float* workspace, std::int64_t rows,
                               std::int64_t C) {
  constexpr const char* kWho = "residual_rmsnorm_backward";
  detail::norm::check_shape(kWho, rows, C);
  if (rows == 0) return;
  detail::norm::check_pointer(kWho, dx, "dx");
  detail::norm::check_pointer(kWho, dweight, "dweight");
  detail::norm::check_pointer(kWho, dout, "dout");
  detail::norm::check_pointer(kWho, dresidual, "dresidual");
  detail::norm::check_pointer(kWho, x, "x");
  detail::norm::check_pointer(kWho, weight, "weight");
  detail::norm::check_pointer(kWho, rstd, "rstd (saved by rmsnorm_forward)");
  detail::norm::check_pointer(kWho, workspace, "workspace (rmsnorm_backward_workspace(rows, C) floats)");
  detail::norm::launch_backward<T, detail::norm::Norm::rms, true>(stream, kWho, dx, dweight, nullptr, dout, dresidual,
                                                                  x, weight, nullptr, rstd, workspace, rows, C, false);
}

#endif  // LLMPAR_DEVICE_CODE

}  // namespace llmpar::kernels
