// A pipeline schedule before pipeline parallelism is built: it would train as one stage.
// expect: llmpar::Compose: parallel::Pipeline<...> is not built yet
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<parallel::Pipeline<schedule::OneFOneB>>;
static_assert(Policy::kPipelineChunks == 1);
