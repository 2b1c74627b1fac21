// llmpar/kernels/elementwise.cuh — GELU, the gated linear units, residual adds, scaling, bias add and bias
// gradient, the token + position embedding (forward and backward) and dtype conversion.
//
// The CUDA twins of backend/cpu/gelu.hpp, elementwise.hpp, bias.hpp and embedding.hpp.
// Each element is computed as the CPU kernel computes it: load to float, the shared math
// (math::gelu_tanh, math::gelu_tanh_grad), one rounding to the storage type through the
// same conversion functions. So add, add_inplace, scale_inplace, bias_add,
// encoder_forward and convert give the CPU's bits exactly; GELU differs only by the
// device's expf and FMA contraction (an ulp or so).
//
// Streams (gelu, add, scale, convert, bias_add, encoder_forward) are memory-bound. They
// run a grid-stride loop over 16-byte packs when every pointer they touch is 16-byte
// aligned (and, for the row-wise ones, rows are whole packs), with a scalar loop for the
// tail; otherwise a scalar grid-stride loop. The grid is capped (kMaxBlocks): past a few
// waves more blocks only add scheduling, and the cap keeps the launcher free of device
// queries.
//
// Reductions are deterministic, with no float atomics:
//   - bias_backward cuts the rows into slices whose number depends on the shape alone
//     (not on the GPU), sums each slice's columns into a float workspace, then adds the
//     slices in order. The grouping differs from the CPU kernel (which adds all rows in
//     order), so the sums agree to float rounding, not bit for bit.
//   - encoder_backward keeps the CPU kernel's order exactly: every dwte row receives its
//     positions in ascending order, and every dwpe row its batches in ascending order,
//     each addition rounded to the storage type as the CPU does. A stable radix sort of
//     the (token, position) pairs groups equal tokens with their positions still
//     ascending; one block per distinct token walks its run. The results are therefore
//     bit-identical to backend::cpu::encoder_backward for every storage type. The price
//     is that a run of r positions is r dependent additions (a token repeated over the
//     whole batch serialises over it); across columns and tokens everything is parallel.
//
// Aliasing: in the element-wise streams an output may equal an input (each element is
// read before it is written, by the same thread) but must not partially overlap one;
// the launchers check this. convert between types of different sizes needs disjoint
// buffers. Conventions as in the CPU kernels: gelu_backward overwrites dx; bias_backward
// and encoder_backward accumulate (+=).
//
// Tokens must be in [0, V): like the CPU kernel, these do not know V and do not check.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <type_traits>

#include "llmpar/core/slice.hpp"
#include "llmpar/kernels/common.cuh"
#include "llmpar/math/activation.hpp"

