// llmpar/backend/backend.hpp — the backend policy tags, declared.
//
// A backend is an empty tag type that names where a model's tensors live and which
// kernels run them: backend::Cpu (backend/cpu/backend.hpp: host memory, OpenMP kernels,
// oneDNN GEMMs) or backend::Cuda (backend/cuda/backend.hpp: device memory, llmpar's CUDA
// kernels, cuBLASLt GEMMs). Models and layers are templates over the tag and call its
// static operations with the tag's Context, so one model source serves both.
//
// The two are defined in separate headers. backend::Cpu needs oneDNN's C++ header, which
// nvcc 13's front end cannot parse in C++20 mode, so a translation unit that nvcc
// compiles uses backend::Cuda alone. A plain C++ translation unit may use either or
// both: backend/cuda/backend.hpp declares the operations whose device code the host
// compiler cannot build, and the program compiles those once, in .cu files of its own
// (backend/cuda/ops.cuh). Here the tags are only declared, so a model header can name
// backend::Cpu as its default without pulling in either.
#pragma once

#include <concepts>
#include <cstdint>

namespace llmpar::backend {

struct Cpu;
struct Cuda;

// What a model needs from a backend tag (checked where a model is instantiated).
template <class B>
concept Backend = requires {
  typename B::Context;  // per-rank execution state passed to every operation
  typename B::Space;    // memory space of llmpar::Buffer for tensors
  { B::kName } -> std::convertible_to<const char*>;
};

}  // namespace llmpar::backend
