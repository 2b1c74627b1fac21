// Ring attention's block operations on CUDA (backend::Cuda's attention_state_init,
// attention_block_forward, attention_state_finish, attention_dsum and
// attention_block_backward; kernels/attention_block.cuh) against their references, on a GPU.
//
//   - the cases of tests/cuda/attention_block_check.hpp, which
//     test_cuda_emulation_attention_block (a cpu test) runs on the CPU through the host
//     emulation: each block operation against the CPU block kernels for float, bf16 and
//     f16 (grouped-query 4 on 2 and 4 on 1, multi-head; head sizes 32, 64 and 80; causal
//     diagonal blocks and unmasked blocks off the diagonal; keys from qkv, a packed copy
//     and a wider buffer with v before k), and rings of 1, 2 and 4 ranks composed into the
//     whole causal sequence against the whole-sequence CPU kernels; the same tolerances;
//   - through backend::Cuda, as nn::ContextParallelCore calls it (which must then take
//     the ring: checked at compile time);
//   - every block case twice: the same bits;
//   - the host-side errors (a block that does not fit, an unsupported head size) throw
//     before any CUDA call; they run first, also where there is no device;
//   - the speed of one large bf16 block, forward and backward (reported, not checked).
// Exit codes: 0 pass, 1 failure, 77 no CUDA device.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention_block_check.hpp"
#include "gpu_test.hpp"
#include "llmpar/backend/cuda/backend.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/kernels/attention_block.cuh"
#include "llmpar/nn/context_parallel.hpp"

namespace {

using llmpar::AttentionBlock;
using llmpar::AttentionShape;
using llmpar::AttentionState;
using llmpar::bf16;
using llmpar::f16;
using llmpar::backend::Cuda;
using llmpar::backend::cuda::DeviceBuffer;
namespace blocks = llmpar::attention_block_check;
namespace gpu_test = llmpar::gpu_test;
using gpu_test::expect;

static_assert(llmpar::nn::detail::ContextParallelCore<float, Cuda>::kRing &&
                  llmpar::nn::detail::ContextParallelCore<bf16, Cuda>::kRing &&
                  llmpar::nn::detail::ContextParallelCore<f16, Cuda>::kRing,
              "backend::Cuda has every operation ring attention needs");

constexpr gpu_test::ExpectError expect_error{gpu_test::ErrorWording::lacks_message_last};

void check_host_errors() {
  namespace kernels = llmpar::kernels;
  float f = 0.f;
  const AttentionState<float> st{&f, &f, &f};
  const AttentionShape s{1, 16, 2, 2, 32};
  const AttentionBlock past_end{.q_first = 8, .kv_seq = 16, .kv_first = 0, .len = 9, .kv_stride = 128, .v_offset = 64};
  expect_error([&] { kernels::attention_block_forward<float>(nullptr, st, &f, &f, s, past_end); },
               "a block of 9 rows at query row 8", "forward: a block past the end");
  expect_error([&] { kernels::attention_block_backward<float>(nullptr, &f, &f, &f, &f, &f, &f, &f, s, past_end); },
               "does not fit sequences of 16 query and 16 key rows", "backward: a block past the end");
  const AttentionBlock narrow{.kv_seq = 16, .len = 4, .kv_stride = 100, .k_offset = 0, .v_offset = 64};
  expect_error([&] { kernels::attention_block_forward<float>(nullptr, st, &f, &f, s, narrow); },
               "key rows of 100 elements cannot hold k at 0 and v at 64", "forward: key rows too narrow");
  const AttentionShape odd{1, 16, 2, 2, 12};
  expect_error([&] { kernels::attention_state_init(nullptr, st, odd); },
               "supported head sizes are the multiples of 8 from 16 to 256", "state_init: hs = 12");
  expect_error([&] { kernels::attention_state_finish<float>(nullptr, &f, &f, st, odd); },
               "head size head_dim = 12 is not supported", "state_finish: hs = 12");
}

// attention_block_check's Device on a GPU: device buffers, the operations through
// backend::Cuda on one context. Every get() is kept, as bytes, for the determinism check.
class GpuDevice {
 public:
  explicit GpuDevice(Cuda::Context& ctx) : ctx_(ctx) {}

  template <class E>
  E* put(const std::vector<E>& host) {
    auto held = std::make_unique<Held<E>>(DeviceBuffer<E>(host.size(), ctx_.stream()));
    E* p = held->buffer.data();
    Cuda::upload(ctx_, p, host.data(), static_cast<std::int64_t>(host.size()));
    buffers_.push_back(std::move(held));
    return p;
  }
  template <class E>
  std::vector<E> get(const E* p, std::size_t n) {
    std::vector<E> v(n);
    Cuda::download(ctx_, v.data(), p, static_cast<std::int64_t>(n));
    const auto* bytes = reinterpret_cast<const unsigned char*>(v.data());
    gets_.emplace_back(bytes, bytes + n * sizeof(E));
    return v;
  }
  const std::vector<std::vector<unsigned char>>& gets() const { return gets_; }

