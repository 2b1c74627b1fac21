// A model declared with one composed policy, trained under another: the policy is named
// once, in the model's type.
// expect: llmpar::train::Trainer: the model was declared with another composed policy
#include <llmpar/backend/cpu/backend.hpp>
#include <llmpar/models/gpt2.hpp>
#include <llmpar/train/trainer.hpp>
using namespace llmpar;
using Model = models::GPT2<Compose<backend::Cpu, precision::FP32, parallel::Data<zero::Stage<1>>>>;
using Other = Compose<backend::Cpu, precision::FP32, parallel::Data<zero::Stage<2>>>;
template class train::Trainer<Model, Other>;
