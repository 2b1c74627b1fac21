// llmpar-scaling — predicts a large run's loss from small ones, then trains the large
// one and reports predicted against achieved.
//
//   llmpar-scaling --data data/docs_train.bin --out scaling           # about an hour on 2 cores
//   llmpar-scaling --budget 16 ...                                  # 16x the compute of every run
//   llmpar-scaling --synthetic --out synthetic                      # losses from a known law: the fit's check
//
// What it does, in order (each run is train_gpt, its log and metrics in OUT/runs/):
//  1. Learning rate (--lr-sweep, on by default): a short sweep of learning rates at two
//     widths (4x and 16x the family's smallest; the narrower is µP's base width), in
//     the standard parametrisation and in µP (plan::rate_rule). Where µP's best
//     rate stays put between the widths, every run that follows trains in µP at the base
//     width's best rate; where it moves too, they train in SP at the rate SP's own best
//     rates give, lr · (base / width)^e with e measured by the sweep (unless --lr).
//  2. The fit sweep: at least 5 models of one family spanning 30x in parameters, width and
//     depth grown together (head dimension fixed, layers ~ width / aspect), each trained
//     for `--tokens-per-param` (20, Chinchilla) tokens per parameter, at that rate. The two
//     smallest also train at 1/4 and 4x that ratio: the Chinchilla fit needs runs where
//     N and D do not move together.
//  3. The fits (plan/scaling.hpp): L(C) = a·C^b + c over the rule's runs, L(N, D) = E +
//     A/N^α + B/D^β over all of them, with bootstrap intervals.
//  4. The held-out model: one with at least 10x the compute of the largest fit run,
//     trained the same way; its achieved loss against the prediction and interval.
// OUT/scaling.json (the report), OUT/runs.csv and, with ./llmpar.sh scaling, the plot.
// Finished runs are kept in OUT/runs.jsonl: a sweep stopped and started again reruns
// only what is missing.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "llmpar/core/error.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/plan/scaling.hpp"
#include "llmpar/train/metrics.hpp"
#include "subprocess.hpp"

using namespace llmpar;
namespace fs = std::filesystem;