namespace llmpar::kernels {

namespace detail::ew {

inline constexpr int kElementwiseThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 16384;

// Elements per pack for a stream from In to Out: 16 bytes of the wider type.
template <class Out, class In>
inline constexpr int kPackWidth = static_cast<int>(16 / (sizeof(Out) > sizeof(In) ? sizeof(Out) : sizeof(In)));

inline bool aligned_to(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// [a, a + a_bytes) and [b, b + b_bytes) share a byte.
inline bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

inline unsigned grid_for(std::int64_t work) {
  return static_cast<unsigned>(std::clamp<std::int64_t>(ceil_div(work, kElementwiseThreads), 1, kMaxBlocks));
}

// Host checks shared by the element-wise streams: n >= 0 and, for n > 0, every pointer set.
inline void check_count(const char* op, std::int64_t n) {
  LLMPAR_CHECK(n >= 0, op, ": n = ", n, "; the element count must be >= 0");
}
inline void check_pointer(const char* op, const char* name, const void* p) {
  LLMPAR_CHECK(p != nullptr, op, ": ", name, " is nullptr; pass a device buffer of the stated size");
}
// An output may be exactly an input (element-wise in place) or disjoint from it.
inline void check_same_or_disjoint(const char* op, const char* out_name, const void* out, const char* in_name,
                                   const void* in, std::size_t bytes) {
  LLMPAR_CHECK(out == in || !overlap(out, bytes, in, bytes), op, ": ", out_name, " and ", in_name,
               " overlap without being the same buffer; pass the same pointer (in place) or disjoint buffers");
}

// The per-element operations: what the CPU kernels compute, element by element.
template <class T>
struct GeluForwardOp {
  LLMPAR_HOST_DEVICE T operator()(T x) const { return store<T>(math::gelu_tanh(load(x))); }
};
template <class T>
struct GeluBackwardOp {  // (x, dout) -> dx
  LLMPAR_HOST_DEVICE T operator()(T x, T dout) const { return store<T>(load(dout) * math::gelu_tanh_grad(load(x))); }
};
template <class T>
struct AddOp {
  LLMPAR_HOST_DEVICE T operator()(T a, T b) const { return store<T>(load(a) + load(b)); }
};
template <class T>
struct ScaleOp {
  float s;
  LLMPAR_HOST_DEVICE T operator()(T a) const { return store<T>(load(a) * s); }
};
template <class To, class From>
struct ConvertOp {
  LLMPAR_HOST_DEVICE To operator()(From x) const { return llmpar::convert<To>(x); }
};

#if defined(__CUDACC__)
// out[i] = op(a[i]) or op(a[i], b[i]) for i in [0, n). out, a, b: (n).
// kVectorized: out, a, b are aligned to their packs; packs first, then the scalar tail.
template <class Out, class In, int kInputs, bool kVectorized, class Op>
__global__ void __launch_bounds__(kElementwiseThreads)
    map_kernel(Out* out, const In* a, const In* b, std::int64_t n, Op op) {
  static_assert(kInputs == 1 || kInputs == 2, "map_kernel takes one or two inputs");
  constexpr int kVec = kVectorized ? kPackWidth<Out, In> : 1;
  using InPack = Pack<In, kVec>;
  using OutPack = Pack<Out, kVec>;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t packs = n / kVec;
  for (std::int64_t i = first; i < packs; i += stride) {
    const InPack pa = reinterpret_cast<const InPack*>(a)[i];
    OutPack po;
    if constexpr (kInputs == 2) {
      const InPack pb = reinterpret_cast<const InPack*>(b)[i];
#pragma unroll
      for (int k = 0; k < kVec; ++k) po.v[k] = op(pa.v[k], pb.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) po.v[k] = op(pa.v[k]);
    }
    reinterpret_cast<OutPack*>(out)[i] = po;
  }
  for (std::int64_t i = packs * kVec + first; i < n; i += stride) {  // the tail (< kVec elements)
    if constexpr (kInputs == 2)
      out[i] = op(a[i], b[i]);
    else
      out[i] = op(a[i]);
  }
}

// y[r, j] = y[r, j] + bias[j]. y: (rows, n); bias: (n). kVectorized: n is a whole number
// of packs and y, bias are pack-aligned, so a pack never straddles two rows.
template <class T, bool kVectorized>
__global__ void __launch_bounds__(kElementwiseThreads)
    bias_add_kernel(T* y, const T* bias, std::int64_t rows, std::int64_t n) {
  constexpr int kVec = kVectorized ? kPackWidth<T, T> : 1;
  using TPack = Pack<T, kVec>;
  const std::int64_t packs_per_row = n / kVec;
  const std::int64_t total = rows * packs_per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    TPack py = reinterpret_cast<TPack*>(y)[i];
    const TPack pb = reinterpret_cast<const TPack*>(bias)[i % packs_per_row];
#pragma unroll
    for (int k = 0; k < kVec; ++k) py.v[k] = store<T>(load(py.v[k]) + load(pb.v[k]));
    reinterpret_cast<TPack*>(y)[i] = py;
  }
}
#endif  // __CUDACC__

// bias_backward's partition: kBiasColumns columns per block (one warp wide, so each row
// read is one coalesced segment), kBiasRowThreads threads per column, and rows cut into
// slices of about kBiasRowsPerSlice, at most kBiasMaxSlices (which bounds the workspace).
inline constexpr int kBiasColumns = 32;
inline constexpr int kBiasRowThreads = 16;
inline constexpr int kBiasThreads = kBiasColumns * kBiasRowThreads;
inline constexpr std::int64_t kBiasRowsPerSlice = 256;
inline constexpr std::int64_t kBiasMaxSlices = 128;

inline std::int64_t bias_slices(std::int64_t rows) {
  return std::clamp<std::int64_t>(ceil_div(rows, kBiasRowsPerSlice), 1, kBiasMaxSlices);
}

#if defined(__CUDACC__)
// Pass 1: partials[s, j] = sum of dout[r, j] over the rows r of slice s = blockIdx.y.
// dout: (rows, n); partials: (slices, n). Block: (kBiasColumns, kBiasRowThreads).
template <class T>
__global__ void __launch_bounds__(kBiasThreads) bias_partials_kernel(const T* dout, float* partials, std::int64_t rows,
                                                                     std::int64_t n, std::int64_t rows_per_slice) {
  __shared__ float column_sums[kBiasRowThreads][kBiasColumns + 1];  // (kBiasRowThreads, kBiasColumns)
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kBiasColumns + threadIdx.x;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * rows_per_slice;
  const std::int64_t r1 = std::min(rows, r0 + rows_per_slice);
  float acc = 0.0f;
  if (col < n) {
    for (std::int64_t r = r0 + threadIdx.y; r < r1; r += kBiasRowThreads) acc += load(dout[r * n + col]);
  }
  column_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kBiasRowThreads; ++k) sum += column_sums[k][threadIdx.x];  // fixed order
    partials[static_cast<std::int64_t>(blockIdx.y) * n + col] = sum;
  }
}

