// Fused softmax + cross-entropy on CUDA (kernels/cross_entropy.cuh) against the CPU
// kernel (backend/cpu/cross_entropy.hpp).
//
// For float, bf16 and f16 storage and vocabularies V = 1, 7, 1000 and 50257 (padded to
// Vp = 50304 as GPT-2 pads it, and unpadded, which takes the element path): losses and
// dlogits against the CPU kernel on the same rounded logits, with NaN in the padding to
// prove it never enters the softmax; padding gradients exactly 0; the loss-only kernel
// equal bit for bit to the fused one; bitwise determinism run to run. Targets outside
// [0, V) give NaN loss and NaN dlogits for their row only. The vocabulary-parallel split
// in 2 and 3 slices, with the statistics combined on the host in slice order,
// reproduces the unsplit kernel. Host-side errors are checked first, without a device.
// Exit codes: 0 pass, 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/backend/cpu/cross_entropy.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/kernels/cross_entropy.cuh"
#include "llmpar/math/online_softmax.hpp"

#include "gpu_test.hpp"

namespace {

using llmpar::bf16;
using llmpar::f16;
namespace cpu = llmpar::backend::cpu;
namespace kernels = llmpar::kernels;
using llmpar::backend::cuda::DeviceBuffer;
using llmpar::backend::cuda::DeviceContext;
namespace gpu_test = llmpar::gpu_test;

constexpr std::uint64_t kSeed = 20240611;
// The atol of float in the per-storage-type tolerance (gpu_test::tolerance).
constexpr double kFloatAtol = 1e-6;

using gpu_test::compare;
using gpu_test::download;
using gpu_test::dtype_name;
using gpu_test::ErrorWording;
using gpu_test::expect;
using gpu_test::ExpectError;
using gpu_test::same_bits;
using gpu_test::Tolerance;
using gpu_test::upload;

constexpr ExpectError expect_error{ErrorWording::names};

// (rows, Vp) logits ~ N(0, 2^2) rounded to T, NaN in the padding columns [V, Vp).
template <class T>
std::vector<T> random_logits(std::int64_t rows, std::int64_t V, std::int64_t Vp, const std::string& name) {
  const auto stream = llmpar::rng::Stream::named(kSeed, name);
  std::vector<T> v(static_cast<std::size_t>(rows * Vp));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < Vp; ++c)
      v[r * Vp + c] = llmpar::convert<T>(
          c < V ? static_cast<float>(2.0 * stream.normal(static_cast<std::uint64_t>(r * Vp + c))) : std::nanf(""));
  return v;
}

// Targets in [0, V), with the first row at 0 and the last at V - 1.
std::vector<std::int32_t> random_targets(std::int64_t rows, std::int64_t V, const std::string& name) {
  const auto stream = llmpar::rng::Stream::named(kSeed, name);
  std::vector<std::int32_t> t(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r)
    t[r] = std::min(static_cast<std::int32_t>(stream.uniform(static_cast<std::uint64_t>(r)) * static_cast<float>(V)),
                    static_cast<std::int32_t>(V - 1));
  t.front() = 0;
  t.back() = static_cast<std::int32_t>(V - 1);
  return t;
}

// ---------------------------------------------------------------------------------------
// Host-side errors: thrown before any CUDA call, so they are checked without a device.