namespace {

// One model of the family.
struct Shape {
  std::int64_t layers = 1, dim = 32;
  std::int64_t heads() const { return dim / 16; }
};

struct SweepConfig {
  std::string data, train_gpt, out = "scaling";
  double budget = 1.0;
  double tokens_per_param = 20.0;
  std::int64_t seq = 128, batch = 16;
  int ranks = 1;
  double aspect = 32.0;  // width / depth
  bool mup = true, lr_sweep = true, synthetic = false;
  std::optional<double> lr;
  std::int64_t eval_batches = 64;
};

models::GPT2Config config_of(const Shape& s, const SweepConfig& c) {
  models::GPT2Config cfg = models::GPT2Config::preset("gpt2-tiny");
  cfg.layers = s.layers;
  cfg.dim = s.dim;
  cfg.heads = s.heads();
  cfg.max_seq = c.seq;
  return cfg;
}

double params_of(const Shape& s, const SweepConfig& c) { return static_cast<double>(config_of(s, c).num_parameters()); }

// The family: width w·k for k = 1, 2, ..., heads of 16 channels, depth width / 16 (at
// least 1), so width and depth grow together. w = 16 at budget 1; compute grows as
// params² and params as width³, so --budget B scales w by B^(1/6) (in steps of 16).
Shape family(int k, const SweepConfig& c) {
  const std::int64_t w = 16 * std::max<std::int64_t>(1, std::llround(std::pow(c.budget, 1.0 / 6.0)));
  const std::int64_t dim = w * k;
  return {std::max<std::int64_t>(1, dim / 16), dim};
}

// The smallest model of width a multiple of 16 and depth between width/24 and width/12
// with at least `target` parameters.
Shape smallest_above(double target, const SweepConfig& c) {
  Shape best{1, 16};
  double best_params = std::numeric_limits<double>::infinity();
  for (std::int64_t dim = 16; dim <= 8192; dim += 16)
    for (std::int64_t layers = std::max<std::int64_t>(1, dim / 24); layers <= std::max<std::int64_t>(1, dim / 12);
         ++layers) {
      const double n = params_of({layers, dim}, c);
      if (n >= target && n < best_params) {
        best_params = n;
        best = {layers, dim};
      }
    }
  return best;
}

// One training run: a model, its tokens and learning rate, and what it achieved.
struct Run {
  std::string name, role;  // role: "lr-sp", "lr-mup", "fit", "ratio", "held-out"
  Shape shape;
  double tokens = 0.0, lr = 0.0;
  bool mup = true;
  std::int64_t mup_base = 32;
  // results
  bool done = false;
  double params = 0.0, flops = 0.0, loss = 0.0, seconds = 0.0;
};

std::int64_t steps_of(const Run& r, const SweepConfig& c) {
  return std::max<std::int64_t>(20, std::llround(r.tokens / static_cast<double>(c.batch * c.seq)));
}

double flops_of(const Run& r, const SweepConfig& c) {
  const models::GPT2Config cfg = config_of(r.shape, c);
  const double tokens = static_cast<double>(steps_of(r, c) * c.batch * c.seq);
  return train::flops_per_token(cfg.num_parameters(), cfg.layers, cfg.dim, c.seq) * tokens;
}

nlohmann::json record_of(const Run& r) {
  return {{"name", r.name},     {"role", r.role},         {"layers", r.shape.layers},
          {"dim", r.shape.dim}, {"tokens", r.tokens},     {"lr", r.lr},
          {"mup", r.mup},       {"mup_base", r.mup_base}, {"params", r.params},
          {"flops", r.flops},   {"loss", r.loss},         {"seconds", r.seconds}};
}

// The runs OUT/runs.jsonl holds, by name, that match `r`'s configuration.
bool reuse(Run& r, const std::map<std::string, nlohmann::json>& finished) {
  const auto it = finished.find(r.name);
  if (it == finished.end()) return false;
  const nlohmann::json& j = it->second;
  if (j.at("layers") != r.shape.layers || j.at("dim") != r.shape.dim || j.at("tokens") != r.tokens ||
      std::abs(j.at("lr").get<double>() - r.lr) > 1e-12 * r.lr || j.at("mup") != r.mup)
    return false;
  r.params = j.at("params");
  r.flops = j.at("flops");
  r.loss = j.at("loss").is_null() ? std::numeric_limits<double>::quiet_NaN() : j.at("loss").get<double>();
  r.seconds = j.at("seconds");
  r.done = true;
  return true;
}

// The final validation loss of a train_gpt metrics file (NaN when it diverged).
double final_val_loss(const std::string& metrics) {
  std::ifstream in(metrics);
  double loss = std::numeric_limits<double>::quiet_NaN();
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("type", "") == "eval") loss = j.at("val_loss").get<double>();
  }
  return loss;
}

// A learning rate as train_gpt's flag, with the digits it needs.
std::string rate_flag(double lr) {
  char s[32];
  std::snprintf(s, sizeof s, "%.6g", lr);
  return s;
}

class Sweep {
 public:
  explicit Sweep(SweepConfig c) : c_(std::move(c)) {
    fs::create_directories(fs::path(c_.out) / "runs");
    std::ifstream in(fs::path(c_.out) / "runs.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("name")) finished_[j.at("name").get<std::string>()] = j;
    }
  }

