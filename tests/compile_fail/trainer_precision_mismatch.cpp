// A float model trained under a bf16 policy: the trainer would not do what the policy says.
// expect: llmpar::train::Trainer: the model's storage type is not the policy precision's Compute type
#include <llmpar/backend/cpu/backend.hpp>
#include <llmpar/models/gpt2.hpp>
#include <llmpar/train/trainer.hpp>
using namespace llmpar;
using Model = models::GPT2<float, backend::Cpu>;
using Policy = Compose<backend::Cpu, precision::BF16Mixed>;
template class train::Trainer<Model, Policy>;
