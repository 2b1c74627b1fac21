// The CUDA attention kernels (kernels/attention.cuh), compiled by the host compiler and
// run on the CPU by the host emulation (cuda_emulation.hpp: one fiber per CUDA thread,
// mma and ldmatrix from the PTX ISA's fragment layouts), checked as test_cuda_attention
// checks them on a GPU (tests/cuda/attention_check.hpp: the CPU kernel or a double
// reference, the same tolerances):
//   - the SIMT forward (float; 16-bit with unaligned views), the tensor-core forward
//     (bf16/f16) and the three backward kernels, causal and without a mask,
//     at head sizes 16, 24, 32, 64, 80, 128, 200 and 256 for T = 1, 17, 64, 65, 130
//     (B * NH up to 4), and every other multiple of 8 up to 256 at one shape;
//   - grouped-query attention (NH / KVH = 2, 3 and 4; KVH = 1 is multi-query) at head
//     sizes 16, 80 and 128 for T = 1, 17, 65, 130, causal against the CPU kernel (and once
//     against the double reference), without a mask against the double reference: each
//     kv head's dk and dv summed over its query heads, query head h reading kv head
//     h % KVH; 16-bit on unaligned views too;
//   - every output element is written (outputs start as NaN) and nothing is written
//     outside the outputs (NaN guard zones around every buffer stay NaN);
//   - the same bits under a second, shuffled schedule of CTAs and threads (T = 65 cases);
//   - the launch configuration and the shared memory of every kernel fit an sm_80 CTA
//     (the emulation refuses anything an A100 would);
//   - head sizes outside the supported set are rejected with the set's name.
// A ctest (label cpu; about 25 s to build and 25 s to run on 2 cores, 5 of them the
// grouped-query cases). Run directly, it prints one line per case with its worst ratios:
//   cmake --build build --target test_cuda_emulation_attention && build/tests/test_cuda_emulation_attention
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../cuda/attention_check.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/kernels/attention.cuh"

namespace {

using llmpar::bf16;
using llmpar::f16;
using llmpar::kernels::AttentionMask;
namespace check = llmpar::attention_check;
namespace emulation = llmpar::emulation;

// A buffer with 64 NaN elements (0xFF bytes) on each side, and NaN inside until written.
template <class T>
class Guarded {
 public:
  static constexpr std::size_t kGuard = 64;  // elements: keeps data() 16-byte aligned

  explicit Guarded(std::size_t n, std::size_t offset = 0) : n_(n), offset_(offset), storage_(n + offset + 2 * kGuard) {
    std::memset(storage_.data(), 0xFF, storage_.size() * sizeof(T));
  }
  void fill(const std::vector<T>& v) { std::memcpy(data(), v.data(), n_ * sizeof(T)); }
  T* data() { return storage_.data() + kGuard + offset_; }
  std::span<const T> view() const { return {storage_.data() + kGuard + offset_, n_}; }
  std::vector<T> contents() const { return {view().begin(), view().end()}; }
  bool guards_intact() const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(storage_.data());
    const std::size_t before = (kGuard + offset_) * sizeof(T), after = (kGuard + offset_ + n_) * sizeof(T);
    for (std::size_t i = 0; i < storage_.size() * sizeof(T); ++i)
      if ((i < before || i >= after) && bytes[i] != 0xFF) return false;
    return true;
  }

