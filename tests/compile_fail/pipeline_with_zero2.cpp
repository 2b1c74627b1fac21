// A pipeline with ZeRO stage 2: its per-micro-batch reductions cannot follow a
// pipeline's interleaved micro-batches.
// expect: llmpar::Compose: parallel::Pipeline<...> with zero::Stage<2> or <3>
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<parallel::Pipeline<schedule::OneFOneB>, parallel::Data<zero::Stage<2>>>;
static_assert(Policy::kZeroStage == 2);
