// The trainer's metrics and trace files (include/llmpar/train/*-inl.hpp), compiled once
// for a program built with LLMPAR_COMPILED.
#include "llmpar/train/metrics-inl.hpp"
#include "llmpar/train/trace-inl.hpp"
