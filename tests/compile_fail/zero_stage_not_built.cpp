// A ZeRO stage above 0 before sharding is built: the run would replicate everything.
// expect: llmpar::Compose: parallel::Data<zero::Stage<K>> with K > 0 is not built yet
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<parallel::Data<zero::Stage<2>>>;
static_assert(Policy::kZeroStage == 2);