// Pass 2: dbias[j] += sum over slices s, in order, of partials[s, j]. dbias: (n) f32.
// (A template only so that the header may be included by several translation units.)
template <int kUnused = 0>
__global__ void __launch_bounds__(kElementwiseThreads)
    bias_finish_kernel(float* dbias, const float* partials, std::int64_t slices, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    float sum = 0.0f;
    for (std::int64_t s = 0; s < slices; ++s) sum += partials[s * n + j];
    dbias[j] += sum;
  }
}

// out[bt, :] = wte[tokens[bt], :] + wpe[bt % T_len, :]. out: (BT, C); tokens: (BT);
// wte: (slice.count or V, C), the rows `slice` of the table (a token outside it adds 0);
// wpe: (>= T_len, C) or null (no positions). kVectorized: C is a whole number of packs
// and out, wte, wpe are pack-aligned.
template <class T, bool kVectorized>
__global__ void __launch_bounds__(kElementwiseThreads)
    encoder_forward_kernel(T* out, const std::int32_t* tokens, const T* wte, const T* wpe, std::int64_t BT,
                           std::int64_t T_len, std::int64_t C, RowSlice slice) {
  constexpr int kVec = kVectorized ? kPackWidth<T, T> : 1;
  using TPack = Pack<T, kVec>;
  const std::int64_t packs_per_row = C / kVec;
  const std::int64_t total = BT * packs_per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t bt = i / packs_per_row;
    const std::int64_t c = i % packs_per_row;  // in packs
    const std::int64_t t = bt % T_len;
    const std::int64_t token = tokens[bt];
    TPack po;
    if (slice.holds(token) && wpe != nullptr) {
      const TPack pw = reinterpret_cast<const TPack*>(wte + (token - slice.first) * C)[c];
      const TPack pp = reinterpret_cast<const TPack*>(wpe + t * C)[c];
#pragma unroll
      for (int k = 0; k < kVec; ++k) po.v[k] = store<T>(load(pw.v[k]) + load(pp.v[k]));
    } else if (slice.holds(token)) {
      po = reinterpret_cast<const TPack*>(wte + (token - slice.first) * C)[c];
    } else if (wpe != nullptr) {
      po = reinterpret_cast<const TPack*>(wpe + t * C)[c];
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) po.v[k] = store<T>(0.0f);
    }
    reinterpret_cast<TPack*>(out + bt * C)[c] = po;
  }
}

// positions[i] = i for i in [0, BT): the values the sort carries along with the tokens.
// (A template only so that the header may be included by several translation units.)
template <class Index>
__global__ void __launch_bounds__(kElementwiseThreads) iota_kernel(Index* positions, std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    positions[i] = static_cast<Index>(i);
  }
}

inline constexpr int kEncoderThreads = 128;

// dwte[token, c] += dout[p, c] for the positions p of each token's run, in ascending p.
// sorted_tokens, sorted_positions: (BT), the tokens sorted stably with their positions.
// Grid: (BT, ceil(C / kEncoderThreads)); a block whose blockIdx.x does not start a run,
// or whose token is outside `slice`, exits at once. dwte: (slice.count or V, C), the
// rows `slice` of the table, f32 main grads; dout: (BT, C).
template <class T>
__global__ void __launch_bounds__(kEncoderThreads)
    encoder_backward_wte_kernel(float* dwte, const T* dout, const std::int32_t* sorted_tokens,
                                const std::int32_t* sorted_positions, std::int32_t BT, std::int64_t C, RowSlice slice) {
  const std::int32_t head = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t token = sorted_tokens[head];
  if (head > 0 && sorted_tokens[head - 1] == token) return;  // not the first of its run
  if (!slice.holds(token)) return;                           // another rank's row
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * kEncoderThreads + threadIdx.x;
  if (c >= C) return;
  // The run is [head, end): keys are sorted, so binary-search the first key != token.
  std::int32_t lo = head + 1;
  std::int32_t hi = BT;
  while (lo < hi) {
    const std::int32_t mid = lo + (hi - lo) / 2;
    if (sorted_tokens[mid] == token)
      lo = mid + 1;
    else
      hi = mid;
  }
  const std::int32_t end = lo;
  float* target = dwte + (static_cast<std::int64_t>(token) - slice.first) * C + c;
  float acc = *target;
#pragma unroll 4
  for (std::int32_t k = head; k < end; ++k) acc += load(dout[static_cast<std::int64_t>(sorted_positions[k]) * C + c]);
  *target = acc;
}

