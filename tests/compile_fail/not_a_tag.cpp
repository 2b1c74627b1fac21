// A type that is not a policy tag: a schedule belongs inside parallel::Pipeline<...>.
// expect: llmpar::Compose: a template argument is not a policy tag
#include <llmpar/parallel/compose.hpp>
using namespace llmpar;
using Policy = Compose<backend::Cpu, schedule::GPipe>;
