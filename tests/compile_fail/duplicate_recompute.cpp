// Two recompute tags in one Compose.
// expect: llmpar::Compose: two recompute policies were given; keep one
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<recompute::Full, recompute::Selective>;
