// Flash attention on CUDA (kernels/attention.cuh) against its references.
//
//   - causal: forward (out, lse) and backward (dqkv) against the CPU backend's kernel
//     (backend/cpu/attention.hpp) on the same stored inputs, for float, bf16 and f16,
//     hs = 16, 32, 64, 80, 128 and 256 (80 runs zero-padded in the kernels compiled for
//     128, 16 in those for 32), and T = 1, 17, 64, 65, 200 with B * NH up to 6; the
//     backward of both is fed the CPU forward's out and lse, so each kernel is checked
//     on its own;
//   - no mask: forward and backward against a naive softmax attention in double;
//   - grouped-query attention (NH / KVH = 2, 3, 4; KVH = 1 multi-query) at hs = 16, 64,
//     80 and 128, T = 1, 17, 65, 130 and 200, causal against the CPU kernel (and once
//     against the double reference), no mask against the double reference;
//   - every output element is written (outputs are pre-filled with NaN);
//   - forward and backward are bitwise reproducible run to run;
//   - bf16/f16 run the forward's tensor-core path (the launcher picks it); a qkv view
//     offset by one element (not 16-byte aligned) runs the SIMT path instead, and both
//     agree with the reference;
//   - the host-side errors (hs = 12, 20, 264: not multiples of 8 from 16 to 256; kv heads
//     not dividing the query heads; a negative B; no workspace) throw before any CUDA
//     call; they run first, also where there is no device.
// The references, tolerances and case inputs are tests/cuda/attention_check.hpp's, which
// test_cuda_emulation_attention (a cpu test) shares: it runs these kernels on the CPU.
// Tolerances, as |gpu - ref| <= ulps * ulp_T(ref) + rel * max|ref| per tensor: float
// rel 2e-5 forward, 5e-5 backward (ulps 0); bf16/f16 the same rel plus 2 ulps of the
// storage type (both sides round their float results, which differ in the last float
// bits because the tiles differ). The tensor-core forward rounds p to T before p v (the
// mma takes 16-bit operands; the softmax sum uses p unrounded), an error of at most
// u_T |v| per row, u_T the unit roundoff of T (2^-8 bf16, 2^-11 f16): its out tolerance
// is 2 ulps + u_T * max|ref| (its lse keeps rel 2e-5: s is accumulated in f32 from exact
// products). A padded head size has the same tolerances: the padding adds exact zeros.
// In the host emulation (one fiber per CUDA thread, mma and ldmatrix emulated from the
// PTX ISA; test_cuda_emulation_attention) the worst ratio over its 356 cases, head sizes
// 16 to 256, 61 of them grouped-query, was 0.49; each bug injected there (a store without
// its column guard, a head offset from the compiled head size, swapped ldmatrix matrices,
// a missing barrier, the tensor-core store without its guard, a causal mask off by one, a
// wrong first query tile of dk/dv) failed 63 to 195 of the 291 cases it then had, with
// ratios from 60 to 30000, NaN, or writes outside the outputs; of the grouped-query
// bugs, dk/dv from the group's first query head only failed all 61 grouped-query cases,
// and query head h reading kv head h / (NH / KVH) failed the 34 of them with KVH > 1.
// A summary line per case gives the worst ratio of error to tolerance.
// Exit codes: 0 pass, 1 failure, 77 no CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_check.hpp"
#include "gpu_test.hpp"
#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/kernels/attention.cuh"

