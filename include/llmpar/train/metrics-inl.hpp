// llmpar/train/metrics-inl.hpp — the bodies of metrics.hpp's JSON-lines writer and step line.
//
// metrics.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "llmpar/train/metrics.hpp"

namespace llmpar::train {

LLMPAR_INLINE MetricsWriter::MetricsWriter(const std::string& path, bool append) {
  if (path.empty()) return;
  out_.open(path, std::ios::out | (append ? std::ios::app : std::ios::trunc));
  LLMPAR_CHECK(out_.good(), "cannot open metrics file '", path,
               "' for writing; check the directory exists and is writable");
}

LLMPAR_INLINE void MetricsWriter::write(const nlohmann::json& record) {
  if (!enabled()) return;
  out_ << record.dump() << '\n';
  out_.flush();
}

LLMPAR_INLINE void MetricsWriter::write_step(const StepStats& s) {
  if (s.rolled_back) {
    write({{"type", "rollback"},
           {"step", s.step},
           {"to_step", s.rolled_back_to},
           {"loss", s.loss},
           {"grad_norm", s.grad_norm},
           {"reason", s.spike},
           {"skipped_batches", s.skipped_batches}});
    return;
  }
  write({{"type", "step"},
         {"step", s.step},
         {"loss", s.loss},
         {"lr", s.lr},
         {"grad_norm", s.grad_norm},
         {"ms", s.ms},
         {"tokens_per_s", s.tokens_per_s},
         {"mfu", s.mfu ? nlohmann::json(*s.mfu) : nlohmann::json(nullptr)},
         {"loss_scale", s.loss_scale},
         {"skipped", s.skipped},
         {"skipped_total", s.skipped_total},
         {"comm_ms", s.comm_ms},
         {"bubble_ms", s.bubble_ms}});
  if (s.incident) {
    const Incident& i = *s.incident;
    write({{"type", "incident"},
           {"kind", "loss_spike"},
           {"step", s.step},
           {"first_step", i.first_step},
           {"last_step", i.last_step},
           {"rollbacks", i.rollbacks},
           {"skipped_steps", i.skipped_steps},
           {"losses", i.losses},
           {"reason", i.first_reason},
           {"seconds", i.seconds}});
  }
}

LLMPAR_INLINE std::string format_incident(const Incident& i) {
  char line[480];
  std::snprintf(line, sizeof line,
                "loss spike incident: steps %lld-%lld, %d rollback%s, %lld steps of data skipped, %.2f s lost (%s)",
                static_cast<long long>(i.first_step), static_cast<long long>(i.last_step), i.rollbacks,
                i.rollbacks == 1 ? "" : "s", static_cast<long long>(i.skipped_steps), i.seconds,
                i.first_reason.c_str());
  return line;
}

LLMPAR_INLINE std::string format_step(const StepStats& s, std::int64_t total_steps, bool scaled) {
  char line[480];
  if (s.rolled_back) {
    std::snprintf(line, sizeof line,
                  "step %5lld/%lld | loss %.4f | norm %.3f | loss spike: %s; rolled back to step %lld, skipping %lld "
                  "batch%s",
                  static_cast<long long>(s.step), static_cast<long long>(total_steps), s.loss, s.grad_norm,
                  s.spike.c_str(), static_cast<long long>(s.rolled_back_to), static_cast<long long>(s.skipped_batches),
                  s.skipped_batches == 1 ? "" : "es");
    return line;
  }
  char mfu[16] = "  n/a";  // no peak given or measured: no fraction of it
  if (s.mfu) std::snprintf(mfu, sizeof mfu, "%5.1f%%", 100.0 * *s.mfu);
  int n = std::snprintf(line, sizeof line,
                        "step %5lld/%lld | loss %.4f | lr %.3e | norm %.3f | %8.1f ms | %9.0f tok/s | MFU %s",
                        static_cast<long long>(s.step), static_cast<long long>(total_steps), s.loss, s.lr, s.grad_norm,
                        s.ms, s.tokens_per_s, mfu);
  if (s.bubble_ms > 0.0 && n > 0 && n < static_cast<int>(sizeof line))
    n += std::snprintf(line + n, sizeof line - static_cast<std::size_t>(n), " | bubble %4.1f%%",
                       100.0 * s.bubble_ms / s.ms);
  if (scaled && n > 0 && n < static_cast<int>(sizeof line))
    n += std::snprintf(line + n, sizeof line - static_cast<std::size_t>(n), " | scale %g", s.loss_scale);
  if (s.skipped && n > 0 && n < static_cast<int>(sizeof line))
    std::snprintf(line + n, sizeof line - static_cast<std::size_t>(n), " | skipped: inf/NaN gradient (%lld so far)",
                  static_cast<long long>(s.skipped_total));
  return line;
}

}  // namespace llmpar::train
