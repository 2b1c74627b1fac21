// llmpar/core/tensor.hpp — owning buffers per memory space, and shaped views.
//
// Deliberately small: llmpar is not a tensor library. Layers own their parameters,
// gradients and activations as Buffers (one allocation each, 64-byte aligned on the
// host) and hand kernels raw pointers with explicit sizes, like llm.c. A View adds a
// row-major shape to a pointer for the places that pass tensors around (tests,
// checkpoints, the parameter visitor).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>
#include <ostream>
#include <type_traits>
#include <utility>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar {

namespace memory {
// Host memory (pageable, 64-byte aligned). The CUDA backend adds memory::Device
// (backend/cuda/memory.hpp) with the same static interface.
struct Host {
  static void* allocate(std::size_t bytes) {
    const std::size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    void* p = std::aligned_alloc(kHostAlignment, rounded == 0 ? kHostAlignment : rounded);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  static void release(void* p) noexcept { std::free(p); }
  // Synchronous fills and copies between this space and the host: what set-up code
  // (initialisation, checkpoints, tests) needs. Work inside a step goes through the
  // backend's context instead, on its stream.
  static void zero(void* p, std::size_t bytes) { std::memset(p, 0, bytes); }
  static void copy_from_host(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  static void copy_to_host(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  // n elements within this space.
  template <class T>
  static void copy(T* dst, const T* src, std::int64_t n) {
    if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T));
  }
  static constexpr bool kHostAccessible = true;
};
}  // namespace memory

// Row-major shape of up to four dimensions.
struct Shape {
  static constexpr int kMaxRank = 4;
  std::array<std::int64_t, kMaxRank> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> d) {
    LLMPAR_CHECK(d.size() <= kMaxRank, "a Shape has at most ", kMaxRank, " dimensions, got ", d.size());
    for (std::int64_t v : d) {
      LLMPAR_CHECK(v >= 0, "shape dimension ", rank, " is ", v, "; dimensions must be >= 0");
      dims[rank++] = v;
    }
  }
  std::int64_t operator[](int i) const { return dims[i]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank != b.rank) return false;
    for (int i = 0; i < a.rank; ++i)
      if (a.dims[i] != b.dims[i]) return false;
    return true;
  }
  friend std::ostream& operator<<(std::ostream& os, const Shape& s) {
    os << '(';
    for (int i = 0; i < s.rank; ++i) os << (i ? "," : "") << s.dims[i];
    return os << ')';
  }
};

// A non-owning, contiguous, row-major view.
template <class T>
struct View {
  T* data = nullptr;
  Shape shape;

  std::int64_t numel() const { return shape.numel(); }
  T& operator[](std::int64_t i) const { return data[i]; }
  T* begin() const { return data; }
  T* end() const { return data + numel(); }
  // View<T> -> View<const T> (a template, so that View<const T> itself declares none).
  template <class U = T>
    requires(std::is_same_v<U, T> && !std::is_const_v<U>)
  operator View<const U>() const {
    return {data, shape};
  }
};

// An owning, move-only, aligned array of T in memory space Space. Contents are
// uninitialised after construction or resize; call zero() where zeros are meant.
template <class T, class Space = memory::Host>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::int64_t n) { resize(n); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~Buffer() { reset(); }

  // Reallocates to exactly n elements when the size changes; contents are lost.
  void resize(std::int64_t n) {
    LLMPAR_CHECK(n >= 0, "buffer size ", n, " is negative");
    if (n == size_) return;
    reset();
    if (n > 0) data_ = static_cast<T*>(Space::allocate(static_cast<std::size_t>(n) * sizeof(T)));
    size_ = n;
  }
  // Grows to at least n elements (never shrinks); contents are lost when it grows.
  void reserve(std::int64_t n) {
    if (n > size_) resize(n);
  }
  void zero() {
    if (size_ > 0) Space::zero(static_cast<void*>(data_), bytes());
  }
  void reset() noexcept {
    if (data_ != nullptr) Space::release(data_);
    data_ = nullptr;
    size_ = 0;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::int64_t size() const { return size_; }
  std::size_t bytes() const { return static_cast<std::size_t>(size_) * sizeof(T); }
  T& operator[](std::int64_t i) { return data_[i]; }
  const T& operator[](std::int64_t i) const { return data_[i]; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }

  View<T> view(Shape s) {
    LLMPAR_CHECK(s.numel() <= size_, "view of shape ", s, " needs ", s.numel(), " elements; buffer holds ", size_);
    return {data_, s};
  }

 private:
  T* data_ = nullptr;
  std::int64_t size_ = 0;
};

}  // namespace llmpar