// dwpe[t, c] += dout[b, t, c] for b = 0 .. B-1 in order. dwpe: (>= T_len, C) f32;
// dout: (B, T_len, C).
template <class T>
__global__ void __launch_bounds__(kElementwiseThreads)
    encoder_backward_wpe_kernel(float* dwpe, const T* dout, std::int64_t B, std::int64_t T_len, std::int64_t C) {
  const std::int64_t total = T_len * C;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    float acc = dwpe[i];
    for (std::int64_t b = 0; b < B; ++b) acc += load(dout[b * total + i]);
    dwpe[i] = acc;
  }
}
// act[r, j] = gate(pre[r, j]) · pre[r, hidden + j]: one element of act per iteration,
// computed as backend::cpu::glu_forward computes it (load to float, math::gate, one
// rounding).
template <math::Gate G, class T>
__global__ void __launch_bounds__(kElementwiseThreads)
    glu_forward_kernel(T* act, const T* pre, std::int64_t rows, std::int64_t hidden) {
  const std::int64_t total = rows * hidden;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t r = i / hidden, j = i - r * hidden;
    const T* g = pre + r * 2 * hidden;
    act[i] = store<T>(math::gate<G>(load(g[j])) * load(g[hidden + j]));
  }
}

// dpre[r, j] = dact · u · gate'(g), dpre[r, hidden + j] = dact · gate(g).
template <math::Gate G, class T>
__global__ void __launch_bounds__(kElementwiseThreads)
    glu_backward_kernel(T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden) {
  const std::int64_t total = rows * hidden;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t r = i / hidden, j = i - r * hidden;
    const T* g = pre + r * 2 * hidden;
    T* dg = dpre + r * 2 * hidden;
    const float x = load(g[j]), dy = load(dact[i]);
    dg[j] = store<T>(dy * load(g[hidden + j]) * math::gate_grad<G>(x));
    dg[hidden + j] = store<T>(dy * math::gate<G>(x));
  }
}

#endif  // __CUDACC__

// Launches map_kernel, vectorized when every pointer is aligned to its pack.
template <class Out, class In, int kInputs, class Op>
void launch_map(cudaStream_t stream, const char* name, Out* out, const In* a, const In* b, std::int64_t n, Op op) {
  if (n == 0) return;
  constexpr int kVec = kPackWidth<Out, In>;
  const bool vectorized = aligned_to(out, kVec * sizeof(Out)) && aligned_to(a, kVec * sizeof(In)) &&
                          (kInputs == 1 || aligned_to(b, kVec * sizeof(In)));
  if (vectorized) {
    map_kernel<Out, In, kInputs, true>
        <<<grid_for(ceil_div(n, kVec)), kElementwiseThreads, 0, stream>>>(out, a, b, n, op);
  } else {
    map_kernel<Out, In, kInputs, false><<<grid_for(n), kElementwiseThreads, 0, stream>>>(out, a, b, n, op);
  }
  LLMPAR_CHECK_LAUNCH(name);
}

// encoder_backward's workspace: [slack | sorted tokens | positions | sorted positions |
// CUB temp], each part starting on a 256-byte boundary of the device address (the
// slack absorbs a workspace pointer that is not 256-aligned itself).
inline constexpr std::size_t kWorkspaceAlignment = 256;

constexpr std::size_t align_up(std::size_t x) {
  return (x + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

inline std::size_t encoder_sort_temp_bytes(std::int32_t count) {
  std::size_t bytes = 0;
  if (count == 0) return 0;
  LLMPAR_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
                        nullptr, bytes, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
                        static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), count),
                    "sizing encoder_backward's radix sort");
  return bytes;
}

inline void check_encoder_shape(const char* op, std::int64_t B, std::int64_t T_len, std::int64_t C) {
  LLMPAR_CHECK(B >= 0 && T_len >= 0 && C >= 0, op, ": B = ", B, ", T_len = ", T_len, ", C = ", C,
               "; sizes must be >= 0");
  LLMPAR_CHECK(T_len == 0 || B <= std::numeric_limits<std::int32_t>::max() / T_len, op, ": B * T_len = ", B, " * ",
               T_len, " positions exceed 2^31 - 1 (positions are int32); use a smaller batch or sequence");
}

}  // namespace detail::ew

// out[i] = gelu(x[i]). out, x: (n); out may equal x.
template <Storage T>
void gelu_forward(cudaStream_t stream, T* out, const T* x, std::int64_t n) {
  detail::ew::check_count("gelu_forward", n);
  if (n == 0) return;
  detail::ew::check_pointer("gelu_forward", "out", out);
  detail::ew::check_pointer("gelu_forward", "x", x);
  detail::ew::check_same_or_disjoint("gelu_forward", "out", out, "x", x, n * sizeof(T));
  detail::ew::launch_map<T, T, 1>(stream, "gelu_forward", out, x, static_cast<const T*>(nullptr), n,
                                  detail::ew::GeluForwardOp<T>{});
}

