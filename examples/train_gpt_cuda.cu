// train_gpt_cuda.cu — train_gpt's run on backend::Cuda (compiled by nvcc; linked into
// train_gpt in CUDA builds). Each rank trains on the GPU its NCCL communicator chose.
#include <cuda_runtime.h>

#include "train_gpt.hpp"

namespace train_gpt {

int cuda_device_count() { return backend::cuda::device_count(); }

int run_cuda(const Options& o, comm::Comm& world) {
  int device = 0;
  LLMPAR_CHECK_CUDA(cudaGetDevice(&device));
  comm::NcclComm* nccl = world.get<comm::NcclComm>();
  LLMPAR_CHECK(nccl != nullptr, "--backend cuda runs its ranks over NCCL, but this world is ", world.engine_name());
  // One communication stream (NCCL's), and NCCL's operations ordered after the compute
  // stream's work, which produces the gradients they reduce.
  backend::cuda::Context ctx(device, o.tf32 ? backend::cuda::Fp32Math::tf32 : backend::cuda::Fp32Math::strict,
                             nccl->stream());
  nccl->set_compute_stream(ctx.stream());
  // The MFU denominator: the data sheet's dense 16-bit tensor-core peak of each GPU.
  const double peak = o.peak_gflops > 0.0 ? o.peak_gflops : 1e3 * world.size() * backend::cuda::tensor_peak_tflops(device);
  return run_on<backend::Cuda>(o, world, ctx, peak);
}

}  // namespace train_gpt
