// llmpar/llmpar.hpp — the umbrella header: everything a trainer needs.
//
// A translation unit compiled by the C++ compiler gets backend::Cpu; one compiled by
// nvcc gets backend::Cuda with its device code instead (backend/backend.hpp says why
// not both). A C++ translation unit that also includes llmpar/backend/cuda/backend.hpp
// gets backend::Cuda as well, its device code compiled once elsewhere in the program
// (backend/cuda/ops.cuh): examples/train_gpt trains on both that way.
#pragma once

#if defined(__CUDACC__)
#include "llmpar/backend/cuda/backend.hpp"
#else
#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/backend/cpu/peak.hpp"
#endif
#include "llmpar/backend/backend.hpp"
#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/hf_gpt2.hpp"
#include "llmpar/checkpoint/hf_llama.hpp"
#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/checkpoint/trainer_state.hpp"
#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/comm/types.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/data/shard.hpp"
#include "llmpar/data/tokenizer.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/models/llama.hpp"
#include "llmpar/nn/layer.hpp"
#include "llmpar/nn/layernorm.hpp"
#include "llmpar/nn/linear.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/rmsnorm.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/units.hpp"
#include "llmpar/nn/vocab_parallel.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/optim/schedule.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/grad_sync.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/pipeline/executor.hpp"
#include "llmpar/pipeline/partition.hpp"
#include "llmpar/pipeline/schedule.hpp"
#include "llmpar/plan/cluster.hpp"
#include "llmpar/plan/cost.hpp"
#include "llmpar/precision/loss_scaler.hpp"
#include "llmpar/precision/policy.hpp"
#include "llmpar/train/metrics.hpp"
#include "llmpar/train/sample.hpp"
#include "llmpar/train/spike_guard.hpp"
#include "llmpar/train/trace.hpp"
#include "llmpar/train/trainer.hpp"