void check_host_errors() {
  std::vector<float> host(64);
  float* p = host.data();
  std::vector<std::int32_t> targets(8, 0);
  const std::int32_t* t = targets.data();
  const cudaStream_t s = nullptr;
  expect_error([&] { kernels::cross_entropy_forward_backward<float>(s, p, p, t, 2, 0, 8, 1.0f); }, "V = 0, Vp = 8",
               "cross_entropy_forward_backward V = 0");
  expect_error([&] { kernels::cross_entropy_forward_backward<bf16>(s, nullptr, p, t, 2, 9, 8, 1.0f); },
               "need 1 <= V <= Vp", "cross_entropy_forward_backward V > Vp");
  expect_error([&] { kernels::cross_entropy_forward_backward<float>(s, p, p, t, -1, 4, 8, 1.0f); }, "rows = -1",
               "cross_entropy_forward_backward rows < 0");
  expect_error([&] { kernels::cross_entropy_forward_backward<float>(s, p, p, t, 2, 4, 8, std::nanf("")); },
               "dloss = nan", "cross_entropy_forward_backward dloss NaN");
  expect_error([&] { kernels::cross_entropy_forward_backward<float>(s, p, p, nullptr, 2, 4, 8, 1.0f); },
               "targets is null", "cross_entropy_forward_backward null targets");
  expect_error([&] { kernels::cross_entropy_forward_backward<float>(s, p, p, t, 1, 4, std::int64_t{1} << 31, 1.0f); },
               "(targets are int32)", "cross_entropy_forward_backward Vp too large");
  expect_error([&] { kernels::cross_entropy_forward<f16>(s, p, nullptr, t, 3, 0, 0); }, "cross_entropy_forward: V = 0",
               "cross_entropy_forward V = 0");
  expect_error([&] { kernels::cross_entropy_forward<float>(s, nullptr, p, t, 3, 4, 4); }, "losses is null",
               "cross_entropy_forward null losses");
  // vocab_parallel_cross_entropy_stats(stream, stats, logits, targets, rows, V, v0, Vlocal)
  expect_error([&] { kernels::vocab_parallel_cross_entropy_stats<float>(s, p, p, t, 2, 16, -1, 8); },
               "V = 16, v0 = -1, Vlocal = 8", "vocab_parallel_cross_entropy_stats v0 < 0");
  expect_error([&] { kernels::vocab_parallel_cross_entropy_stats<bf16>(s, p, nullptr, t, 2, 16, 0, 0); },
               "Vlocal = 0", "vocab_parallel_cross_entropy_stats Vlocal = 0");
  expect_error([&] { kernels::vocab_parallel_cross_entropy_stats<float>(s, p, p, t, 2, 0, 0, 8); }, "V = 0",
               "vocab_parallel_cross_entropy_stats V = 0");
  expect_error([&] { kernels::vocab_parallel_cross_entropy_stats<float>(s, nullptr, p, t, 2, 16, 0, 8); },
               "stats is null", "vocab_parallel_cross_entropy_stats null stats");
  // vocab_parallel_cross_entropy_finish(stream, grad, losses, logits, gathered, ranks, targets, rows, V, v0, Vlocal, dloss)
  expect_error([&] { kernels::vocab_parallel_cross_entropy_finish<float>(s, p, p, p, p, 2, t, -2, 16, 0, 8, 1.0f); },
               "rows = -2", "vocab_parallel_cross_entropy_finish rows < 0");
  expect_error([&] { kernels::vocab_parallel_cross_entropy_finish<float>(s, p, p, p, p, 0, t, 2, 16, 0, 8, 1.0f); },
               "ranks = 0", "vocab_parallel_cross_entropy_finish ranks = 0");
  expect_error(
      [&] { kernels::vocab_parallel_cross_entropy_finish<float>(s, p, p, p, p, 2, t, 2, 16, 0, 8, INFINITY); },
      "dloss = inf", "vocab_parallel_cross_entropy_finish dloss inf");
  expect_error([&] { kernels::vocab_parallel_cross_entropy_finish<float>(s, p, p, p, nullptr, 2, t, 2, 16, 0, 8, 1.0f); },
               "gathered is null", "vocab_parallel_cross_entropy_finish null gathered");
  // No rows is not an error and launches nothing (so it works without a device).
  try {
    kernels::cross_entropy_forward_backward<float>(s, nullptr, nullptr, nullptr, 0, 4, 8, 1.0f);
    kernels::cross_entropy_forward<bf16>(s, nullptr, nullptr, nullptr, 0, 4, 8);
    kernels::vocab_parallel_cross_entropy_stats<f16>(s, nullptr, nullptr, nullptr, 0, 16, 0, 8);
    kernels::vocab_parallel_cross_entropy_finish<f16>(s, nullptr, nullptr, nullptr, nullptr, 2, nullptr, 0, 16, 0, 8,
                                                      1.0f);
  } catch (const std::exception& e) {
    expect(false, std::string("rows = 0 should be a no-op: ") + e.what());
  }
}

// ---------------------------------------------------------------------------------------
// Device cases.

