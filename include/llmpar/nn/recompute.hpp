// llmpar/nn/recompute.hpp — what a model recomputes in backward: its run-time setting.
//
// A value of the model (models::Transformer::set_recompute) and of the run's layout
// (parallel::LayoutConfig::recompute); the policy tags that fix it at compile time
// (recompute::None, Full, Selective, Configured) are parallel/compose.hpp's.
#pragma once

#include <cstdint>

namespace llmpar::recompute {

// none: keep every activation backward needs; selective: drop the attention core's
// outputs and recompute them from the kept q, k, v; full: keep only each block's input
// and rerun its forward just before its backward.
enum class Mode : std::uint8_t { none, selective, full };

}  // namespace llmpar::recompute
