// The CUDA ring-attention block kernels (kernels/attention_block.cuh), compiled by the host
// compiler and run on the CPU by the host emulation (cuda_emulation.hpp: one fiber per
// CUDA thread), checked as test_cuda_attention_block checks them on a GPU
// (tests/cuda/attention_block_check.hpp: the same cases, references and tolerances):
//   - each block operation against the CPU block kernels (backend/cpu/attention_block.hpp)
//     for float, bf16 and f16: grouped-query (4 heads on 2, 4 on 1) and multi-head, head
//     sizes 32, 64 and 80, causal diagonal blocks and unmasked blocks off the diagonal,
//     keys from qkv, a packed copy and a wider buffer with v before k;
//   - rings of 1, 2 and 4 ranks (2, 4 and 8 chunks) composed into the whole causal
//     sequence, against the whole-sequence CPU kernels (backend/cpu/attention.hpp);
//   - nothing is written outside the buffers (NaN guard zones around every one stay NaN),
//     and rows outside a block keep their state;
//   - the same bits under a shuffled schedule of CTAs and threads;
//   - attention_state_init is the CPU's, bit for bit; blocks that do not fit and
//     unsupported head sizes are rejected with the field's name.
// A ctest (label cpu). Run directly, it prints one line per case with its worst ratios:
//   cmake --build build --target test_cuda_emulation_attention_block && build/tests/test_cuda_emulation_attention_block
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../cuda/attention_block_check.hpp"
#include "llmpar/backend/cpu/attention_block.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/kernels/attention_block.cuh"

namespace {

using llmpar::AttentionBlock;
using llmpar::AttentionShape;
using llmpar::AttentionState;
using llmpar::bf16;
using llmpar::f16;
namespace blocks = llmpar::attention_block_check;
namespace emulation = llmpar::emulation;
namespace kernels = llmpar::kernels;

// attention_block_check's Device on the emulation: host buffers with 64 bytes of NaN
// (0xFF) on each side, the kernels called directly. Every get() is also kept, as bytes,
// for the reproducibility check.
class EmulatedDevice {
 public:
  static constexpr std::size_t kGuard = 64;

  template <class E>
  E* put(const std::vector<E>& host) {
    const std::size_t bytes = host.size() * sizeof(E);
    auto& b = buffers_.emplace_back(Buffer{std::make_unique<unsigned char[]>(bytes + 2 * kGuard), bytes});
    std::memset(b.storage.get(), 0xFF, bytes + 2 * kGuard);
    if (bytes > 0) std::memcpy(b.storage.get() + kGuard, host.data(), bytes);
    return reinterpret_cast<E*>(b.storage.get() + kGuard);
  }
  template <class E>
  std::vector<E> get(const E* p, std::size_t n) {
    std::vector<E> v(n);
    if (n > 0) std::memcpy(v.data(), p, n * sizeof(E));
    const auto* bytes = reinterpret_cast<const unsigned char*>(p);
    gets_.emplace_back(bytes, bytes + n * sizeof(E));
    return v;
  }
  bool guards_intact() const {
    for (const Buffer& b : buffers_)
      for (std::size_t i = 0; i < kGuard; ++i)
        if (b.storage[i] != 0xFF || b.storage[kGuard + b.bytes + i] != 0xFF) return false;
    return true;
  }
  const std::vector<std::vector<unsigned char>>& gets() const { return gets_; }

  void state_init(const AttentionState<float>& st, const AttentionShape& s) {
    kernels::attention_state_init(nullptr, st, s);
  }
  template <class T>
  void block_forward(const AttentionState<float>& st, const T* qkv, const T* kv, const AttentionShape& s,
                     const AttentionBlock& blk) {
    kernels::attention_block_forward<T>(nullptr, st, qkv, kv, s, blk);
  }
  template <class T>
  void state_finish(T* out, float* lse, const AttentionState<float>& st, const AttentionShape& s) {
    kernels::attention_state_finish<T>(nullptr, out, lse, st, s);
  }
  template <class T>
  void dsum(float* d, const T* dout, const T* out, const AttentionShape& s) {
    kernels::attention_dsum<T>(nullptr, d, dout, out, s);
  }
  template <class T>
  void block_backward(float* dq, float* dkv, const T* dout, const T* qkv, const T* kv, const float* lse,
                      const float* dsum, const AttentionShape& s, const AttentionBlock& blk) {
    kernels::attention_block_backward<T>(nullptr, dq, dkv, dout, qkv, kv, lse, dsum, s, blk);
  }

