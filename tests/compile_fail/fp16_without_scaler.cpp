// FP16Mixed without a loss scaler (on CUDA, so that only this mistake is present).
// expect: llmpar: precision::FP16Mixed<Scaler> needs a loss scaler
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<backend::Cuda, precision::FP16Mixed<void>>;