namespace {

using llmpar::bf16;
using llmpar::f16;
using llmpar::backend::cuda::DeviceBuffer;
using llmpar::backend::cuda::DeviceContext;
using llmpar::kernels::AttentionMask;
namespace gpu_test = llmpar::gpu_test;

using gpu_test::download;
using gpu_test::ErrorWording;
using gpu_test::expect;
using gpu_test::ExpectError;
using gpu_test::same_bits;

constexpr ExpectError expect_error{ErrorWording::lacks_message_last};

// The host-side checks: each throws before anything touches CUDA.
void check_host_errors() {
  using namespace llmpar::kernels;
  using llmpar::AttentionShape;
  float lse = 0.f, ws = 0.f;
  bf16 x{};
  // hs = 12, 20, 264: not multiples of 8 from 16 to 256.
  expect_error([&] { attention_forward<bf16>(nullptr, &x, &lse, &x, AttentionShape::mha(1, 8, 24, 2)); },
               "head size head_dim = 12 is not supported", "forward hs = 12");
  expect_error([&] { attention_forward<bf16>(nullptr, &x, &lse, &x, AttentionShape::mha(1, 8, 40, 2)); },
               "supported head sizes are the multiples of 8 from 16 to 256",
               "forward hs = 20 names the supported sizes");
  expect_error([&] { attention_forward<float>(nullptr, &lse, &lse, &lse, AttentionShape::mha(1, 8, 528, 2)); },
               "head size head_dim = 264 is not supported", "forward hs = 264");
  expect_error([&] { attention_backward<bf16>(nullptr, &x, &x, &x, &x, &lse, &ws, AttentionShape::mha(1, 8, 24, 2)); },
               "head size head_dim = 12 is not supported", "backward hs = 12");
  expect_error(
      [&] {
        attention_backward<f16>(nullptr, nullptr, nullptr, nullptr, nullptr, &lse, &ws,
                                AttentionShape::mha(1, 8, 528, 2));
      },
      "supported head sizes are the multiples of 8 from 16 to 256", "backward hs = 264");
  expect_error([] { static_cast<void>(attention_backward_workspace(AttentionShape::mha(1, 8, 40, 2))); },
               "head size head_dim = 20", "workspace hs = 20");
  // 3 kv heads cannot be shared by 4 query heads.
  const AttentionShape uneven{1, 8, 4, 3, 64};
  expect_error([&] { attention_forward<float>(nullptr, &lse, &lse, &lse, uneven); },
               "kv_heads = 3 does not divide the query heads 4", "forward heads % kv_heads");
  expect_error([&] { attention_backward<f16>(nullptr, nullptr, nullptr, nullptr, nullptr, &lse, &ws, uneven); },
               "kv_heads = 3 does not divide the query heads 4", "backward heads % kv_heads");
  expect_error([&] { attention_forward<float>(nullptr, &lse, &lse, &lse, AttentionShape::mha(-1, 8, 64, 1)); },
               "B = -1, T = 8", "forward negative B");
  expect_error(
      [&] {
        attention_backward<float>(nullptr, &lse, &lse, &lse, &lse, &lse, nullptr, AttentionShape::mha(1, 8, 64, 1));
      },
      "workspace is null", "backward without a workspace");
  expect(attention_backward_workspace(AttentionShape::mha(2, 17, 192, 3)) == 2 * 3 * 17,
         "workspace size is B * NH * T floats");
  expect(attention_backward_workspace(AttentionShape{2, 17, 8, 2, 64}) == 2 * 8 * 17,
         "workspace size is B * NH * T floats under grouped-query attention (one D per query head)");
  expect(attention_backward_workspace(AttentionShape::mha(1, 5, 48, 3)) == 15, "hs = 16 is supported");
  expect(attention_backward_workspace(AttentionShape::mha(1, 5, 512, 2)) == 10, "hs = 256 is supported");
}

namespace check = llmpar::attention_check;
using check::Shape;

// Fills a device buffer with NaN bytes, so an element a kernel forgets to write shows.
template <class T>
void poison(DeviceBuffer<T>& buffer, cudaStream_t stream) {
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(buffer.data(), 0xFF, buffer.bytes(), stream));
}