// dx[i] = dout[i] * gelu'(x[i]) (overwritten, not accumulated). dx, x, dout: (n); dx may
// equal dout (or x).
template <Storage T>
void gelu_backward(cudaStream_t stream, T* dx, const T* x, const T* dout, std::int64_t n) {
  detail::ew::check_count("gelu_backward", n);
  if (n == 0) return;
  detail::ew::check_pointer("gelu_backward", "dx", dx);
  detail::ew::check_pointer("gelu_backward", "x", x);
  detail::ew::check_pointer("gelu_backward", "dout", dout);
  detail::ew::check_same_or_disjoint("gelu_backward", "dx", dx, "x", x, n * sizeof(T));
  detail::ew::check_same_or_disjoint("gelu_backward", "dx", dx, "dout", dout, n * sizeof(T));
  detail::ew::launch_map<T, T, 2>(stream, "gelu_backward", dx, x, dout, n, detail::ew::GeluBackwardOp<T>{});
}

namespace detail::ew {
inline void check_glu(const char* op, const char* out_name, const void* out, std::size_t out_bytes, const char* in_name,
                      const void* in, std::size_t in_bytes, std::int64_t rows, std::int64_t hidden) {
  LLMPAR_CHECK(rows >= 0 && hidden >= 0, op, ": rows = ", rows, ", hidden = ", hidden, "; sizes must be >= 0");
  LLMPAR_CHECK(!overlap(out, out_bytes, in, in_bytes), op, ": ", out_name, " overlaps ", in_name,
               "; a gated unit's output and input must be disjoint buffers");
}
}  // namespace detail::ew

// act (rows, hidden) = gate(g) · u, each row of pre (rows, 2·hidden) being the hidden
// gate inputs g, then the hidden up values u (SwiGLU: Gate::silu, GeGLU: Gate::gelu).
// act and pre are disjoint.
template <Storage T>
void glu_forward(cudaStream_t stream, T* act, const T* pre, std::int64_t rows, std::int64_t hidden, math::Gate gate) {
  const std::size_t n = static_cast<std::size_t>(rows * hidden);
  detail::ew::check_glu("glu_forward", "act", act, n * sizeof(T), "pre", pre, 2 * n * sizeof(T), rows, hidden);
  if (n == 0) return;
  detail::ew::check_pointer("glu_forward", "act", act);
  detail::ew::check_pointer("glu_forward", "pre", pre);
  const unsigned grid = detail::ew::grid_for(rows * hidden);
  if (gate == math::Gate::silu)
    detail::ew::glu_forward_kernel<math::Gate::silu>
        <<<grid, detail::ew::kElementwiseThreads, 0, stream>>>(act, pre, rows, hidden);
  else
    detail::ew::glu_forward_kernel<math::Gate::gelu>
        <<<grid, detail::ew::kElementwiseThreads, 0, stream>>>(act, pre, rows, hidden);
  LLMPAR_CHECK_LAUNCH("glu_forward");
}

// dpre (rows, 2·hidden) = [dact · u · gate'(g), dact · gate(g)] per row (overwritten),
// from dact (rows, hidden) and the forward's pre. dpre is disjoint from dact and pre.
template <Storage T>
void glu_backward(cudaStream_t stream, T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden,
                  math::Gate gate) {
  const std::size_t n = static_cast<std::size_t>(rows * hidden);
  detail::ew::check_glu("glu_backward", "dpre", dpre, 2 * n * sizeof(T), "pre", pre, 2 * n * sizeof(T), rows, hidden);
  detail::ew::check_glu("glu_backward", "dpre", dpre, 2 * n * sizeof(T), "dact", dact, n * sizeof(T), rows, hidden);
  if (n == 0) return;
  detail::ew::check_pointer("glu_backward", "dpre", dpre);
  detail::ew::check_pointer("glu_backward", "dact", dact);
  detail::ew::check_pointer("glu_backward", "pre", pre);
  const unsigned grid = detail::ew::grid_for(rows * hidden);
  if (gate == math::Gate::silu)
    detail::ew::glu_backward_kernel<math::Gate::silu>
        <<<grid, detail::ew::kElementwiseThreads, 0, stream>>>(dpre, dact, pre, rows, hidden);
  else
    detail::ew::glu_backward_kernel<math::Gate::gelu>
        <<<grid, detail::ew::kElementwiseThreads, 0, stream>>>(dpre, dact, pre, rows, hidden);
  LLMPAR_CHECK_LAUNCH("glu_backward");
}

// out[i] = a[i] + b[i] (the residual connection). out, a, b: (n); out may equal a or b.
template <Storage T>
void add(cudaStream_t stream, T* out, const T* a, const T* b, std::int64_t n) {
  detail::ew::check_count("add", n);
  if (n == 0) return;
  detail::ew::check_pointer("add", "out", out);
  detail::ew::check_pointer("add", "a", a);
  detail::ew::check_pointer("add", "b", b);
  detail::ew::check_same_or_disjoint("add", "out", out, "a", a, n * sizeof(T));
  detail::ew::check_same_or_disjoint("add", "out", out, "b", b, n * sizeof(T));
  detail::ew::launch_map<T, T, 2>(stream, "add", out, a, b, n, detail::ew::AddOp<T>{});
}