 private:
  std::size_t n_, offset_;
  std::vector<T> storage_;
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct Results {
  std::vector<unsigned char> out, lse, dqkv;  // the bytes, for the reproducibility check
  check::Ratios ratios;
  bool guards = true;
};

template <class T>
std::vector<unsigned char> bytes_of(std::span<const T> v) {
  std::vector<unsigned char> b(v.size_bytes());
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Forward and backward of one case under the given schedule. offset: elements by which
// qkv and out are moved off their 16-byte aligned start (1: the SIMT path of 16-bit T).
template <class T>
Results run(const check::Case<T>& c, AttentionMask mask, std::uint64_t schedule_seed, std::size_t offset,
            bool tensor_cores) {
  namespace kernels = llmpar::kernels;
  const llmpar::AttentionShape& s = c.shape;
  emulation::device().schedule_seed = schedule_seed;
  Guarded<T> qkv(c.qkv.size(), offset), dout(c.dout.size()), out(c.ref_out.size(), offset);
  Guarded<T> ref_out(c.ref_out.size()), dqkv(c.qkv.size());
  Guarded<float> lse(c.ref_lse.size()), ref_lse(c.ref_lse.size());
  Guarded<float> workspace(static_cast<std::size_t>(kernels::attention_backward_workspace(s)));
  qkv.fill(c.qkv);
  dout.fill(c.dout);
  ref_out.fill(c.ref_out);
  ref_lse.fill(c.ref_lse);
  kernels::attention_forward<T>(nullptr, out.data(), lse.data(), qkv.data(), s, mask);
  kernels::attention_backward<T>(nullptr, dqkv.data(), dout.data(), qkv.data(), ref_out.data(), ref_lse.data(),
                                 workspace.data(), s, mask);
  emulation::device().schedule_seed = 0;
  Results r;
  r.ratios = check::ratios(c, out.view(), lse.view(), dqkv.view(), tensor_cores);
  r.out = bytes_of(out.view());
  r.lse = bytes_of(lse.view());
  r.dqkv = bytes_of(dqkv.view());
  r.guards = qkv.guards_intact() && dout.guards_intact() && out.guards_intact() && ref_out.guards_intact() &&
             dqkv.guards_intact() && lse.guards_intact() && ref_lse.guards_intact() && workspace.guards_intact();
  return r;
}

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "f32" : std::is_same_v<T, bf16> ? "bf16" : "f16";
}

// One case, checked against `chosen` (by default the CPU kernel where it applies);
// `reschedule` also runs it under a shuffled schedule and compares bits.
template <class T>
void check_case(const llmpar::AttentionShape& s, AttentionMask mask, bool reschedule, std::size_t offset = 0,
                std::optional<check::Reference> chosen = std::nullopt) {
  const bool causal = mask == AttentionMask::causal;
  const check::Reference reference = chosen.value_or(check::default_reference(causal));
  const check::Case<T> c = check::make_case<T>(s, causal, reference);
  const bool tensor_cores = offset == 0 && check::tensor_core_forward<T>();
  const Results a = run(c, mask, 0, offset, tensor_cores);
  char name[192];
  std::snprintf(
      name, sizeof name, "%-6s %-4s %-4s hs=%-3lld B=%lld T=%-3lld NH=%lld KVH=%lld%s%s", causal ? "causal" : "full",
      type_name<T>(), tensor_cores ? "tc" : "simt", static_cast<long long>(s.head_dim), static_cast<long long>(s.batch),
      static_cast<long long>(s.seq), static_cast<long long>(s.heads), static_cast<long long>(s.kv_heads),
      causal && reference == check::Reference::naive_double ? " vs double" : "", offset != 0 ? " unaligned" : "");
  bool same = true;
  if (reschedule) {
    const Results b = run(c, mask, 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(s.head_dim * 1000 + s.seq),
                          offset, tensor_cores);
    same = a.out == b.out && a.lse == b.lse && a.dqkv == b.dqkv && b.guards;
  }
  std::printf("%s %s: error/tolerance out %.3f lse %.3f dqkv %.3f%s\n",
              a.ratios.pass() && a.guards && same ? "ok  " : "FAIL", name, a.ratios.out, a.ratios.lse, a.ratios.dqkv,
              reschedule ? (same ? "; same bits reshuffled" : "; DIFFERENT bits reshuffled") : "");
  CAPTURE(std::string(name));
  CHECK(a.ratios.out <= 1.0);
  CHECK(a.ratios.lse <= 1.0);
  CHECK(a.ratios.dqkv <= 1.0);
  CHECK(a.guards);
  CHECK(same);
}

// Multi-head attention (KVH = NH), B * NH up to 4.
const check::Shape kCausalShapes[] = {{1, 1, 1, 1}, {1, 17, 2, 2}, {2, 64, 2, 2}, {1, 65, 1, 1}, {1, 130, 2, 2}};
const check::Shape kFullShapes[] = {{1, 1, 1, 1}, {1, 17, 2, 2}, {2, 65, 2, 2}, {1, 130, 1, 1}};
const std::int64_t kHeadSizes[] = {16, 24, 32, 64, 80, 128, 200, 256};

// Grouped-query attention: groups of 2 (4 heads on 2, 2 on 1), 3 (6 on 2) and 4 (4 on 1),
// KVH = 1 being multi-query; head sizes padded in the kernels for 32 and 128, and 128 itself.
const check::Shape kGqaCausalShapes[] = {{1, 1, 4, 2}, {1, 17, 6, 2}, {1, 65, 4, 1}, {1, 130, 2, 1}};
const check::Shape kGqaFullShapes[] = {{1, 17, 6, 2}, {1, 65, 4, 1}};
const std::int64_t kGqaHeadSizes[] = {16, 80, 128};

template <class T>
void check_head_size(std::int64_t hs) {
  for (const check::Shape& s : kCausalShapes) check_case<T>(s.at(hs), AttentionMask::causal, s.T == 65);
  for (const check::Shape& s : kFullShapes) check_case<T>(s.at(hs), AttentionMask::none, s.T == 65);
}

}  // namespace

