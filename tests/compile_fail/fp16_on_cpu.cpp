// fp16 compute on the CPU backend (the default backend).
// expect: llmpar::Compose: precision::FP16Mixed cannot run on backend::Cpu
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<precision::FP16Mixed<precision::DynamicLossScale>>;
