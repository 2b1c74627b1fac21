// parallel::Pipeline of something that is not a schedule tag.
// expect: llmpar: parallel::Pipeline<Schedule> takes a schedule tag
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<parallel::Pipeline<int>>;
static_assert(Policy::kPipelineChunks == 1);
