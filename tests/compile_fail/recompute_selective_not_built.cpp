// Selective recomputation before it is built: the run would keep every activation.
// expect: llmpar::Compose: recompute::Selective is not built yet
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<backend::Cuda, recompute::Selective>;
static_assert(Policy::kOnCuda);
