// Checkpoint reading and writing (include/llmpar/checkpoint/*-inl.hpp), compiled once
// for a program built with LLMPAR_COMPILED.
#include "llmpar/checkpoint/checkpoint-inl.hpp"
#include "llmpar/checkpoint/hf_gpt2-inl.hpp"
#include "llmpar/checkpoint/hf_llama-inl.hpp"
#include "llmpar/checkpoint/safetensors-inl.hpp"
#include "llmpar/checkpoint/trainer_state-inl.hpp"