  void state_init(const AttentionState<float>& st, const AttentionShape& s) { Cuda::attention_state_init(ctx_, st, s); }
  template <class T>
  void block_forward(const AttentionState<float>& st, const T* qkv, const T* kv, const AttentionShape& s,
                     const AttentionBlock& blk) {
    Cuda::attention_block_forward(ctx_, st, qkv, kv, s, blk);
  }
  template <class T>
  void state_finish(T* out, float* lse, const AttentionState<float>& st, const AttentionShape& s) {
    Cuda::attention_state_finish(ctx_, out, lse, st, s);
  }
  template <class T>
  void dsum(float* d, const T* dout, const T* out, const AttentionShape& s) {
    Cuda::attention_dsum(ctx_, d, dout, out, s);
  }
  template <class T>
  void block_backward(float* dq, float* dkv, const T* dout, const T* qkv, const T* kv, const float* lse,
                      const float* dsum, const AttentionShape& s, const AttentionBlock& blk) {
    Cuda::attention_block_backward(ctx_, dq, dkv, dout, qkv, kv, lse, dsum, s, blk);
  }

 private:
  struct HeldBase {
    virtual ~HeldBase() = default;
  };
  template <class E>
  struct Held : HeldBase {
    explicit Held(DeviceBuffer<E>&& b) : buffer(std::move(b)) {}
    DeviceBuffer<E> buffer;
  };
  Cuda::Context& ctx_;
  std::vector<std::unique_ptr<HeldBase>> buffers_;
  std::vector<std::vector<unsigned char>> gets_;
};

void report(const std::string& name, const blocks::Ratios& r, bool reproducible) {
  gpu_test::report(r.pass() && reproducible, name + ": error/tolerance " + r.describe() +
                                                 (reproducible ? "; bitwise reproducible" : "; NOT reproducible"));
}

template <class T>
void run_all(Cuda::Context& ctx) {
  for (const blocks::BlockCase& c : blocks::block_cases()) {
    GpuDevice first(ctx), second(ctx);
    const blocks::Ratios r = blocks::block_case<T>(first, c);
    static_cast<void>(blocks::block_case<T>(second, c));
    report(blocks::block_case_name<T>(c), r, first.gets() == second.gets());
  }
  for (const blocks::RingCase& c : blocks::ring_cases()) {
    GpuDevice dev(ctx);
    report(blocks::ring_case_name<T>(c.whole, c.cp), blocks::ring_case<T>(dev, c.whole, c.cp), true);
  }
}

// One causal diagonal block of `len` rows at hs 128, bf16, Llama-3-8B's heads (reported).
void report_speed(Cuda::Context& ctx, std::int64_t len) {
  using llmpar::backend::cuda::Event;
  const cudaStream_t stream = ctx.stream();
  const AttentionShape s{1, len, 32, 8, 128};
  const std::int64_t rows = s.batch * s.seq, states = s.batch * s.heads * s.seq;
  DeviceBuffer<bf16> qkv(rows * s.row(), stream), dout(rows * s.q_dim(), stream);
  DeviceBuffer<float> o(rows * s.q_dim(), stream), m(states, stream), l(states, stream), lse(states, stream);
  DeviceBuffer<float> dsum(states, stream), dq(rows * s.q_dim(), stream), dkv(rows * 2 * s.kv_dim(), stream);
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(qkv.data(), 0, qkv.bytes(), stream));
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(dout.data(), 0, dout.bytes(), stream));
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(dsum.data(), 0, dsum.bytes(), stream));
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(dq.data(), 0, dq.bytes(), stream));
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(dkv.data(), 0, dkv.bytes(), stream));
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(lse.data(), 0, lse.bytes(), stream));
  const AttentionState<float> st{o.data(), m.data(), l.data()};
  const AttentionBlock blk{.q_first = 0,
                           .kv_seq = s.seq,
                           .kv_first = 0,
                           .len = len,
                           .kv_stride = s.row(),
                           .k_offset = s.q_dim(),
                           .v_offset = s.q_dim() + s.kv_dim(),
                           .causal = true};
  Cuda::attention_state_init(ctx, st, s);
  Cuda::attention_block_forward(ctx, st, qkv.data(), qkv.data(), s, blk);  // warm-up
  Event start(Event::Timing::on), mid(Event::Timing::on), stop(Event::Timing::on);
  start.record(stream);
  Cuda::attention_block_forward(ctx, st, qkv.data(), qkv.data(), s, blk);
  mid.record(stream);
  Cuda::attention_block_backward(ctx, dq.data(), dkv.data(), dout.data(), qkv.data(), qkv.data(), lse.data(),
                                 dsum.data(), s, blk);
  stop.record(stream);
  stop.synchronize();
  const double flops = 4.0 * s.batch * s.heads * len * len * s.head_dim / 2;  // causal q k^T and p v
  const double fwd_ms = mid.ms_since(start), bwd_ms = stop.ms_since(mid);
  std::printf(
      "speed  causal bf16 block len=%lld hs=128 NH=32 KVH=8: forward %.3f ms (%.1f TFLOP/s), backward %.3f ms "
      "(%.1f TFLOP/s at 2.5x forward FLOPs)\n",
      static_cast<long long>(len), fwd_ms, flops / fwd_ms * 1e-9, bwd_ms, 2.5 * flops / bwd_ms * 1e-9);
}

}  // namespace

int main() {
  if (!gpu_test::run_host_checks(check_host_errors, "host-side checks")) return 1;
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("skipped: no CUDA device (host-side checks %s)\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    Cuda::Context ctx(0);
    run_all<float>(ctx);
    run_all<bf16>(ctx);
    run_all<f16>(ctx);
    report_speed(ctx, 2048);
  });
}