template <class T>
void fused_case(const DeviceContext& context, std::int64_t rows, std::int64_t V, std::int64_t Vp) {
  const cudaStream_t stream = context.compute();
  const std::string tag = std::string("cross_entropy ") + dtype_name<T>() + " rows=" + std::to_string(rows) +
                          " V=" + std::to_string(V) + " Vp=" + std::to_string(Vp);
  const std::string seed = std::to_string(rows) + "x" + std::to_string(V) + "x" + std::to_string(Vp);
  const auto logits = random_logits<T>(rows, V, Vp, "logits." + seed);
  const auto targets = random_targets(rows, V, "targets." + seed);
  const float dloss = 1.0f / static_cast<float>(rows);
  const Tolerance tol = gpu_test::tolerance<T>(kFloatAtol);

  std::vector<T> dlogits_cpu = logits;
  std::vector<float> losses_cpu(rows);
  cpu::cross_entropy_forward_backward(dlogits_cpu.data(), losses_cpu.data(), targets.data(), rows, V, Vp, dloss);

  auto d_targets = upload(targets, stream);
  const auto run = [&](const std::vector<std::int32_t>* other_targets) {
    auto d_logits = upload(logits, stream);
    DeviceBuffer<float> d_losses(rows, stream);
    DeviceBuffer<std::int32_t> d_other(other_targets ? other_targets->size() : 0, stream);
    if (other_targets) d_other.upload(*other_targets);
    kernels::cross_entropy_forward_backward<T>(stream, d_logits.data(), d_losses.data(),
                                               other_targets ? d_other.data() : d_targets.data(), rows, V, Vp, dloss);
    std::pair<std::vector<T>, std::vector<float>> result{download(d_logits), download(d_losses)};
    return result;
  };
  const auto [dlogits, losses] = run(nullptr);
  const auto vocab = [&](std::size_t i) { return static_cast<std::int64_t>(i) % Vp < V; };
  const double loss_err = compare(losses, losses_cpu, {1e-5, 1e-6}, tag + " losses");
  const double grad_err = compare(dlogits, dlogits_cpu, tol, tag + " dlogits", vocab);
  bool padding_zero = true;
  for (std::size_t i = 0; i < dlogits.size(); ++i)
    if (!vocab(i))
      padding_zero = padding_zero && llmpar::convert<float>(dlogits[i]) == 0.0f &&
                     !std::signbit(llmpar::convert<float>(dlogits[i]));
  expect(padding_zero, tag + ": padding gradients are +0");

  // The loss-only kernel gives the same bits; a second run gives the same bits.
  {
    auto d_logits = upload(logits, stream);
    DeviceBuffer<float> d_losses(rows, stream);
    kernels::cross_entropy_forward<T>(stream, d_losses.data(), d_logits.data(), d_targets.data(), rows, V, Vp);
    expect(same_bits(download(d_losses), losses), tag + ": cross_entropy_forward = fused losses, bitwise");
    expect(same_bits(download(d_logits), logits), tag + ": cross_entropy_forward leaves the logits alone");
    const auto [dlogits2, losses2] = run(nullptr);
    expect(same_bits(dlogits2, dlogits) && same_bits(losses2, losses), tag + ": bitwise reproducible");
  }

  // Out-of-range targets: NaN loss and NaN dlogits on [0, V) for those rows (padding
  // still 0); the other rows are untouched, bit for bit.
  if (rows >= 3) {
    std::vector<std::int32_t> bad = targets;
    bad[0] = -1;
    bad[rows / 2] = static_cast<std::int32_t>(V);
    bad[rows - 1] = 2147483647;
    const auto [dl_bad, loss_bad] = run(&bad);
    bool ok = true;
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool invalid = bad[r] != targets[r];
      ok = ok && (invalid ? std::isnan(loss_bad[r]) : std::memcmp(&loss_bad[r], &losses[r], sizeof(float)) == 0);
      for (std::int64_t c = 0; c < Vp; ++c) {
        const float g = llmpar::convert<float>(dl_bad[r * Vp + c]);
        if (c >= V)
          ok = ok && g == 0.0f;
        else if (invalid)
          ok = ok && std::isnan(g);
        else
          ok = ok && std::memcmp(&dl_bad[r * Vp + c], &dlogits[r * Vp + c], sizeof(T)) == 0;
      }
    }
    expect(ok, tag + ": targets -1, V and 2^31-1 give NaN loss and dlogits in their rows only");
  }
  std::printf("%-56s losses %.2e  dlogits %.2e\n", tag.c_str(), loss_err, grad_err);
}