// One case: GPU forward and backward against the reference for `mask`, plus determinism.
template <class T>
void run_case(const DeviceContext& context, const llmpar::AttentionShape& s, AttentionMask mask,
              std::optional<check::Reference> chosen = std::nullopt) {
  namespace kernels = llmpar::kernels;
  const cudaStream_t stream = context.compute();
  const bool causal = mask == AttentionMask::causal;
  const check::Reference reference = chosen.value_or(check::default_reference(causal));
  const check::Case<T> c = check::make_case<T>(s, causal, reference);
  const std::size_t n_qkv = c.qkv.size(), n_out = c.ref_out.size(), n_lse = c.ref_lse.size();

  DeviceBuffer<T> d_qkv(n_qkv, stream), d_dout(n_out, stream), d_out(n_out, stream), d_ref_out(n_out, stream);
  DeviceBuffer<T> d_dqkv(n_qkv, stream);
  DeviceBuffer<float> d_lse(n_lse, stream), d_ref_lse(n_lse, stream);
  DeviceBuffer<float> d_ws(static_cast<std::size_t>(kernels::attention_backward_workspace(s)), stream);
  d_qkv.upload(c.qkv);
  d_dout.upload(c.dout);
  d_ref_out.upload(c.ref_out);
  d_ref_lse.upload(c.ref_lse);

  // Forward, twice.
  poison(d_out, stream);
  poison(d_lse, stream);
  kernels::attention_forward<T>(stream, d_out.data(), d_lse.data(), d_qkv.data(), s, mask);
  const std::vector<T> out1 = download(d_out);
  const std::vector<float> lse1 = download(d_lse);
  poison(d_out, stream);
  poison(d_lse, stream);
  kernels::attention_forward<T>(stream, d_out.data(), d_lse.data(), d_qkv.data(), s, mask);
  const std::vector<T> out2 = download(d_out);
  const std::vector<float> lse2 = download(d_lse);

  // Backward, twice, on the reference's out and lse.
  poison(d_dqkv, stream);
  kernels::attention_backward<T>(stream, d_dqkv.data(), d_dout.data(), d_qkv.data(), d_ref_out.data(), d_ref_lse.data(),
                                 d_ws.data(), s, mask);
  const std::vector<T> dqkv1 = download(d_dqkv);
  poison(d_dqkv, stream);
  kernels::attention_backward<T>(stream, d_dqkv.data(), d_dout.data(), d_qkv.data(), d_ref_out.data(), d_ref_lse.data(),
                                 d_ws.data(), s, mask);
  const std::vector<T> dqkv2 = download(d_dqkv);

  const bool tensor_cores = check::tensor_core_forward<T>();
  const check::Ratios r = check::ratios<T>(c, out1, lse1, dqkv1, tensor_cores);
  const bool deterministic = same_bits(out1, out2) && same_bits(lse1, lse2) && same_bits(dqkv1, dqkv2);

  char name[192];
  std::snprintf(name, sizeof name, "%-6s %-4s %-4s hs=%-3lld B=%lld T=%-3lld NH=%lld KVH=%lld%s",
                causal ? "causal" : "full", std::string(llmpar::name_of(llmpar::dtype_of<T>())).c_str(),
                tensor_cores ? "tc" : "simt", static_cast<long long>(s.head_dim), static_cast<long long>(s.batch),
                static_cast<long long>(s.seq), static_cast<long long>(s.heads), static_cast<long long>(s.kv_heads),
                causal && reference == check::Reference::naive_double ? " vs double" : "");
  const bool ok = r.pass() && deterministic;
  std::printf("%s %s: error/tolerance out %.3f lse %.3f dqkv %.3f; bitwise reproducible: %s\n", ok ? "ok  " : "FAIL",
              name, r.out, r.lse, r.dqkv, deterministic ? "yes" : "NO");
  expect(r.out <= 1.0, std::string(name) + ": out");
  expect(r.lse <= 1.0, std::string(name) + ": lse");
  expect(r.dqkv <= 1.0, std::string(name) + ": dqkv");
  expect(deterministic, std::string(name) + ": run-to-run bitwise reproducibility");
}

