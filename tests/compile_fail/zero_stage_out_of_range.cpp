// ZeRO has stages 0 to 3.
// expect: llmpar: zero::Stage<N> takes N = 0 (nothing sharded), 1 (optimizer state)
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<parallel::Data<zero::Stage<4>>>;