  // Trains r (or takes its result from an earlier sweep); prints one progress line.
  void train(Run& r, int index, int total) {
    r.params = params_of(r.shape, c_);
    r.flops = flops_of(r, c_);
    const std::int64_t steps = steps_of(r, c_);
    std::printf("run %2d/%d %-14s L=%lld C=%lld %7.3fM params %7.2fM tokens %.2e FLOPs lr %.2e%s: ", index, total,
                r.name.c_str(), static_cast<long long>(r.shape.layers), static_cast<long long>(r.shape.dim),
                r.params * 1e-6, r.tokens * 1e-6, r.flops, r.lr, r.mup ? " µP" : " SP");
    std::fflush(stdout);
    if (reuse(r, finished_)) {
      std::printf("val loss %.4f (from %s/runs.jsonl)\n", r.loss, c_.out.c_str());
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (c_.synthetic) {
      r.loss = synthetic_loss(r);
    } else {
      const std::string base = (fs::path(c_.out) / "runs" / r.name).string();
      std::vector<std::string> args{"--ranks",
                                    std::to_string(c_.ranks),
                                    "--data",
                                    c_.data,
                                    "--layers",
                                    std::to_string(r.shape.layers),
                                    "--dim",
                                    std::to_string(r.shape.dim),
                                    "--heads",
                                    std::to_string(r.shape.heads()),
                                    "--seq",
                                    std::to_string(c_.seq),
                                    "--batch",
                                    std::to_string(c_.batch / c_.ranks),
                                    "--steps",
                                    std::to_string(steps),
                                    "--warmup",
                                    std::to_string(std::max<std::int64_t>(1, steps / 20)),
                                    "--lr",
                                    rate_flag(r.lr),
                                    "--eval-every",
                                    std::to_string(steps),
                                    "--eval-batches",
                                    std::to_string(c_.eval_batches),
                                    "--sample-tokens",
                                    "0",
                                    "--metrics",
                                    base + ".jsonl"};
      if (r.mup) {
        args.emplace_back("--mup");
        args.emplace_back("--mup-base-dim");
        args.push_back(std::to_string(r.mup_base));
      }
      fs::remove(base + ".jsonl");
      const bool ok = tools::run_program(c_.train_gpt, args, base + ".log");
      r.loss = ok ? final_val_loss(base + ".jsonl") : std::numeric_limits<double>::quiet_NaN();
      LLMPAR_CHECK(ok || r.role.rfind("lr-", 0) == 0, "train_gpt failed for run ", r.name, "; see ", base, ".log");
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.done = true;
    std::printf("val loss %.4f in %.0f s\n", r.loss, r.seconds);
    std::ofstream out(fs::path(c_.out) / "runs.jsonl", std::ios::app);
    nlohmann::json j = record_of(r);
    if (!std::isfinite(r.loss)) j["loss"] = nullptr;
    out << j.dump() << "\n";
  }

  const SweepConfig& config() const { return c_; }

 private:
  // --synthetic: Chinchilla's law with the paper's parameters (rescaled to this
  // family's sizes) and 0.3% multiplicative noise, seeded by the run's name: what the
  // fit must recover.
  double synthetic_loss(const Run& r) const {
    std::uint64_t h = 1469598103934665603ull;
    for (char ch : r.name) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    const double u = static_cast<double>(h >> 11) / 9007199254740992.0;  // [0, 1)
    const double noise = 1.0 + 0.003 * (2.0 * u - 1.0);
    return (kSynthetic.E + kSynthetic.A / std::pow(r.params, kSynthetic.alpha) +
            kSynthetic.B / std::pow(r.tokens, kSynthetic.beta)) *
           noise;
  }

 public:
  static constexpr plan::ChinchillaFit kSynthetic{.E = 0.9, .A = 45.0, .B = 180.0, .alpha = 0.34, .beta = 0.36};

 private:
  SweepConfig c_;
  std::map<std::string, nlohmann::json> finished_;
};

std::string size_name(double params) {
  char s[32];
  if (params >= 1e6)
    std::snprintf(s, sizeof s, "%.2fM", params * 1e-6);
  else
    std::snprintf(s, sizeof s, "%.0fk", params * 1e-3);
  return s;
}

// How the rule reads in the log.
std::string describe(const plan::RateRule& r) {
  char s[160];
  std::snprintf(s, sizeof s, "learning rate: %s, %.3g at width %lld, x (%lld / width)^%.2f (",
                plan::parametrization_name(r.parametrization), r.lr, static_cast<long long>(r.base_width),
                static_cast<long long>(r.base_width), r.exponent);
  return s + r.why + ")";
}

int run_sweep(const SweepConfig& c) {
  Sweep sweep(c);
  // Five sizes of the family (44x in parameters at budget 1, 9.5k to 420k), and the
  // held-out model: the smallest with sqrt(10) x the largest's parameters, so 10x its
  // compute at the same tokens per parameter.
  std::vector<Shape> fit_shapes;
  for (int k = 1; k <= 5; ++k) fit_shapes.push_back(family(k, c));
  const double fit_max = params_of(fit_shapes.back(), c);
  const Shape held = smallest_above(fit_max * std::sqrt(10.0), c);
  // µP's base width and the sweep's narrower width: 4x the family's smallest (64 at
  // budget 1). Below that (16 channels, one head) µP is too far from the wide limit it
  // rests on for its best rate to hold still: measured, it moved as SP's did between
  // widths 16 and 64, and held between 64 and 256.
  const std::int64_t base_width = 4 * fit_shapes.front().dim;
  std::vector<Run> runs;
  // 1. Learning rates at two widths (4x apart, two layers) in both parametrisations.
  const std::vector<double> rates{2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2};
  if (c.lr_sweep) {
    const std::int64_t depth = 2;
    for (bool mup : {false, true})
      for (std::int64_t width : {base_width, 4 * base_width})
        for (double lr : rates) {
          Run r;
          r.role = mup ? "lr-mup" : "lr-sp";
          r.shape = {depth, width};
          // The same tokens at both widths, 4 per parameter of the base width's model
          // (0.5M at budget 1): enough to place the best rate, which is all the sweep is for.
          r.tokens = std::round(4.0 * params_of({depth, base_width}, c));
          r.lr = lr;
          r.mup = mup;
          r.mup_base = base_width;
          char name[64];
          std::snprintf(name, sizeof name, "%s-C%lld-lr%.3g", mup ? "mup" : "sp", static_cast<long long>(width), lr);
          r.name = name;
          runs.push_back(r);
        }
  }
  const std::size_t lr_runs = runs.size();
  int index = 0;
  const int total_estimate = static_cast<int>(lr_runs + fit_shapes.size() + 4 + 1);  // fit, ratio, held-out
  for (std::size_t i = 0; i < lr_runs; ++i) sweep.train(runs[i], ++index, total_estimate);
  std::vector<plan::LrSweepPoint> lr_sweep;
  for (std::size_t i = 0; i < lr_runs; ++i)
    lr_sweep.push_back({runs[i].mup ? plan::Parametrization::mup : plan::Parametrization::sp, runs[i].shape.dim,
                        runs[i].lr, runs[i].loss});
  std::optional<plan::RateRule> chosen;
  if (c.lr_sweep && !c.lr) chosen = plan::rate_rule(lr_sweep, base_width, 4 * base_width, c.mup);
  const plan::RateRule rate =
      chosen.value_or(plan::RateRule{.parametrization = c.mup ? plan::Parametrization::mup : plan::Parametrization::sp,
                                     .lr = c.lr.value_or(4e-3),
                                     .base_width = base_width,
                                     .why = c.lr ? "--lr" : "the default without the sweep"});
  std::printf("%s\n", describe(rate).c_str());
  // 2. The fit sweep, and the off-rule runs of the two smallest models.
  auto add = [&](const Shape& s, double ratio, const char* role) {
    Run r;
    r.role = role;
    r.shape = s;
    r.params = params_of(s, c);
    r.tokens = std::round(ratio * r.params);
    r.lr = rate.at(s.dim);
    r.mup = rate.parametrization == plan::Parametrization::mup;
    r.mup_base = base_width;
    char name[64];
    std::snprintf(name, sizeof name, "%s-L%lld-C%lld-x%g", role, static_cast<long long>(s.layers),
                  static_cast<long long>(s.dim), ratio);
    r.name = name;
    runs.push_back(r);
  };
  for (const Shape& s : fit_shapes) add(s, c.tokens_per_param, "fit");
  for (int k = 0; k < 2; ++k)
    for (double f : {0.25, 4.0}) add(fit_shapes[static_cast<std::size_t>(k)], f * c.tokens_per_param, "ratio");
  add(held, c.tokens_per_param, "held-out");
  const int total = static_cast<int>(runs.size());
  for (std::size_t i = lr_runs; i + 1 < runs.size(); ++i) sweep.train(runs[i], ++index, total);

  // 3. The fits, before the held-out run: the prediction is made without it.
  std::vector<plan::ScalingRun> rule, all;
  for (std::size_t i = lr_runs; i + 1 < runs.size(); ++i) {
    const Run& r = runs[i];
    const plan::ScalingRun s{r.name, r.params, static_cast<double>(steps_of(r, c) * c.batch * c.seq), r.flops, r.loss};
    (r.role == "fit" ? rule : all).push_back(s);
  }
  Run& h = runs.back();
  h.params = params_of(h.shape, c);
  h.flops = flops_of(h, c);
  const plan::ScalingRun held_run{h.name, h.params, static_cast<double>(steps_of(h, c) * c.batch * c.seq), h.flops,
                                  1.0};
  plan::ScalingReport before = plan::make_report(rule, {held_run}, {}, all);
  const plan::Prediction p = before.predictions.front().power_law;
  std::printf("prediction for %s (%s params, %.2e FLOPs, %.1fx the largest fit run): val loss %.4f [%.4f, %.4f]\n",
              h.name.c_str(), size_name(h.params).c_str(), h.flops, h.flops / rule.back().flops, p.value, p.lo, p.hi);
  // 4. The held-out run.
  sweep.train(h, ++index, total);
  plan::ScalingRun achieved = held_run;
  achieved.loss = h.loss;
  plan::ScalingReport report = plan::make_report(rule, {achieved}, {}, all);
  report.lr_sweep = lr_sweep;
  report.rate_rule = chosen;

  const plan::PowerLawFit& f = report.power_law.fit;
  const plan::PowerLawBootstrap& fb = report.power_law.bootstrap;
  std::printf("L(C) = a·C^b + c: a = %.4g [%.4g, %.4g], b = %.4f [%.4f, %.4f], c = %.4f [%.4f, %.4f]\n", f.a, fb.a.lo,
              fb.a.hi, f.b, fb.b.lo, fb.b.hi, f.c, fb.c.lo, fb.c.hi);
  if (report.chinchilla) {
    const plan::ChinchillaFit& g = report.chinchilla->fit;
    const plan::ChinchillaBootstrap& gb = report.chinchilla->bootstrap;
    std::printf(
        "L(N, D) = E + A/N^α + B/D^β: E = %.4f [%.4f, %.4f], A = %.4g, B = %.4g, α = %.3f [%.3f, %.3f], β = %.3f "
        "[%.3f, %.3f]\n",
        g.E, gb.E.lo, gb.E.hi, g.A, g.B, g.alpha, gb.alpha.lo, gb.alpha.hi, g.beta, gb.beta.lo, gb.beta.hi);
  } else {
    std::printf("%s\n", report.chinchilla_note.c_str());
  }
  const plan::HeldOutPrediction& hp = report.predictions.front();
  std::printf("held-out %s: achieved %.4f, predicted %.4f [%.4f, %.4f] (%+.2f%%)%s\n", hp.name.c_str(), hp.achieved,
              hp.power_law.value, hp.power_law.lo, hp.power_law.hi, 100 * hp.relative_error(), hp.chinchilla ? "" : "");
  if (hp.chinchilla)
    std::printf("  Chinchilla's prediction: %.4f [%.4f, %.4f] (%+.2f%%)\n", hp.chinchilla->value, hp.chinchilla->lo,
                hp.chinchilla->hi, 100 * hp.chinchilla_relative_error());
  const std::string json = (fs::path(c.out) / "scaling.json").string();
  std::ofstream(json) << plan::to_json(report).dump(2) << "\n";
  plan::write_csv((fs::path(c.out) / "runs.csv").string(), report);
  std::printf("report: %s, %s/runs.csv\n", json.c_str(), c.out.c_str());
  if (c.synthetic) {
    // The fit must recover the law the losses came from.
    if (!report.chinchilla) return 1;
    const plan::ChinchillaFit& g = report.chinchilla->fit;
    const auto& k = Sweep::kSynthetic;
    const bool ok = std::abs(g.alpha - k.alpha) < 0.05 && std::abs(g.beta - k.beta) < 0.05 &&
                    std::abs(g.E - k.E) < 0.05 && std::abs(hp.relative_error()) < 0.02;
    std::printf("synthetic law E = %.2f, α = %.2f, β = %.2f: %s\n", k.E, k.alpha, k.beta,
                ok ? "recovered" : "NOT recovered");
    return ok ? 0 : 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  SweepConfig c;
  double lr = 0.0;
  bool no_lr_sweep = false, no_mup = false;
  CLI::App app{"llmpar-scaling: fit scaling laws to small runs, predict a 10x larger one, train it, compare"};
  app.add_option("--data", c.data, "Training shards (llm.c .bin, byte tokens); validation: 'train' -> 'val'");
  app.add_option("--out", c.out, "Directory of the runs, the report (scaling.json) and runs.csv")
      ->capture_default_str();
  app.add_option("--budget", c.budget, "Compute of every run, relative to the default sweep (about an hour on 2 cores)")
      ->capture_default_str();
  app.add_option("--tokens-per-param", c.tokens_per_param, "Tokens per parameter of the rule's runs")
      ->capture_default_str();
  app.add_option("--seq", c.seq, "Sequence length")->capture_default_str();
  app.add_option("--batch", c.batch, "Sequences per step (over all ranks)")->capture_default_str();
  app.add_option("--ranks", c.ranks, "Data-parallel thread ranks of every run")->capture_default_str();
  app.add_option("--lr", lr, "Learning rate of the fit and held-out runs (default: the rule the sweep measures)");
  app.add_flag("--no-lr-sweep", no_lr_sweep, "Skip the learning-rate sweep (then --lr, default 4e-3)");
  app.add_flag("--no-mup", no_mup, "Train the sweep in the standard parametrisation");
  app.add_flag("--synthetic", c.synthetic, "No training: losses from a known law, which the fit must recover");
  app.add_option("--train-gpt", c.train_gpt, "The train_gpt program (default: beside this one)");
  CLI11_PARSE(app, argc, argv);
  try {
    LLMPAR_CHECK(std::isfinite(c.budget) && c.budget > 0.0, "--budget ", c.budget,
                 "; give a positive multiple of the default sweep's compute (1: about an hour on 2 cores)");
    LLMPAR_CHECK(c.tokens_per_param > 0.0, "--tokens-per-param ", c.tokens_per_param, "; give a positive ratio");
    LLMPAR_CHECK(c.ranks >= 1 && c.batch % c.ranks == 0, "--batch ", c.batch, " is not divisible by --ranks ", c.ranks,
                 "; each rank takes batch / ranks sequences");
    if (app.count("--lr") > 0) {
      LLMPAR_CHECK(lr > 0.0, "--lr ", lr, "; give a positive learning rate");
      c.lr = lr;
    }
    c.lr_sweep = !no_lr_sweep && !c.synthetic;
    c.mup = !no_mup;
    if (!c.synthetic) {
      LLMPAR_CHECK(!c.data.empty(),
                   "give --data: token shards of English text (./llmpar.sh scaling prepares "
                   "data/docs_train.bin from the Debian packages it installs)");
      if (c.train_gpt.empty()) c.train_gpt = tools::beside_this_program(argv[0], "train_gpt");
      LLMPAR_CHECK(fs::exists(c.train_gpt), "train_gpt not found at ", c.train_gpt, "; build it or give --train-gpt");
    }
    return run_sweep(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmpar-scaling: error: %s\n", e.what());
    return 1;
  }
}