// a[i] += b[i] (a residual branch's gradient into the stream). a, b: (n).
template <Storage T>
void add_inplace(cudaStream_t stream, T* a, const T* b, std::int64_t n) {
  detail::ew::check_count("add_inplace", n);
  if (n == 0) return;
  detail::ew::check_pointer("add_inplace", "a", a);
  detail::ew::check_pointer("add_inplace", "b", b);
  detail::ew::check_same_or_disjoint("add_inplace", "a", a, "b", b, n * sizeof(T));
  detail::ew::launch_map<T, T, 2>(stream, "add_inplace", a, a, b, n, detail::ew::AddOp<T>{});
}

// a[i] *= s (µP's output multiplier on the LM head's input and its gradient). a: (n).
template <Storage T>
void scale_inplace(cudaStream_t stream, T* a, float s, std::int64_t n) {
  detail::ew::check_count("scale_inplace", n);
  if (n == 0) return;
  detail::ew::check_pointer("scale_inplace", "a", a);
  detail::ew::launch_map<T, T, 1>(stream, "scale_inplace", a, a, static_cast<const T*>(nullptr), n,
                                  detail::ew::ScaleOp<T>{s});
}

// out[i] = To(in[i]) (master weights, mixed precision). out, in: (n); they may be the
// same buffer only when To and From are the same type.
template <Storage To, Storage From>
void convert(cudaStream_t stream, To* out, const From* in, std::int64_t n) {
  detail::ew::check_count("convert", n);
  if (n == 0) return;
  detail::ew::check_pointer("convert", "out", out);
  detail::ew::check_pointer("convert", "in", in);
  if constexpr (std::is_same_v<To, From>) {
    detail::ew::check_same_or_disjoint("convert", "out", out, "in", in, n * sizeof(To));
  } else {
    LLMPAR_CHECK(!detail::ew::overlap(out, n * sizeof(To), in, n * sizeof(From)),
                 "convert: out and in overlap; a conversion between types of different sizes needs disjoint buffers");
  }
  detail::ew::launch_map<To, From, 1>(stream, "convert", out, in, static_cast<const From*>(nullptr), n,
                                      detail::ew::ConvertOp<To, From>{});
}

// y[r, :] += bias for every row. y: (rows, n); bias: (n).
template <Storage T>
void bias_add(cudaStream_t stream, T* y, const T* bias, std::int64_t rows, std::int64_t n) {
  LLMPAR_CHECK(rows >= 0 && n >= 0, "bias_add: rows = ", rows, ", n = ", n, "; sizes must be >= 0");
  if (rows == 0 || n == 0) return;
  detail::ew::check_pointer("bias_add", "y", y);
  detail::ew::check_pointer("bias_add", "bias", bias);
  LLMPAR_CHECK(!detail::ew::overlap(y, rows * n * sizeof(T), bias, n * sizeof(T)),
               "bias_add: y and bias overlap; the bias must be a separate buffer");
  constexpr int kVec = detail::ew::kPackWidth<T, T>;
  const bool vectorized =
      n % kVec == 0 && detail::ew::aligned_to(y, kVec * sizeof(T)) && detail::ew::aligned_to(bias, kVec * sizeof(T));
  if (vectorized) {
    detail::ew::bias_add_kernel<T, true>
        <<<detail::ew::grid_for(rows * (n / kVec)), detail::ew::kElementwiseThreads, 0, stream>>>(y, bias, rows, n);
  } else {
    detail::ew::bias_add_kernel<T, false>
        <<<detail::ew::grid_for(rows * n), detail::ew::kElementwiseThreads, 0, stream>>>(y, bias, rows, n);
  }
  LLMPAR_CHECK_LAUNCH("bias_add_kernel");
}

// Floats of workspace bias_backward needs for dout of (rows, n).
inline std::int64_t bias_backward_workspace(std::int64_t rows, std::int64_t n) {
  LLMPAR_CHECK(rows >= 0 && n >= 0, "bias_backward_workspace: rows = ", rows, ", n = ", n, "; sizes must be >= 0");
  return detail::ew::bias_slices(rows) * n;
}