// The SIMT fallback of a 16-bit forward at a tensor-core head size: qkv and out are
// views one element into their buffers (2-byte aligned), which the tensor-core kernel's
// 16-byte loads cannot serve. Checked against the double reference like run_case.
template <class T>
void run_unaligned_case(const DeviceContext& context, const llmpar::AttentionShape& s, AttentionMask mask) {
  namespace kernels = llmpar::kernels;
  const cudaStream_t stream = context.compute();
  const std::size_t n_qkv = s.batch * s.seq * s.row(), n_out = s.batch * s.seq * s.q_dim();
  const std::size_t n_lse = s.batch * s.heads * s.seq;
  const bool causal = mask == AttentionMask::causal;
  const std::vector<T> qkv = check::random_tensor<T>("qkv", n_qkv, 7 * s.head_dim + s.seq);
  std::vector<double> ref_out, ref_lse;
  check::reference_forward(ref_out, ref_lse, check::as_double(qkv), s, causal);

  std::vector<T> padded(n_qkv + 1, llmpar::convert<T>(0.0f));  // element 0 is the offset
  std::copy(qkv.begin(), qkv.end(), padded.begin() + 1);
  DeviceBuffer<T> d_qkv(n_qkv + 1, stream), d_out(n_out + 1, stream);
  DeviceBuffer<float> d_lse(n_lse, stream);
  d_qkv.upload(padded);
  poison(d_out, stream);
  poison(d_lse, stream);
  kernels::attention_forward<T>(stream, d_out.data() + 1, d_lse.data(), d_qkv.data() + 1, s, mask);
  const std::vector<T> out_all = download(d_out);
  const std::vector<float> lse = download(d_lse);
  const std::span<const T> out(out_all.data() + 1, n_out);

  const double r_out = check::worst_ratio<T, double>(out, ref_out, check::storage_ulps<T>(), check::kForwardRel);
  const double r_lse = check::worst_ratio<float, double>(lse, ref_lse, 0.0, check::kForwardRel);
  char name[160];
  std::snprintf(name, sizeof name, "%-6s %-4s simt hs=%-3lld B=%lld T=%-3lld NH=%lld KVH=%lld, unaligned views",
                causal ? "causal" : "full", std::string(llmpar::name_of(llmpar::dtype_of<T>())).c_str(),
                static_cast<long long>(s.head_dim), static_cast<long long>(s.batch), static_cast<long long>(s.seq),
                static_cast<long long>(s.heads), static_cast<long long>(s.kv_heads));
  const bool ok = r_out <= 1.0 && r_lse <= 1.0;
  std::printf("%s %s: error/tolerance out %.3f lse %.3f\n", ok ? "ok  " : "FAIL", name, r_out, r_lse);
  expect(r_out <= 1.0, std::string(name) + ": out");
  expect(r_lse <= 1.0, std::string(name) + ": lse");
}

