// Two tensor-parallel tags in one Compose (sequence parallel on and off).
// expect: llmpar::Compose: two tensor-parallel policies (parallel::Tensor<...>) were given; keep one
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<parallel::Tensor<SequenceParallel::on>, parallel::Tensor<SequenceParallel::off>>;