// dbias[j] += sum over r of dout[r, j]. dbias: (n) f32 main grads; dout: (rows, n);
// workspace: bias_backward_workspace(rows, n) device floats. Deterministic (see the note
// on top).
template <Storage T>
void bias_backward(cudaStream_t stream, float* dbias, const T* dout, float* workspace, std::int64_t rows,
                   std::int64_t n) {
  LLMPAR_CHECK(rows >= 0 && n >= 0, "bias_backward: rows = ", rows, ", n = ", n, "; sizes must be >= 0");
  if (n == 0) return;
  detail::ew::check_pointer("bias_backward", "dbias", dbias);
  LLMPAR_CHECK(workspace != nullptr, "bias_backward: workspace is nullptr; pass bias_backward_workspace(", rows, ", ",
               n, ") = ", bias_backward_workspace(rows, n), " device floats");
  if (rows > 0) detail::ew::check_pointer("bias_backward", "dout", dout);
  const std::int64_t slices = detail::ew::bias_slices(rows);
  const std::int64_t rows_per_slice = std::max<std::int64_t>(1, ceil_div(rows, slices));
  const std::int64_t column_blocks = ceil_div(n, detail::ew::kBiasColumns);
  LLMPAR_CHECK(column_blocks <= std::numeric_limits<std::int32_t>::max(), "bias_backward: n = ", n,
               " needs more than 2^31 - 1 blocks of ", detail::ew::kBiasColumns, " columns");
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(slices));
  const dim3 block(detail::ew::kBiasColumns, detail::ew::kBiasRowThreads);
  detail::ew::bias_partials_kernel<T><<<grid, block, 0, stream>>>(dout, workspace, rows, n, rows_per_slice);
  LLMPAR_CHECK_LAUNCH("bias_partials_kernel");
  detail::ew::bias_finish_kernel<>
      <<<detail::ew::grid_for(n), detail::ew::kElementwiseThreads, 0, stream>>>(dbias, workspace, slices, n);
  LLMPAR_CHECK_LAUNCH("bias_finish_kernel");
}

// out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]. out: (B, T_len, C); tokens: (B, T_len)
// in [0, V); wte: (slice.count or V, C), the rows `slice` of the token table (a token
// outside it adds 0: its row is another rank's); wpe: (>= T_len, C), or null for none.
template <Storage T>
void encoder_forward(cudaStream_t stream, T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                     std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {}) {
  detail::ew::check_encoder_shape("encoder_forward", B, T_len, C);
  const std::int64_t BT = B * T_len;
  if (BT == 0 || C == 0) return;
  detail::ew::check_pointer("encoder_forward", "out", out);
  detail::ew::check_pointer("encoder_forward", "tokens", tokens);
  detail::ew::check_pointer("encoder_forward", "wte", wte);
  constexpr int kVec = detail::ew::kPackWidth<T, T>;
  const bool vectorized = C % kVec == 0 && detail::ew::aligned_to(out, kVec * sizeof(T)) &&
                          detail::ew::aligned_to(wte, kVec * sizeof(T)) &&
                          detail::ew::aligned_to(wpe, kVec * sizeof(T));
  if (vectorized) {
    detail::ew::encoder_forward_kernel<T, true>
        <<<detail::ew::grid_for(BT * (C / kVec)), detail::ew::kElementwiseThreads, 0, stream>>>(out, tokens, wte, wpe,
                                                                                                BT, T_len, C, slice);
  } else {
    detail::ew::encoder_forward_kernel<T, false>
        <<<detail::ew::grid_for(BT * C), detail::ew::kElementwiseThreads, 0, stream>>>(out, tokens, wte, wpe, BT, T_len,
                                                                                       C, slice);
  }
  LLMPAR_CHECK_LAUNCH("encoder_forward_kernel");
}

// Bytes of workspace encoder_backward needs for tokens of (B, T_len). Asks CUB for its
// sort's scratch size, so it needs a current CUDA device.
inline std::int64_t encoder_backward_workspace_bytes(std::int64_t B, std::int64_t T_len) {
  detail::ew::check_encoder_shape("encoder_backward_workspace_bytes", B, T_len, 0);
  const std::int64_t BT = B * T_len;
  if (BT == 0) return 0;
  const std::size_t ints = detail::ew::align_up(static_cast<std::size_t>(BT) * sizeof(std::int32_t));
  return static_cast<std::int64_t>(
      detail::ew::kWorkspaceAlignment + 3 * ints +
      detail::ew::align_up(detail::ew::encoder_sort_temp_bytes(static_cast<std::int32_t>(BT))));
}