// The vocabulary split in `slices` parts (the first ones multiples of 8 columns, so both
// the vector and the element path run): stats per slice, combined on the host in slice
// order, then finish per slice, against the unsplit kernel.
// The vocabulary split over `ranks` equal slices of the padded vocabulary (the layout of
// nn::VocabParallelEmbedding: the last slices may hold padding only). Each slice's stats
// on the device, then the (ranks, rows, 3) gathered stats and finish on every slice:
// losses equal to the unsplit kernel's, dlogits to its columns, and every value equal
// to the CPU's vocabulary-parallel functions within the storage type's tolerance.
template <class T>
void vocab_parallel_case(const DeviceContext& context, std::int64_t rows, std::int64_t V, std::int64_t Vp, int ranks) {
  const cudaStream_t stream = context.compute();
  constexpr int kStats = kernels::detail::xent::kVocabStats;
  const std::string tag = std::string("vocab_parallel ") + dtype_name<T>() + " rows=" + std::to_string(rows) +
                          " V=" + std::to_string(V) + " Vp=" + std::to_string(Vp) + " ranks=" + std::to_string(ranks);
  const std::string seed = "vp." + std::to_string(rows) + "x" + std::to_string(V) + "x" + std::to_string(Vp);
  const auto logits = random_logits<T>(rows, V, Vp, "logits." + seed);  // NaN on the padding
  auto targets = random_targets(rows, V, "targets." + seed);
  const float dloss = 1.0f / static_cast<float>(rows);

  // The unsplit reference on the device.
  auto d_targets = upload(targets, stream);
  auto d_full = upload(logits, stream);
  DeviceBuffer<float> d_full_losses(rows, stream);
  kernels::cross_entropy_forward_backward<T>(stream, d_full.data(), d_full_losses.data(), d_targets.data(), rows, V, Vp,
                                             dloss);
  const auto full_dlogits = download(d_full);
  const auto full_losses = download(d_full_losses);

  const std::int64_t Vlocal = Vp / ranks;
  std::vector<std::vector<T>> local(ranks);
  std::vector<DeviceBuffer<T>> d_local;
  std::vector<float> gathered(static_cast<std::size_t>(ranks * rows * kStats));
  std::vector<float> cpu_gathered(gathered.size());
  for (int i = 0; i < ranks; ++i) {
    const std::int64_t v0 = i * Vlocal;
    local[i].resize(rows * Vlocal);
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(logits.begin() + r * Vp + v0, Vlocal, local[i].begin() + r * Vlocal);
    d_local.push_back(upload(local[i], stream));
    DeviceBuffer<float> d_stats(rows * kStats, stream);
    kernels::vocab_parallel_cross_entropy_stats<T>(stream, d_stats.data(), d_local.back().data(), d_targets.data(),
                                                   rows, V, v0, Vlocal);
    const auto stats = download(d_stats);
    std::copy(stats.begin(), stats.end(), gathered.begin() + i * rows * kStats);
    cpu::vocab_parallel_cross_entropy_stats(cpu_gathered.data() + i * rows * kStats, local[i].data(), targets.data(),
                                            rows, V, v0, Vlocal);
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool here = targets[r] >= v0 && targets[r] < v0 + Vlocal;
      expect(here || stats[r * kStats + 2] == 0.0f, tag + ": the target logit is 0 where the target is not local");
    }
  }
  // A slice of padding only has the empty state, max = -inf: compared exactly.
  const auto finite = [&](std::size_t i) { return std::isfinite(cpu_gathered[i]); };
  const double stats_err = compare(gathered, cpu_gathered, {1e-5, 1e-6}, tag + " stats against the CPU", finite);
  bool same_empty = true;
  for (std::size_t i = 0; i < gathered.size(); ++i) same_empty = same_empty && (finite(i) || gathered[i] == cpu_gathered[i]);
  expect(same_empty, tag + ": an all-padding slice has the empty softmax state (-inf, 0)");
  auto d_gathered = upload(gathered, stream);
  std::vector<T> split(rows * Vp);
  double loss_err = 0.0;
  for (int i = 0; i < ranks; ++i) {
    const std::int64_t v0 = i * Vlocal;
    DeviceBuffer<float> d_losses(rows, stream);
    kernels::vocab_parallel_cross_entropy_finish<T>(stream, d_local[i].data(), d_losses.data(), d_local[i].data(),
                                                    d_gathered.data(), ranks, d_targets.data(), rows, V, v0, Vlocal,
                                                    dloss);
    const auto losses = download(d_losses);
    loss_err = std::max(loss_err, compare(losses, full_losses, {1e-5, 1e-6}, tag + " losses"));
    const auto g = download(d_local[i]);
    for (std::int64_t r = 0; r < rows; ++r) std::copy_n(g.begin() + r * Vlocal, Vlocal, split.begin() + r * Vp + v0);
    // The CPU's finish on the same gathered stats.
    std::vector<T> cpu_grad = local[i];
    std::vector<float> cpu_losses(rows);
    cpu::vocab_parallel_cross_entropy_finish(cpu_grad.data(), cpu_losses.data(), cpu_grad.data(), gathered.data(),
                                             ranks, targets.data(), rows, V, v0, Vlocal, dloss);
    compare(losses, cpu_losses, {1e-5, 1e-6}, tag + " losses against the CPU");
    compare(g, cpu_grad, gpu_test::tolerance<T>(kFloatAtol), tag + " dlogits against the CPU");
  }
  // Padding columns carry no gradient, as in the unsplit kernel.
  const double grad_err = compare(split, full_dlogits, gpu_test::tolerance<T>(kFloatAtol), tag + " dlogits");

  // A target outside [0, V) is seen by every rank: NaN target logit, loss and dlogits.
  {
    targets[1] = static_cast<std::int32_t>(V);
    auto d_bad_targets = upload(targets, stream);
    DeviceBuffer<float> d_stats(rows * kStats, stream), d_losses(rows, stream);
    auto d_slice = upload(local[0], stream);
    kernels::vocab_parallel_cross_entropy_stats<T>(stream, d_stats.data(), d_slice.data(), d_bad_targets.data(), rows,
                                                   V, 0, Vlocal);
    const auto stats = download(d_stats);
    expect(std::isnan(stats[kStats + 2]), tag + ": a target >= V has a NaN target logit");
    auto d_one = upload(stats, stream);
    kernels::vocab_parallel_cross_entropy_finish<T>(stream, d_slice.data(), d_losses.data(), d_slice.data(),
                                                    d_one.data(), 1, d_bad_targets.data(), rows, V, 0, Vlocal, dloss);
    const auto g = download(d_slice);
    bool all_nan = std::isnan(download(d_losses)[1]);
    const std::int64_t vocab_here = std::min(Vlocal, V);
    for (std::int64_t c = 0; c < vocab_here; ++c)
      all_nan = all_nan && std::isnan(llmpar::convert<float>(g[Vlocal + c]));
    expect(all_nan, tag + ": a target outside the vocabulary gives NaN loss and dlogits");
  }
  std::printf("%-64s stats %.2e  losses %.2e  dlogits %.2e\n", tag.c_str(), stats_err, loss_err, grad_err);
}

template <class T>
void all_cases(const DeviceContext& context) {
  fused_case<T>(context, 1, 1, 1);
  fused_case<T>(context, 5, 7, 7);
  fused_case<T>(context, 3, 7, 16);
  fused_case<T>(context, 17, 1000, 1024);
  fused_case<T>(context, 64, 50257, 50304);
  fused_case<T>(context, 4, 50257, 50257);  // unpadded, odd: the element path
  for (const int ranks : {2, 4}) {
    vocab_parallel_case<T>(context, 9, 1000, 1024, ranks);
    vocab_parallel_case<T>(context, 16, 50257, 50304, ranks);
    vocab_parallel_case<T>(context, 5, 40, 64, ranks);  // with 4 ranks the last holds padding only
  }
}

}  // namespace

int main() {
  check_host_errors();
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("host-side checks %s; skipped: no CUDA device\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    DeviceContext context(0);
    all_cases<float>(context);
    all_cases<bf16>(context);
    all_cases<f16>(context);
  });
}