template <class T>
void run_all(const DeviceContext& context) {
  // Multi-head attention (KVH = NH), B * NH up to 6.
  const Shape causal_shapes[] = {{1, 1, 1, 1}, {1, 17, 2, 2}, {2, 64, 3, 3}, {1, 65, 1, 1}, {2, 200, 3, 3}};
  const Shape full_shapes[] = {{1, 1, 1, 1}, {1, 17, 2, 2}, {2, 65, 3, 3}, {1, 200, 1, 1}};
  for (std::int64_t hs : {16, 32, 64, 80, 128, 256}) {
    for (const Shape& s : causal_shapes) run_case<T>(context, s.at(hs), AttentionMask::causal);
    for (const Shape& s : full_shapes) run_case<T>(context, s.at(hs), AttentionMask::none);
  }
  // Grouped-query attention: groups of 2, 3 and 4 (KVH = 1: multi-query).
  const Shape gqa_shapes[] = {{1, 1, 4, 2}, {1, 17, 6, 2}, {2, 65, 4, 1}, {1, 130, 4, 2}, {2, 200, 6, 2}};
  for (std::int64_t hs : {16, 64, 80, 128}) {
    for (const Shape& s : gqa_shapes) {
      run_case<T>(context, s.at(hs), AttentionMask::causal);
      run_case<T>(context, s.at(hs), AttentionMask::none);
    }
    run_case<T>(context, Shape{1, 130, 6, 2}.at(hs), AttentionMask::causal, check::Reference::naive_double);
  }
  if constexpr (!std::is_same_v<T, float>) {
    run_unaligned_case<T>(context, Shape{2, 65, 3, 3}.at(64), AttentionMask::causal);
    run_unaligned_case<T>(context, Shape{1, 130, 2, 2}.at(80), AttentionMask::causal);
    run_unaligned_case<T>(context, Shape{1, 200, 2, 2}.at(128), AttentionMask::none);
    run_unaligned_case<T>(context, Shape{2, 65, 2, 2}.at(256), AttentionMask::causal);
    run_unaligned_case<T>(context, Shape{1, 130, 4, 2}.at(64), AttentionMask::causal);
    run_unaligned_case<T>(context, Shape{2, 65, 6, 2}.at(80), AttentionMask::none);
  }
}

// Throughput of the causal bf16 kernels at one shape (reported, not checked).
void report_speed(const DeviceContext& context, const char* model, const llmpar::AttentionShape& s) {
  namespace kernels = llmpar::kernels;
  using llmpar::backend::cuda::Event;
  const cudaStream_t stream = context.compute();
  const std::size_t n_qkv = s.batch * s.seq * s.row(), n_out = s.batch * s.seq * s.q_dim();
  DeviceBuffer<bf16> qkv(n_qkv, stream), out(n_out, stream), dqkv(n_qkv, stream);
  DeviceBuffer<float> lse(s.batch * s.heads * s.seq, stream), ws(kernels::attention_backward_workspace(s), stream);
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(qkv.data(), 0, qkv.bytes(), stream));
  kernels::attention_forward<bf16>(stream, out.data(), lse.data(), qkv.data(), s);  // warm-up
  Event start(Event::Timing::on), mid(Event::Timing::on), stop(Event::Timing::on);
  start.record(stream);
  kernels::attention_forward<bf16>(stream, out.data(), lse.data(), qkv.data(), s);
  mid.record(stream);
  kernels::attention_backward<bf16>(stream, dqkv.data(), out.data(), qkv.data(), out.data(), lse.data(), ws.data(), s);
  stop.record(stream);
  stop.synchronize();
  const double flops = 4.0 * s.batch * s.heads * s.seq * s.seq * s.head_dim / 2;  // causal q k^T and p v
  const double fwd_ms = mid.ms_since(start), bwd_ms = stop.ms_since(mid);
  std::printf(
      "speed  causal bf16 %s hs=%lld B=%lld T=%lld NH=%lld KVH=%lld: forward %.3f ms (%.1f TFLOP/s), "
      "backward %.3f ms (%.1f TFLOP/s at 2.5x forward FLOPs)\n",
      model, static_cast<long long>(s.head_dim), static_cast<long long>(s.batch), static_cast<long long>(s.seq),
      static_cast<long long>(s.heads), static_cast<long long>(s.kv_heads), fwd_ms, flops / fwd_ms * 1e-9, bwd_ms,
      2.5 * flops / bwd_ms * 1e-9);
}

}  // namespace

int main() {
  if (!gpu_test::run_host_checks(check_host_errors, "host-side checks")) return 1;
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("skipped: no CUDA device (host-side checks %s)\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    DeviceContext context(0);
    run_all<float>(context);
    run_all<bf16>(context);
    run_all<f16>(context);
    report_speed(context, "GPT-sized", llmpar::AttentionShape::mha(2, 4096, 2048, 16));
    report_speed(context, "Llama-3-8B", llmpar::AttentionShape{1, 4096, 32, 8, 128});
  });
}
