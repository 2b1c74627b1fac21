// ThreadComm's collectives (include/llmpar/comm/thread_comm-inl.hpp), compiled once for
// a program built with LLMPAR_COMPILED.
#include "llmpar/comm/thread_comm-inl.hpp"
