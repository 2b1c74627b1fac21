// train_gpt's runs in fp16 on the CUDA backend: run<Policy, models::GPT2Spec> for ZeRO stages 0 to 3 (the
// policies parallel::dispatch names). One translation unit per precision, so that a
// build compiles train_gpt's instantiations in parallel (train_gpt.hpp declares them).
#include "train_gpt.hpp"

namespace train_gpt {
TRAIN_GPT_RUN_POLICIES(, backend::Cuda, precision::FP16Mixed<precision::DynamicLossScale>, models::GPT2Spec)
}  // namespace train_gpt