 private:
  struct Buffer {
    std::unique_ptr<unsigned char[]> storage;
    std::size_t bytes;
  };
  std::vector<Buffer> buffers_;
  std::vector<std::vector<unsigned char>> gets_;
};

void report(const std::string& name, const blocks::Ratios& r, bool guards) {
  std::printf("%s %s: error/tolerance %s%s\n", r.pass() && guards ? "ok  " : "FAIL", name.c_str(), r.describe().c_str(),
              guards ? "" : "; WRITES OUTSIDE A BUFFER");
  CAPTURE(name);
  CAPTURE(r.describe());
  CHECK(r.pass());
  CHECK(guards);
}

}  // namespace

TEST_CASE_TEMPLATE("emulated CUDA attention blocks match the CPU block kernels", T, float, bf16, f16) {
  for (const blocks::BlockCase& c : blocks::block_cases()) {
    EmulatedDevice dev;
    const blocks::Ratios r = blocks::block_case<T>(dev, c);
    report(blocks::block_case_name<T>(c), r, dev.guards_intact());
  }
}

TEST_CASE_TEMPLATE("emulated CUDA ring attention over 1, 2 and 4 ranks matches the whole-sequence CPU kernels", T,
                   float, bf16, f16) {
  for (const blocks::RingCase& c : blocks::ring_cases()) {
    EmulatedDevice dev;
    const blocks::Ratios r = blocks::ring_case<T>(dev, c.whole, c.cp);
    report(blocks::ring_case_name<T>(c.whole, c.cp), r, dev.guards_intact());
  }
}

TEST_CASE("emulated CUDA attention blocks give the same bits under a shuffled schedule") {
  for (const blocks::BlockCase& c : {blocks::block_cases()[0], blocks::block_cases()[1]}) {
    EmulatedDevice in_order, shuffled;
    static_cast<void>(blocks::block_case<float>(in_order, c));
    emulation::device().schedule_seed = 0x9E3779B97F4A7C15ull;
    static_cast<void>(blocks::block_case<float>(shuffled, c));
    emulation::device().schedule_seed = 0;
    CAPTURE(blocks::block_case_name<float>(c));
    CHECK(in_order.gets() == shuffled.gets());
  }
}

TEST_CASE("emulated CUDA attention_state_init is the CPU's, bit for bit") {
  const AttentionShape s{2, 9, 4, 2, 32};
  const std::size_t n_o = s.batch * s.seq * s.q_dim(), n_ml = s.batch * s.heads * s.seq;
  std::vector<float> o(n_o, 1.0f), m(n_ml, 1.0f), l(n_ml, 1.0f);
  llmpar::backend::cpu::attention_state_init<float>({o.data(), m.data(), l.data()}, s);
  EmulatedDevice dev;
  const AttentionState<float> st{dev.put(std::vector<float>(n_o, 2.0f)), dev.put(std::vector<float>(n_ml, 2.0f)),
                                 dev.put(std::vector<float>(n_ml, 2.0f))};
  dev.state_init(st, s);
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  CHECK(same(dev.get(st.o, n_o), o));
  CHECK(same(dev.get(st.m, n_ml), m));
  CHECK(same(dev.get(st.l, n_ml), l));
  CHECK(dev.guards_intact());
}

TEST_CASE("emulated CUDA attention blocks reject blocks that do not fit and unsupported head sizes") {
  float f = 0.f;
  const AttentionState<float> st{&f, &f, &f};
  const AttentionShape s{1, 16, 2, 2, 32};
  const AttentionBlock past_end{.q_first = 8, .kv_seq = 16, .kv_first = 0, .len = 9, .kv_stride = 128, .v_offset = 64};
  CHECK_THROWS_WITH_AS(kernels::attention_block_forward<float>(nullptr, st, &f, &f, s, past_end),
                       doctest::Contains("a block of 9 rows at query row 8"), llmpar::Error);
  CHECK_THROWS_WITH_AS(kernels::attention_block_backward<float>(nullptr, &f, &f, &f, &f, &f, &f, &f, s, past_end),
                       doctest::Contains("does not fit sequences of 16 query and 16 key rows"), llmpar::Error);
  const AttentionBlock narrow{.kv_seq = 16, .len = 4, .kv_stride = 100, .k_offset = 0, .v_offset = 64};
  CHECK_THROWS_WITH_AS(kernels::attention_block_forward<float>(nullptr, st, &f, &f, s, narrow),
                       doctest::Contains("key rows of 100 elements cannot hold k at 0 and v at 64"), llmpar::Error);
  const AttentionShape odd{1, 16, 2, 2, 12};
  CHECK_THROWS_WITH_AS(kernels::attention_state_init(nullptr, st, odd),
                       doctest::Contains("supported head sizes are the multiples of 8 from 16 to 256"), llmpar::Error);
  CHECK_THROWS_WITH_AS(kernels::attention_state_finish<float>(nullptr, &f, &f, st, odd),
                       doctest::Contains("head size head_dim = 12 is not supported"), llmpar::Error);
}
