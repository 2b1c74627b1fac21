// Full recomputation before it is built: the run would keep every activation.
// expect: llmpar::Compose: recompute::Full is not built yet
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<recompute::Full>;
static_assert(Policy::kZeroStage == 0);
