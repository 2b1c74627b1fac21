// Two precision tags in one Compose.
// expect: llmpar::Compose: two precision policies were given; keep one
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<precision::FP32, backend::Cpu, precision::BF16Mixed>;