TEST_CASE_TEMPLATE("emulated CUDA attention matches the references at head sizes 16 to 256", T, float, bf16, f16) {
  for (std::int64_t hs : kHeadSizes) check_head_size<T>(hs);
}

TEST_CASE_TEMPLATE("emulated CUDA grouped-query attention sums each kv head's gradient over its query heads", T, float,
                   bf16, f16) {
  for (std::int64_t hs : kGqaHeadSizes) {
    for (const check::Shape& s : kGqaCausalShapes) check_case<T>(s.at(hs), AttentionMask::causal, s.T == 65);
    for (const check::Shape& s : kGqaFullShapes) check_case<T>(s.at(hs), AttentionMask::none, false);
  }
  // Causal once against the double reference too: a grouping written apart from the CPU
  // kernel's, so the two kernels cannot agree on a wrong one.
  check_case<T>(check::Shape{1, 65, 6, 2}.at(80), AttentionMask::causal, false, 0, check::Reference::naive_double);
}

TEST_CASE_TEMPLATE("emulated CUDA attention matches the references at every multiple of 8 up to 256", T, float, bf16,
                   f16) {
  for (std::int64_t hs = 16; hs <= 256; hs += 8) {
    bool featured = false;
    for (std::int64_t f : kHeadSizes) featured = featured || f == hs;
    if (!featured)
      check_case<T>(check::Shape{1, 65, 2, 2}.at(hs), hs % 16 == 0 ? AttentionMask::causal : AttentionMask::none,
                    false);
  }
}

TEST_CASE_TEMPLATE("emulated 16-bit attention on unaligned views takes the SIMT path and matches", T, bf16, f16) {
  check_case<T>(check::Shape{2, 65, 2, 2}.at(64), AttentionMask::causal, false, 1);
  check_case<T>(check::Shape{1, 130, 1, 1}.at(80), AttentionMask::none, false, 1);
  check_case<T>(check::Shape{1, 64, 2, 2}.at(128), AttentionMask::causal, false, 1);
  check_case<T>(check::Shape{1, 65, 2, 2}.at(200), AttentionMask::causal, false, 1);
  check_case<T>(check::Shape{2, 17, 1, 1}.at(256), AttentionMask::none, false, 1);
  check_case<T>(check::Shape{1, 65, 4, 2}.at(64), AttentionMask::causal, false, 1);
  check_case<T>(check::Shape{1, 17, 6, 2}.at(80), AttentionMask::none, false, 1);
}

TEST_CASE("emulated CUDA attention rejects head sizes outside the multiples of 8 from 16 to 256") {
  namespace kernels = llmpar::kernels;
  float f = 0.f;
  bf16 x{};
  for (std::int64_t hs : {8, 12, 20, 264, 512}) {
    CAPTURE(hs);
    const auto shape = llmpar::AttentionShape::mha(1, 8, 2 * hs, 2);
    CHECK_THROWS_WITH_AS(kernels::attention_forward<bf16>(nullptr, &x, &f, &x, shape),
                         doctest::Contains("supported head sizes are the multiples of 8 from 16 to 256"),
                         llmpar::Error);
    CHECK_THROWS_WITH_AS(kernels::attention_backward<float>(nullptr, &f, &f, &f, &f, &f, &f, shape),
                         doctest::Contains("supported head sizes are the multiples of 8 from 16 to 256"),
                         llmpar::Error);
  }
}

TEST_CASE("emulated CUDA attention rejects kv heads that do not divide the query heads") {
  namespace kernels = llmpar::kernels;
  float f = 0.f;
  const llmpar::AttentionShape shape{1, 8, 4, 3, 64};
  CHECK_THROWS_WITH_AS(kernels::attention_forward<float>(nullptr, &f, &f, &f, shape),
                       doctest::Contains("kv_heads = 3 does not divide the query heads 4"), llmpar::Error);
  CHECK_THROWS_WITH_AS(kernels::attention_backward_workspace(shape),
                       doctest::Contains("kv_heads = 3 does not divide the query heads 4"), llmpar::Error);
}