// dwte[tokens[b, t], :] += dout[b, t, :] and dwpe[t, :] += dout[b, t, :], in f32 and in
// the CPU kernel's order (positions ascending), so the result is its bits. dwte:
// (slice.count or V, C) f32, the rows `slice` of the table (other tokens are skipped);
// dwpe: (>= T_len, C) f32 or null (none); dout: (B, T_len, C); tokens: (B, T_len) in
// [0, V); workspace: encoder_backward_workspace_bytes(B, T_len) device bytes.
template <Storage T>
void encoder_backward(cudaStream_t stream, float* dwte, float* dwpe, const T* dout, const std::int32_t* tokens,
                      void* workspace, std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {}) {
  detail::ew::check_encoder_shape("encoder_backward", B, T_len, C);
  const std::int64_t BT = B * T_len;
  if (BT == 0 || C == 0) return;
  detail::ew::check_pointer("encoder_backward", "dwte", dwte);
  detail::ew::check_pointer("encoder_backward", "dout", dout);
  detail::ew::check_pointer("encoder_backward", "tokens", tokens);
  LLMPAR_CHECK(workspace != nullptr, "encoder_backward: workspace is nullptr; pass encoder_backward_workspace_bytes(",
               B, ", ", T_len, ") device bytes");
  const std::int64_t column_blocks = ceil_div(C, detail::ew::kEncoderThreads);
  LLMPAR_CHECK(column_blocks <= 65535, "encoder_backward: C = ", C, " exceeds ", 65535 * detail::ew::kEncoderThreads,
               " columns (65535 blocks of ", detail::ew::kEncoderThreads, ")");
  LLMPAR_CHECK(dwte != dwpe, "encoder_backward: dwte and dwpe are the same buffer; they are separate gradients");

  const auto count = static_cast<std::int32_t>(BT);
  const std::size_t ints = detail::ew::align_up(static_cast<std::size_t>(BT) * sizeof(std::int32_t));
  std::size_t sort_bytes = detail::ew::encoder_sort_temp_bytes(count);
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(workspace);
  auto* parts = reinterpret_cast<std::byte*>((base + detail::ew::kWorkspaceAlignment - 1) /
                                             detail::ew::kWorkspaceAlignment * detail::ew::kWorkspaceAlignment);
  auto* sorted_tokens = reinterpret_cast<std::int32_t*>(parts);                // (BT)
  auto* positions = reinterpret_cast<std::int32_t*>(parts + ints);             // (BT)
  auto* sorted_positions = reinterpret_cast<std::int32_t*>(parts + 2 * ints);  // (BT)
  void* sort_temp = parts + 3 * ints;

  detail::ew::iota_kernel<std::int32_t>
      <<<detail::ew::grid_for(BT), detail::ew::kElementwiseThreads, 0, stream>>>(positions, count);
  LLMPAR_CHECK_LAUNCH("iota_kernel");
  // LSD radix sort is stable: equal tokens keep their positions in ascending order.
  LLMPAR_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, tokens, sorted_tokens,
                                                    static_cast<const std::int32_t*>(positions), sorted_positions,
                                                    count, 0, static_cast<int>(8 * sizeof(std::int32_t)), stream),
                    "sorting the tokens in encoder_backward");
  const dim3 grid(static_cast<unsigned>(BT), static_cast<unsigned>(column_blocks));
  detail::ew::encoder_backward_wte_kernel<T>
      <<<grid, detail::ew::kEncoderThreads, 0, stream>>>(dwte, dout, sorted_tokens, sorted_positions, count, C, slice);
  LLMPAR_CHECK_LAUNCH("encoder_backward_wte_kernel");
  if (dwpe == nullptr) return;
  detail::ew::encoder_backward_wpe_kernel<T>
      <<<detail::ew::grid_for(T_len * C), detail::ew::kElementwiseThreads, 0, stream>>>(dwpe, dout, B, T_len, C);
  LLMPAR_CHECK_LAUNCH("encoder_backward_wpe_kernel");
}

// Σ x[i]² over x (n floats) in double, deterministic: each of a fixed number of blocks
// sums a strided share and writes one partial; the host adds the partials in block order
// (what a gradient-norm shard needs, not a hot path: one call per shard segment a step).
namespace detail::ew {
inline constexpr int kSquaresThreads = 256;
inline constexpr int kSquaresBlocks = 256;
#if defined(__CUDACC__)
// A template (of the element type, float here) like every kernel of a header: a
// non-template __global__ function would be defined again in every translation unit
// that includes this one, which the linker refuses.
template <class T>
__global__ void __launch_bounds__(kSquaresThreads)
    squares_partials_kernel(const T* x, std::int64_t n, double* partials) {
  __shared__ double part[kSquaresThreads];
  double s = 0.0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = x[i];
    s += v * v;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kSquaresThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = part[0];
}
#endif
}  // namespace detail::ew

// Doubles of device workspace sum_of_squares needs.
inline constexpr std::int64_t kSumOfSquaresWorkspace = detail::ew::kSquaresBlocks;

// Σ x² (x: n device floats), returned on the host; waits for the stream.
inline double sum_of_squares(cudaStream_t stream, const float* x, std::int64_t n, double* workspace) {
  if (n <= 0) return 0.0;
  detail::ew::squares_partials_kernel<float>
      <<<detail::ew::kSquaresBlocks, detail::ew::kSquaresThreads, 0, stream>>>(x, n, workspace);
  LLMPAR_CHECK_LAUNCH("squares_partials_kernel");
  double host[detail::ew::kSquaresBlocks];
  LLMPAR_CHECK_CUDA(cudaMemcpyAsync(host, workspace, sizeof(host), cudaMemcpyDeviceToHost, stream));
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));
  double total = 0.0;
  for (double v : host) total += v;
  return total;
}

}  // namespace llmpar::kernels
