// train_gpt_cuda.cpp — train_gpt's run on backend::Cuda (CUDA builds; plain C++, the kernels
// come from the build's llmpar_cuda_ops). Each rank trains on the GPU its NCCL communicator chose.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "train_gpt.hpp"

namespace train_gpt {

int cuda_device_count() { return backend::cuda::device_count(); }

int run_cuda(const Options& o, comm::Comm& world) {
  int device = 0;
  LLMPAR_CHECK_CUDA(cudaGetDevice(&device));
  const backend::cuda::Fp32Math fp32 = o.tf32 ? backend::cuda::Fp32Math::tf32 : backend::cuda::Fp32Math::strict;
#if defined(LLMPAR_WITH_NCCL)
  comm::NcclComm* nccl = world.get<comm::NcclComm>();
  LLMPAR_CHECK(nccl != nullptr, "--backend cuda runs its ranks over NCCL, but this world is ", world.engine_name());
  // One communication stream (NCCL's), and NCCL's operations ordered after the compute
  // stream's work, which produces the gradients they reduce.
  backend::cuda::Context ctx(device, fp32, nccl->stream());
  nccl->set_compute_stream(ctx.stream());
#else
  // A build without NCCL: one GPU, a world of one rank (llmpar::init makes sure), so no
  // collective ever touches device memory.
  LLMPAR_CHECK(world.size() == 1, "--backend cuda without NCCL trains on one GPU, but the world has ", world.size(),
               " ranks; build with NCCL and MPI (LLMPAR_NCCL=ON) for several GPUs");
  backend::cuda::Context ctx(device, fp32);
#endif
  // The MFU denominator: --peak-gflops, or the data sheet's dense peak of each GPU in the run's precision
  // (bf16/f16 tensor cores; TF32 or CUDA cores for fp32), times the GPUs.
  return run_on<backend::Cuda>(o, world, ctx, [&](DType dtype, const LinearSizes&, std::int64_t) {
    if (const auto given = given_peak(o)) return *given;
    const double tflops = backend::cuda::datasheet_peak_tflops(device, dtype, fp32);
    char source[160];
    std::snprintf(source, sizeof source, "%.1f TFLOP/s: the data sheet's dense %s peak of %d GPU%s%s",
                  tflops * world.size(),
                  dtype == DType::f32 ? (o.tf32 ? "TF32" : "FP32") : std::string(name_of(dtype)).c_str(), world.size(),
                  world.size() == 1 ? "" : "s", tflops > 0.0 ? "" : " (unknown part: MFU not reported)");
    return Peak{1e3 * tflops * world.size(), source};
  });
}

}  // namespace train_gpt
