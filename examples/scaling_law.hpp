// scaling_law.hpp — llmpar-scaling's fits (the tool's code, not the library's): loss
// against training compute, and Chinchilla's loss against parameters and tokens, with
// bootstrap intervals, and a report (JSON, CSV) that tools/plot_scaling.py draws.
//
// Two laws, fitted to a handful of small runs (ScalingRun: N parameters, D tokens,
// C training FLOPs = 6ND plus attention, final loss L):
//
//   power law in compute   L(C) = a·C^b + c                     (b < 0, a > 0, 0 <= c)
//   Chinchilla, approach 3 L(N, D) = E + A/N^α + B/D^β           (Hoffmann et al. 2022)
//
// Both minimise Σ_i Huber_δ(log L̂_i − log L_i) (δ = 1e-3, as the paper): residuals of
// log losses, so a 1% miss weighs the same at loss 4 and at loss 2, and the Huber loss
// keeps one bad run from dragging the fit (beyond δ it grows linearly; with losses a
// few tenths of a percent off the law most residuals are past δ, and the fit is close
// to least absolute deviations). The minimiser is L-BFGS (detail::minimize_lbfgs,
// analytic gradients) with a weak-Wolfe line search by bisection (Lewis & Overton
// 2013), which stays well defined where Huber is linear and the curvature is zero.
// Every fit runs from a grid of starts, each to a loose tolerance, then the 8 best
// ends to a tight one (LbfgsOptions::screen_tolerance, polished), and keeps the best.
//
// Parametrisations, chosen so constraints hold by construction and the problem is well
// conditioned (both are exact changes of variables: the objective is the same).
//   Power law: θ = (α0, b, γ), L̂ = exp(α0 + b·x) + c with x = log C − mean log C (C in
//   units of its geometric mean, so α0 and b are not a nearly collinear pair), and
//   c = min_loss·sigmoid(γ), so 0 < c < the lowest loss. a = exp(α0 − b·mean log C) in
//   the caller's units. b is free; a fit that ends at b >= 0 (the losses do not fall
//   with compute) is refused. Starts: b in {−0.02, ..., −1}, c at fractions {0.01, ...,
//   0.97} of the lowest loss, α0 the least-squares intercept given those two.
//   Chinchilla: log L̂ = LSE(a − α·log N, b − β·log D, e) with A = e^a, B = e^b, E = e^e,
//   optimised with log N and log D centred on their means (a' = a − α·mean log N, b'
//   likewise). Starts: the paper's grid, α, β ∈ {0, 0.5, ..., 2}, e ∈ {−1, −0.5, ..., 1},
//   a, b ∈ {0, 5, ..., 25} (4500 starts). α <= 0 or β <= 0 at the end is refused.
//
// What is refused, with a message naming the problem and the fix: fewer runs than
// parameters + 1 (power law 4, Chinchilla 6); a non-finite or non-positive value
// (naming the run and the field); fewer than 3 distinct compute budgets (power law);
// and, for Chinchilla, runs that cannot tell A/N^α from B/D^β: when every run has about
// the same tokens per parameter (log(D/N) spread below log 1.5) N and D move together
// and only their product is seen; likewise one model size or one token count.
//
// Bootstrap (Besiroglu et al. 2024 found the paper's own intervals far too narrow):
// resample the runs with replacement B times (default 400), refit each resample, and
// take percentile intervals (default 95%) of every parameter and of any prediction. The
// draws come from the counter-based rng::Stream (core/rng.hpp) keyed by the seed, so a
// seed gives the same intervals on every platform. A resample is degenerate, skipped
// and counted, when its distinct runs cannot determine the parameters (fewer than 3 or
// 5, fewer than 3 budgets, collinear) or its fit ends outside the constraints. The fit
// itself asks for one run more, but a resample that interpolates as many runs as there
// are parameters is a spread the interval should show: asking 4 of a resample of 4 runs
// would keep only the data itself, and an interval of no width. Resample fits start
// from the full-data optimum and, to find a different basin when the resample moved it,
// from: the whole (small) power-law grid; for Chinchilla the `bootstrap_starts` (4)
// points of the paper's grid with the lowest full-data objective, so a resample costs a
// few L-BFGS runs, not 4500. A resample is a vector of multiplicities, used as weights.
//
// Compute-optimal allocation (Chinchilla, C = 6ND): N_opt(C) = G·(C/6)^(β/(α+β)),
// D_opt = (C/6)/N_opt, G = (αA/(βB))^(1/(α+β)). The runs' C includes attention; the
// allocation uses the paper's 6ND.
//
// The report (make_report): the fit runs (both laws), the runs only Chinchilla takes
// (other tokens per parameter: off the loss-against-compute frontier that the power law
// follows), the held-out runs, both fits with their bootstraps (Chinchilla absent, with
// chinchilla_note saying why, when the runs cannot identify it), a band of predicted
// loss and interval over a log grid of C spanning every run, the prediction for each
// held-out run (both laws), and optional learning-rate sweep
// records (SP and μP widths) for the plot's second panel. to_json/from_json round-trip
// it exactly (format "llmpar-scaling-report", version 1; from_json names any missing,
// mistyped or unknown field); write_csv writes one row per run.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"

namespace llmpar::scaling {

inline constexpr const char* kReportFormat = "llmpar-scaling-report";
inline constexpr int kReportVersion = 1;

// One finished training run.
struct ScalingRun {
  std::string name;
  double params = 0.0;  // N
  double tokens = 0.0;  // D
  double flops = 0.0;   // C: training FLOPs, 6ND plus attention
  double loss = 0.0;    // final (validation) loss, nats per token
};

// ---------------------------------------------------------------------------------------
// The pieces of the objectives.

// Huber_δ(r): r²/2 for |r| <= δ, δ(|r| − δ/2) beyond (continuous, with its derivative).
inline double huber(double r, double delta) {
  const double m = std::abs(r);
  return m <= delta ? 0.5 * r * r : delta * (m - 0.5 * delta);
}
inline double huber_derivative(double r, double delta) { return r > delta ? delta : (r < -delta ? -delta : r); }

// log(e^x + e^y + e^z) without overflow.
inline double log_sum_exp(double x, double y, double z) {
  const double m = std::max({x, y, z});
  if (!std::isfinite(m)) return m;
  return m + std::log(std::exp(x - m) + std::exp(y - m) + std::exp(z - m));
}

// ---------------------------------------------------------------------------------------
// Options.

struct LbfgsOptions {
  int memory = 8;                     // curvature pairs kept
  int max_iterations = 1000;          // per start
  double gradient_tolerance = 1e-11;  // converged at max_i |∂f/∂θ_i| <= this
  double value_tolerance = 1e-15;     // or when an iteration lowers f by less than this fraction
  // Over many starts: each start runs until an iteration lowers f by less than this
  // fraction, then the `polished` best ends run on to the tolerances above (on the
  // tests' data: the same optimum as running every start to the end, in a third of the
  // time).
  double screen_tolerance = 1e-6;
  int polished = 8;

  void validate() const {
    LLMPAR_CHECK(memory >= 1, "L-BFGS memory ", memory, "; keep at least 1 curvature pair (8 is usual)");
    LLMPAR_CHECK(polished >= 1, "L-BFGS polished ", polished, "; polish at least the best start's end");
    LLMPAR_CHECK(screen_tolerance >= value_tolerance, "L-BFGS screen_tolerance ", screen_tolerance,
                 " is below value_tolerance ", value_tolerance, "; screening stops no later than the final run");
    LLMPAR_CHECK(max_iterations >= 1, "L-BFGS max_iterations ", max_iterations, "; allow at least 1 iteration");
    LLMPAR_CHECK(gradient_tolerance >= 0.0 && value_tolerance >= 0.0, "L-BFGS tolerances (gradient ",
                 gradient_tolerance, ", value ", value_tolerance, ") must be >= 0");
  }
};

struct PowerLawOptions {
  double huber_delta = 1e-3;
  std::vector<double> exponent_starts = {-0.02, -0.05, -0.1, -0.2, -0.5, -1.0};  // b
  std::vector<double> irreducible_starts = {0.01, 0.25, 0.5, 0.75, 0.9, 0.97};   // c / lowest loss
  LbfgsOptions lbfgs;

  void validate() const {
    LLMPAR_CHECK(std::isfinite(huber_delta) && huber_delta > 0.0, "power-law huber_delta ", huber_delta,
                 "; use a positive residual scale (1e-3 as Hoffmann et al. 2022)");
    LLMPAR_CHECK(!exponent_starts.empty() && !irreducible_starts.empty(),
                 "power-law starts: give at least one exponent and one irreducible-loss fraction");
    for (double b : exponent_starts) LLMPAR_CHECK(std::isfinite(b), "power-law exponent start ", b, " is not finite");
    for (double f : irreducible_starts)
      LLMPAR_CHECK(f > 0.0 && f < 1.0, "power-law irreducible start ", f,
                   " is a fraction of the lowest loss: use a value in (0, 1)");
    lbfgs.validate();
  }
};

// Starting points of the Chinchilla fit: every combination of the five lists.
struct ChinchillaStarts {
  std::vector<double> alpha, beta, e, a, b;

  // Hoffmann et al. 2022, appendix D.2.
  static ChinchillaStarts paper() {
    return {{0.0, 0.5, 1.0, 1.5, 2.0},
            {0.0, 0.5, 1.0, 1.5, 2.0},
            {-1.0, -0.5, 0.0, 0.5, 1.0},
            {0.0, 5.0, 10.0, 15.0, 20.0, 25.0},
            {0.0, 5.0, 10.0, 15.0, 20.0, 25.0}};
  }
  std::size_t size() const { return alpha.size() * beta.size() * e.size() * a.size() * b.size(); }
};

struct ChinchillaOptions {
  double huber_delta = 1e-3;
  ChinchillaStarts starts = ChinchillaStarts::paper();
  int bootstrap_starts = 4;  // grid starts per resample besides the full-data optimum
  LbfgsOptions lbfgs;

  void validate() const {
    LLMPAR_CHECK(std::isfinite(huber_delta) && huber_delta > 0.0, "Chinchilla huber_delta ", huber_delta,
                 "; use a positive residual scale (1e-3 as Hoffmann et al. 2022)");
    LLMPAR_CHECK(starts.size() > 0, "Chinchilla starts: every list (alpha, beta, e, a, b) needs a value; ",
                 "ChinchillaStarts::paper() is the paper's grid");
    LLMPAR_CHECK(bootstrap_starts >= 0, "Chinchilla bootstrap_starts ", bootstrap_starts, "; use 0 or more");
    lbfgs.validate();
  }
};

struct BootstrapOptions {
  int resamples = 400;
  double confidence = 0.95;  // of the percentile intervals
  std::uint64_t seed = 0;

  void validate() const {
    LLMPAR_CHECK(resamples >= 20, "bootstrap resamples ", resamples,
                 "; percentile intervals need at least 20 resamples (hundreds for 95%)");
    LLMPAR_CHECK(confidence > 0.0 && confidence < 1.0, "bootstrap confidence ", confidence,
                 "; use a fraction in (0, 1), e.g. 0.95");
  }
};

// ---------------------------------------------------------------------------------------
// Results.

// A percentile interval.
struct Interval {
  double lo = 0.0, hi = 0.0;
};

// A prediction: the full-data fit's value and the bootstrap's interval.
struct Prediction {
  double value = 0.0, lo = 0.0, hi = 0.0;
};

struct PowerLawFit {
  double a = 0.0, b = 0.0, c = 0.0;  // L(C) = a·C^b + c, C in the runs' units
  double objective = 0.0;            // Σ Huber of the log residuals at the optimum
  double huber_delta = 1e-3;

  double predict(double flops) const { return a * std::pow(flops, b) + c; }
};

struct ChinchillaFit {
  double E = 0.0, A = 0.0, B = 0.0, alpha = 0.0, beta = 0.0;  // L(N, D) = E + A/N^α + B/D^β
  double objective = 0.0;
  double huber_delta = 1e-3;

  double predict(double params, double tokens) const {
    return E + A / std::pow(params, alpha) + B / std::pow(tokens, beta);
  }
  // G = (αA/(βB))^(1/(α+β)).
  double allocation_coefficient() const { return std::pow(alpha * A / (beta * B), 1.0 / (alpha + beta)); }
  // The parameters and tokens that minimise L at compute C = 6ND.
  double params_optimal(double flops) const {
    return allocation_coefficient() * std::pow(flops / 6.0, beta / (alpha + beta));
  }
  double tokens_optimal(double flops) const { return flops / 6.0 / params_optimal(flops); }
};

namespace detail {

// The q-quantile of `values` (linear interpolation between order statistics).
inline double quantile(std::vector<double> values, double q) {
  LLMPAR_CHECK(!values.empty(),
               "a bootstrap interval of no samples: the bootstrap is empty (make it with "
               "bootstrap_power_law or bootstrap_chinchilla)");
  std::sort(values.begin(), values.end());
  const double pos = q * static_cast<double>(values.size() - 1);
  const auto i = static_cast<std::size_t>(std::floor(pos));
  if (i + 1 >= values.size()) return values.back();
  return values[i] + (pos - static_cast<double>(i)) * (values[i + 1] - values[i]);
}

inline Interval percentile_interval(std::vector<double> values, double confidence) {
  const double tail = 0.5 * (1.0 - confidence);
  return {quantile(values, tail), quantile(std::move(values), 1.0 - tail)};
}

template <class Fit, class Value>
Interval interval_of(const std::vector<Fit>& samples, double confidence, Value value) {
  std::vector<double> v;
  v.reserve(samples.size());
  for (const Fit& f : samples) v.push_back(value(f));
  return percentile_interval(std::move(v), confidence);
}

}  // namespace detail

struct PowerLawBootstrap {
  BootstrapOptions options;
  int degenerate = 0;                // resamples skipped (see the design note)
  std::vector<PowerLawFit> samples;  // one fit per usable resample
  Interval a, b, c;

  Interval predict(double flops) const {
    return detail::interval_of(samples, options.confidence, [&](const PowerLawFit& f) { return f.predict(flops); });
  }
};

struct ChinchillaBootstrap {
  BootstrapOptions options;
  int degenerate = 0;
  std::vector<ChinchillaFit> samples;
  Interval E, A, B, alpha, beta;

  Interval predict(double params, double tokens) const {
    return detail::interval_of(samples, options.confidence,
                               [&](const ChinchillaFit& f) { return f.predict(params, tokens); });
  }
  Interval params_optimal(double flops) const {
    return detail::interval_of(samples, options.confidence,
                               [&](const ChinchillaFit& f) { return f.params_optimal(flops); });
  }
};

// ---------------------------------------------------------------------------------------
// L-BFGS.

namespace detail {

template <std::size_t kDim>
using Vec = std::array<double, kDim>;

template <std::size_t kDim>
double dot(const Vec<kDim>& u, const Vec<kDim>& v) {
  double s = 0.0;
  for (std::size_t i = 0; i < kDim; ++i) s += u[i] * v[i];
  return s;
}
template <std::size_t kDim>
double max_abs(const Vec<kDim>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

template <std::size_t kDim>
struct LbfgsResult {
  Vec<kDim> x{};
  double value = 0.0;
  int iterations = 0;
  int evaluations = 0;
  bool converged = false;  // a tolerance was met (not the iteration limit or a failed line search)
};

// Minimises f(x, grad) -> value (writing ∂f/∂x into grad) from x.
template <std::size_t kDim, class Objective>
LbfgsResult<kDim> minimize_lbfgs(const Objective& f, Vec<kDim> x, const LbfgsOptions& options) {
  constexpr double kArmijo = 1e-4, kCurvature = 0.9;
  constexpr int kLineSearchSteps = 80;
  LbfgsResult<kDim> result;
  Vec<kDim> g{};
  double fx = f(x, g);
  result.evaluations = 1;
  const auto done = [&](bool converged) {
    result.x = x;
    result.value = fx;
    result.converged = converged;
    return result;
  };
  if (!std::isfinite(fx)) return done(false);

  const auto m = static_cast<std::size_t>(options.memory);
  std::vector<Vec<kDim>> s_hist(m), y_hist(m);
  std::vector<double> rho(m), alpha(m);
  std::size_t stored = 0, newest = 0;
  for (; result.iterations < options.max_iterations; ++result.iterations) {
    if (max_abs(g) <= options.gradient_tolerance) return done(true);
    // Two-loop recursion: d = −H·g.
    Vec<kDim> q = g;
    for (std::size_t k = 0; k < stored; ++k) {
      const std::size_t i = (newest + m - k) % m;
      alpha[i] = rho[i] * dot(s_hist[i], q);
      for (std::size_t j = 0; j < kDim; ++j) q[j] -= alpha[i] * y_hist[i][j];
    }
    const double scale = stored > 0 ? dot(s_hist[newest], y_hist[newest]) / dot(y_hist[newest], y_hist[newest])
                                    : std::min(1.0, 1.0 / max_abs(g));
    for (double& v : q) v *= scale;
    for (std::size_t k = stored; k-- > 0;) {
      const std::size_t i = (newest + m - k) % m;
      const double beta = rho[i] * dot(y_hist[i], q);
      for (std::size_t j = 0; j < kDim; ++j) q[j] += (alpha[i] - beta) * s_hist[i][j];
    }
    Vec<kDim> d;
    for (std::size_t j = 0; j < kDim; ++j) d[j] = -q[j];
    double slope = dot(d, g);
    if (!(slope < 0.0)) {  // rounding spoilt the direction: steepest descent
      stored = 0;
      const double t0 = std::min(1.0, 1.0 / max_abs(g));
      for (std::size_t j = 0; j < kDim; ++j) d[j] = -t0 * g[j];
      slope = dot(d, g);
    }

    // Weak Wolfe by bisection: bracket [lo, hi], doubling t until f stops falling fast.
    double t = 1.0, lo = 0.0, hi = std::numeric_limits<double>::infinity();
    bool have_lo = false;
    Vec<kDim> x_lo{}, g_lo{}, xt{}, gt{};
    double f_lo = fx;
    for (int k = 0; k < kLineSearchSteps; ++k) {
      for (std::size_t j = 0; j < kDim; ++j) xt[j] = x[j] + t * d[j];
      const double ft = f(xt, gt);
      ++result.evaluations;
      if (!(ft <= fx + kArmijo * t * slope)) {
        hi = t;
      } else {
        lo = t;
        have_lo = true;
        x_lo = xt;
        g_lo = gt;
        f_lo = ft;
        if (dot(gt, d) >= kCurvature * slope) break;
      }
      t = std::isfinite(hi) ? 0.5 * (lo + hi) : 2.0 * t;
      if (std::isfinite(hi) && hi - lo <= 1e-16 * hi) break;
    }
    if (!have_lo) {
      if (stored == 0) return done(false);  // no decrease even along −g: as good as rounding allows
      stored = 0;                           // try again from steepest descent
      continue;
    }
    Vec<kDim> s, y;
    for (std::size_t j = 0; j < kDim; ++j) {
      s[j] = x_lo[j] - x[j];
      y[j] = g_lo[j] - g[j];
    }
    const double sy = dot(s, y);
    if (sy > 1e-12 * std::sqrt(dot(s, s) * dot(y, y))) {
      newest = stored == 0 ? 0 : (newest + 1) % m;
      s_hist[newest] = s;
      y_hist[newest] = y;
      rho[newest] = 1.0 / sy;
      stored = std::min(stored + 1, m);
    }
    const double decrease = fx - f_lo;
    x = x_lo;
    g = g_lo;
    fx = f_lo;
    if (decrease <= options.value_tolerance * std::abs(fx + decrease)) return done(true);
  }
  return done(false);
}

// The lowest end over `starts` (nullopt when none is finite): every start screened,
// the best `polished` run on.
template <std::size_t kDim, class Objective>
std::optional<LbfgsResult<kDim>> multi_start(const Objective& f, const std::vector<Vec<kDim>>& starts,
                                             const LbfgsOptions& options) {
  LbfgsOptions screen = options;
  screen.value_tolerance = options.screen_tolerance;
  std::vector<LbfgsResult<kDim>> ends;
  for (const Vec<kDim>& start : starts) {
    LbfgsResult<kDim> r = minimize_lbfgs<kDim>(f, start, screen);
    if (std::isfinite(r.value)) ends.push_back(r);
  }
  const auto keep = std::min(ends.size(), static_cast<std::size_t>(options.polished));
  std::partial_sort(ends.begin(), ends.begin() + static_cast<std::ptrdiff_t>(keep), ends.end(),
                    [](const auto& x, const auto& y) { return x.value < y.value; });
  std::optional<LbfgsResult<kDim>> best;
  for (std::size_t k = 0; k < keep; ++k) {
    const LbfgsResult<kDim> r = minimize_lbfgs<kDim>(f, ends[k].x, options);
    if (std::isfinite(r.value) && (!best || r.value < best->value)) best = r;
  }
  return best;
}

// ---------------------------------------------------------------------------------------
// Run checks, shared by the fits and the bootstrap's degenerate test.

inline void check_positive(std::span<const ScalingRun> runs, std::string_view fit,
                           std::initializer_list<std::pair<const char*, double ScalingRun::*>> fields) {
  for (std::size_t i = 0; i < runs.size(); ++i) {
    for (const auto& [field, member] : fields) {
      const double v = runs[i].*member;
      LLMPAR_CHECK(std::isfinite(v) && v > 0.0, fit, ": run '", runs[i].name, "' (", i + 1, " of ", runs.size(),
                   ") has ", field, " = ", v, "; every run needs a finite, positive ", field,
                   " (drop the run or fix its record)");
    }
  }
}

// The fewest runs a fit takes: one more than its parameters, so that some residual
// checks the curve. A bootstrap resample may have one fewer distinct runs (it then
// interpolates them, which is the spread the bootstrap should see); with fewer it is
// degenerate.
inline constexpr std::size_t kPowerLawMinRuns = 4, kChinchillaMinRuns = 6;

// Why these runs cannot fit a power law in compute ("" when they can); values are
// checked already. `min_runs`: kPowerLawMinRuns, or one fewer for a resample.
inline std::string power_law_refusal(std::span<const ScalingRun> runs, std::size_t min_runs = kPowerLawMinRuns) {
  if (runs.size() < min_runs)
    return ::llmpar::detail::concat("power-law fit: ", runs.size(),
                                    " runs, but L(C) = a*C^b + c has 3 parameters and needs at least 4 runs; "
                                    "add runs at other compute budgets");
  std::size_t budgets = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    bool seen = false;
    for (std::size_t k = 0; k < i && !seen; ++k) seen = runs[k].flops == runs[i].flops;
    budgets += !seen;
  }
  if (budgets < 3)
    return ::llmpar::detail::concat("power-law fit: the runs have ", budgets,
                                    " distinct compute budget(s), and a curve with 3 parameters needs at least 3; "
                                    "add runs at other compute budgets");
  return {};
}

// Why these runs cannot identify E + A/N^α + B/D^β ("" when they can).
inline std::string chinchilla_refusal(std::span<const ScalingRun> runs, std::size_t min_runs = kChinchillaMinRuns) {
  if (runs.size() < min_runs)
    return ::llmpar::detail::concat("Chinchilla fit: ", runs.size(),
                                    " runs, but E + A/N^alpha + B/D^beta has 5 parameters and needs at least 6 runs; "
                                    "add runs of other sizes and token counts");
  double lo_ratio = std::numeric_limits<double>::infinity(), hi_ratio = -lo_ratio;
  double lo_n = lo_ratio, hi_n = hi_ratio, lo_d = lo_ratio, hi_d = hi_ratio;
  for (const ScalingRun& r : runs) {
    const double ratio = std::log(r.tokens / r.params);
    lo_ratio = std::min(lo_ratio, ratio);
    hi_ratio = std::max(hi_ratio, ratio);
    lo_n = std::min(lo_n, std::log(r.params));
    hi_n = std::max(hi_n, std::log(r.params));
    lo_d = std::min(lo_d, std::log(r.tokens));
    hi_d = std::max(hi_d, std::log(r.tokens));
  }
  const double spread = std::log(1.5);
  if (hi_ratio - lo_ratio < spread)
    return ::llmpar::detail::concat(
        "Chinchilla fit: every run has about the same tokens per parameter (D/N from ", std::exp(lo_ratio), " to ",
        std::exp(hi_ratio),
        ", less than 1.5x apart), so N and D grow together and A/N^alpha cannot be told from "
        "B/D^beta; add runs at two or more tokens-per-parameter ratios (e.g. 10 and 40 tokens per "
        "parameter at each of two sizes), or use the power law in compute alone");
  if (hi_n - lo_n < spread)
    return ::llmpar::detail::concat("Chinchilla fit: every run has about the same parameter count (N from ",
                                    std::exp(lo_n), " to ", std::exp(hi_n),
                                    ", less than 1.5x apart), so A/N^alpha cannot be told from E; "
                                    "add runs of two or more model sizes");
  if (hi_d - lo_d < spread)
    return ::llmpar::detail::concat("Chinchilla fit: every run has about the same token count (D from ", std::exp(lo_d),
                                    " to ", std::exp(hi_d),
                                    ", less than 1.5x apart), so B/D^beta cannot be told from E; "
                                    "add runs trained on two or more token counts");
  return {};
}

// The distinct runs of a resample (by index), for its degenerate test.
inline std::vector<ScalingRun> distinct_runs(std::span<const ScalingRun> runs, const std::vector<double>& weight) {
  std::vector<ScalingRun> out;
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (weight[i] > 0.0) out.push_back(runs[i]);
  return out;
}

// ---------------------------------------------------------------------------------------
// The power law: θ = (α0, b, γ), L̂ = exp(α0 + b·x) + lowest·sigmoid(γ).

struct PowerLawData {
  std::vector<double> x, log_loss, loss, weight;
  double mean_log_flops = 0.0;
  double lowest = 0.0;  // the lowest loss among the weighted runs: c's upper bound
  double delta = 1e-3;
};

inline PowerLawData power_law_data(std::span<const ScalingRun> runs, std::vector<double> weight, double delta) {
  PowerLawData d;
  d.delta = delta;
  for (const ScalingRun& r : runs) d.mean_log_flops += std::log(r.flops);
  d.mean_log_flops /= static_cast<double>(runs.size());
  d.lowest = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    d.x.push_back(std::log(runs[i].flops) - d.mean_log_flops);
    d.loss.push_back(runs[i].loss);
    d.log_loss.push_back(std::log(runs[i].loss));
    if (weight[i] > 0.0) d.lowest = std::min(d.lowest, runs[i].loss);
  }
  d.weight = std::move(weight);
  return d;
}

inline double sigmoid(double z) {
  if (z >= 0.0) return 1.0 / (1.0 + std::exp(-z));
  const double e = std::exp(z);
  return e / (1.0 + e);
}
inline double logit(double p) { return std::log(p / (1.0 - p)); }

inline double power_law_objective(const PowerLawData& d, const Vec<3>& th, Vec<3>& grad) {
  const double sig = sigmoid(th[2]);
  const double c = d.lowest * sig, dc = d.lowest * sig * (1.0 - sig);
  double f = 0.0;
  grad = {0.0, 0.0, 0.0};
  for (std::size_t i = 0; i < d.x.size(); ++i) {
    const double w = d.weight[i];
    if (w == 0.0) continue;
    const double p = std::exp(th[0] + th[1] * d.x[i]);
    const double fit = p + c;
    const double r = std::log(fit) - d.log_loss[i];
    f += w * huber(r, d.delta);
    const double h = w * huber_derivative(r, d.delta) / fit;
    grad[0] += h * p;
    grad[1] += h * p * d.x[i];
    grad[2] += h * dc;
  }
  return f;
}

inline PowerLawFit power_law_fit_of(const PowerLawData& d, const Vec<3>& th, double objective) {
  PowerLawFit fit;
  fit.b = th[1];
  fit.a = std::exp(th[0] - th[1] * d.mean_log_flops);
  fit.c = d.lowest * sigmoid(th[2]);
  fit.objective = objective;
  fit.huber_delta = d.delta;
  return fit;
}

// θ where b and c = fraction·lowest are given and α0 is the least-squares intercept.
inline Vec<3> power_law_start(const PowerLawData& d, double b, double fraction) {
  const double c = fraction * d.lowest;
  double sum = 0.0, count = 0.0;
  for (std::size_t i = 0; i < d.x.size(); ++i) {
    if (d.weight[i] == 0.0) continue;
    sum += d.weight[i] * (std::log(d.loss[i] - c) - b * d.x[i]);
    count += d.weight[i];
  }
  return {sum / count, b, logit(fraction)};
}

// The best end over the grid starts (and `extra` starts); nullopt when no start reached
// a finite objective or the best fit is not a falling curve.
inline std::optional<PowerLawFit> fit_power_law(const PowerLawData& d, const PowerLawOptions& options,
                                                const std::vector<Vec<3>>& extra) {
  std::vector<Vec<3>> starts = extra;
  for (double b : options.exponent_starts)
    for (double fraction : options.irreducible_starts) starts.push_back(power_law_start(d, b, fraction));
  const auto objective = [&](const Vec<3>& th, Vec<3>& grad) { return power_law_objective(d, th, grad); };
  const std::optional<LbfgsResult<3>> best = multi_start<3>(objective, starts, options.lbfgs);
  if (!best) return std::nullopt;
  const PowerLawFit fit = power_law_fit_of(d, best->x, best->value);
  if (!(fit.b < 0.0) || !std::isfinite(fit.a) || !(fit.a > 0.0)) return std::nullopt;
  return fit;
}

// ---------------------------------------------------------------------------------------
// Chinchilla: θ = (a', b', e, α, β) with log N and log D centred.

struct ChinchillaData {
  std::vector<double> u, v, log_loss, weight;  // u = log N − mean, v = log D − mean
  double mean_log_params = 0.0, mean_log_tokens = 0.0;
  double delta = 1e-3;
};

inline ChinchillaData chinchilla_data(std::span<const ScalingRun> runs, std::vector<double> weight, double delta) {
  ChinchillaData d;
  d.delta = delta;
  for (const ScalingRun& r : runs) {
    d.mean_log_params += std::log(r.params);
    d.mean_log_tokens += std::log(r.tokens);
  }
  d.mean_log_params /= static_cast<double>(runs.size());
  d.mean_log_tokens /= static_cast<double>(runs.size());
  for (const ScalingRun& r : runs) {
    d.u.push_back(std::log(r.params) - d.mean_log_params);
    d.v.push_back(std::log(r.tokens) - d.mean_log_tokens);
    d.log_loss.push_back(std::log(r.loss));
  }
  d.weight = std::move(weight);
  return d;
}

inline double chinchilla_objective(const ChinchillaData& d, const Vec<5>& th, Vec<5>& grad) {
  double f = 0.0;
  grad = {0.0, 0.0, 0.0, 0.0, 0.0};
  for (std::size_t i = 0; i < d.u.size(); ++i) {
    const double w = d.weight[i];
    if (w == 0.0) continue;
    const double s1 = th[0] - th[3] * d.u[i], s2 = th[1] - th[4] * d.v[i], s3 = th[2];
    const double m = std::max({s1, s2, s3});
    const double e1 = std::exp(s1 - m), e2 = std::exp(s2 - m), e3 = std::exp(s3 - m);
    const double sum = e1 + e2 + e3;
    const double r = m + std::log(sum) - d.log_loss[i];
    f += w * huber(r, d.delta);
    const double h = w * huber_derivative(r, d.delta) / sum;
    grad[0] += h * e1;
    grad[1] += h * e2;
    grad[2] += h * e3;
    grad[3] -= h * e1 * d.u[i];
    grad[4] -= h * e2 * d.v[i];
  }
  return f;
}

inline ChinchillaFit chinchilla_fit_of(const ChinchillaData& d, const Vec<5>& th, double objective) {
  ChinchillaFit fit;
  fit.alpha = th[3];
  fit.beta = th[4];
  fit.A = std::exp(th[0] + th[3] * d.mean_log_params);
  fit.B = std::exp(th[1] + th[4] * d.mean_log_tokens);
  fit.E = std::exp(th[2]);
  fit.objective = objective;
  fit.huber_delta = d.delta;
  return fit;
}

inline Vec<5> chinchilla_theta(const ChinchillaData& d, double a, double b, double e, double alpha, double beta) {
  return {a - alpha * d.mean_log_params, b - beta * d.mean_log_tokens, e, alpha, beta};
}
inline Vec<5> chinchilla_theta(const ChinchillaData& d, const ChinchillaFit& f) {
  return chinchilla_theta(d, std::log(f.A), std::log(f.B), std::log(f.E), f.alpha, f.beta);
}

inline std::vector<Vec<5>> chinchilla_grid(const ChinchillaData& d, const ChinchillaStarts& s) {
  std::vector<Vec<5>> starts;
  starts.reserve(s.size());
  for (double alpha : s.alpha)
    for (double beta : s.beta)
      for (double e : s.e)
        for (double a : s.a)
          for (double b : s.b) starts.push_back(chinchilla_theta(d, a, b, e, alpha, beta));
  return starts;
}

inline std::optional<ChinchillaFit> fit_chinchilla(const ChinchillaData& d, const LbfgsOptions& lbfgs,
                                                   const std::vector<Vec<5>>& starts) {
  const auto objective = [&](const Vec<5>& th, Vec<5>& grad) { return chinchilla_objective(d, th, grad); };
  const std::optional<LbfgsResult<5>> best = multi_start<5>(objective, starts, lbfgs);
  if (!best) return std::nullopt;
  const ChinchillaFit fit = chinchilla_fit_of(d, best->x, best->value);
  if (!(fit.alpha > 0.0) || !(fit.beta > 0.0) || !std::isfinite(fit.A) || !std::isfinite(fit.B) ||
      !std::isfinite(fit.E))
    return std::nullopt;
  return fit;
}

// Resample r of n runs: how many times each run is drawn.
inline std::vector<double> resample_weights(const rng::Stream& stream, int r, std::size_t n) {
  std::vector<double> weight(n, 0.0);
  for (std::size_t j = 0; j < n; ++j) {
    const std::uint32_t bits = stream.bits(static_cast<std::uint64_t>(r) * n + j)[0];
    weight[static_cast<std::size_t>((static_cast<std::uint64_t>(bits) * n) >> 32)] += 1.0;
  }
  return weight;
}

// Why a bootstrap with `used` usable resamples has no intervals ("" when it has): 10
// is the fewest that a percentile interval is made of here.
inline std::string unusable(std::string_view fit, const BootstrapOptions& o, std::size_t used, int degenerate) {
  if (used >= 10) return {};
  return ::llmpar::detail::concat(fit, " bootstrap: only ", used, " of ", o.resamples, " resamples could be fitted (",
                                  degenerate,
                                  " had too few distinct runs or budgets, or no fit inside the constraints); "
                                  "add runs, so that most resamples keep enough of them");
}

}  // namespace detail

// ---------------------------------------------------------------------------------------
// The fits.

// L(C) = a·C^b + c over runs' flops and loss.
inline PowerLawFit fit_power_law(std::span<const ScalingRun> runs, const PowerLawOptions& options = {}) {
  options.validate();
  detail::check_positive(runs, "power-law fit", {{"flops", &ScalingRun::flops}, {"loss", &ScalingRun::loss}});
  const std::string refusal = detail::power_law_refusal(runs);
  LLMPAR_CHECK(refusal.empty(), refusal);
  const detail::PowerLawData d =
      detail::power_law_data(runs, std::vector<double>(runs.size(), 1.0), options.huber_delta);
  const std::optional<PowerLawFit> fit = detail::fit_power_law(d, options, {});
  if (!fit)
    LLMPAR_FAIL("power-law fit: the best fit of L(C) = a*C^b + c has no negative exponent b: the losses do not ",
                "fall with compute; check the runs' losses and flops (a scaling fit needs runs where more compute "
                "gives a lower loss)");
  return *fit;
}

// Hoffmann et al. 2022, approach 3, over runs' params, tokens and loss.
inline ChinchillaFit fit_chinchilla(std::span<const ScalingRun> runs, const ChinchillaOptions& options = {}) {
  options.validate();
  detail::check_positive(
      runs, "Chinchilla fit",
      {{"params", &ScalingRun::params}, {"tokens", &ScalingRun::tokens}, {"loss", &ScalingRun::loss}});
  const std::string refusal = detail::chinchilla_refusal(runs);
  LLMPAR_CHECK(refusal.empty(), refusal);
  const detail::ChinchillaData d =
      detail::chinchilla_data(runs, std::vector<double>(runs.size(), 1.0), options.huber_delta);
  const std::optional<ChinchillaFit> fit =
      detail::fit_chinchilla(d, options.lbfgs, detail::chinchilla_grid(d, options.starts));
  if (!fit)
    LLMPAR_FAIL("Chinchilla fit: the best fit of E + A/N^alpha + B/D^beta has an exponent that is not positive: ",
                "the losses do not fall with both parameters and tokens; check the runs' losses, or use the "
                "power law in compute alone");
  return *fit;
}

namespace detail {

// Every run has a list of its seeds' losses, positive, whose mean is the run's loss.
inline void check_seed_losses(std::span<const ScalingRun> runs, std::span<const std::vector<double>> seed_losses) {
  LLMPAR_CHECK(seed_losses.size() == runs.size(), "seed losses: ", seed_losses.size(), " lists for ", runs.size(),
               " runs; give one list per run (a run trained once has a list of one)");
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const std::vector<double>& s = seed_losses[i];
    LLMPAR_CHECK(!s.empty(), "seed losses: run ", runs[i].name, " has none; give at least its own loss");
    double sum = 0.0;
    for (double l : s) {
      LLMPAR_CHECK(std::isfinite(l) && l > 0.0, "seed losses: run ", runs[i].name, " has a seed loss ", l,
                   "; every seed's loss must be positive and finite");
      sum += l;
    }
    const double mean = sum / static_cast<double>(s.size());
    LLMPAR_CHECK(std::abs(mean - runs[i].loss) <= 1e-9 * runs[i].loss, "seed losses: run ", runs[i].name, " has loss ",
                 runs[i].loss, " but the mean of its ", s.size(), " seeds' losses is ", mean,
                 "; a run's loss must be the mean of its seeds'");
  }
}

// One resample's fit, started also from the full-data optimum in the resample's
// coordinates (c below its lowest loss); a resample with no falling fit is degenerate.
inline void add_resample(PowerLawBootstrap& out, const PowerLawData& d, const PowerLawFit& full,
                         const PowerLawOptions& fit_options) {
  const double fraction = std::clamp(full.c / d.lowest, 1e-12, 1.0 - 1e-12);
  const Vec<3> from_full = {std::log(full.a) + full.b * d.mean_log_flops, full.b, logit(fraction)};
  const std::optional<PowerLawFit> fit = fit_power_law(d, fit_options, {from_full});
  if (fit)
    out.samples.push_back(*fit);
  else
    ++out.degenerate;
}

// The parameters' intervals, or an error when too few resamples could be fitted.
inline void finish(PowerLawBootstrap& out, std::string_view fit) {
  const std::string why = unusable(fit, out.options, out.samples.size(), out.degenerate);
  LLMPAR_CHECK(why.empty(), why);
  const double conf = out.options.confidence;
  out.a = interval_of(out.samples, conf, [](const PowerLawFit& f) { return f.a; });
  out.b = interval_of(out.samples, conf, [](const PowerLawFit& f) { return f.b; });
  out.c = interval_of(out.samples, conf, [](const PowerLawFit& f) { return f.c; });
}

}  // namespace detail

// Percentile intervals of the power law from `options.resamples` resamples of runs;
// `full` is fit_power_law(runs, fit_options).
inline PowerLawBootstrap bootstrap_power_law(std::span<const ScalingRun> runs, const PowerLawFit& full,
                                             const BootstrapOptions& options = {},
                                             const PowerLawOptions& fit_options = {}) {
  options.validate();
  fit_options.validate();
  detail::check_positive(runs, "power-law bootstrap", {{"flops", &ScalingRun::flops}, {"loss", &ScalingRun::loss}});
  PowerLawBootstrap out;
  out.options = options;
  const rng::Stream stream = rng::Stream::named(options.seed, "plan.scaling.bootstrap.power_law");
  for (int r = 0; r < options.resamples; ++r) {
    std::vector<double> weight = detail::resample_weights(stream, r, runs.size());
    if (!detail::power_law_refusal(detail::distinct_runs(runs, weight), detail::kPowerLawMinRuns - 1).empty()) {
      ++out.degenerate;
      continue;
    }
    detail::add_resample(out, detail::power_law_data(runs, std::move(weight), fit_options.huber_delta), full,
                         fit_options);
  }
  detail::finish(out, "power-law");
  return out;
}

// The training noise of the power law: each resample keeps every size and redraws the
// size's loss as the mean of as many of its seeds' losses, drawn with replacement, as it
// has. Where bootstrap_power_law asks how much the fit depends on which sizes were
// trained, this asks how much it depends on the seeds they were trained with: the part
// of a prediction's error that more seeds per size, not more sizes, would shrink. With k
// seeds the redrawn mean varies (k - 1)/k as much as the mean itself does (the plug-in
// bootstrap), so with 3 seeds the interval is about 0.82x as wide as the noise it
// measures: a lower bound. seed_losses[i] holds run i's seeds (runs[i].loss their
// mean); `full` is fit_power_law(runs, fit_options).
inline PowerLawBootstrap seed_bootstrap_power_law(std::span<const ScalingRun> runs,
                                                  std::span<const std::vector<double>> seed_losses,
                                                  const PowerLawFit& full, const BootstrapOptions& options = {},
                                                  const PowerLawOptions& fit_options = {}) {
  options.validate();
  fit_options.validate();
  detail::check_positive(runs, "seed bootstrap", {{"flops", &ScalingRun::flops}, {"loss", &ScalingRun::loss}});
  detail::check_seed_losses(runs, seed_losses);
  PowerLawBootstrap out;
  out.options = options;
  const rng::Stream stream = rng::Stream::named(options.seed, "plan.scaling.bootstrap.seeds");
  std::size_t draws = 0;
  for (const std::vector<double>& s : seed_losses) draws += s.size();
  std::vector<ScalingRun> resample(runs.begin(), runs.end());
  for (int r = 0; r < options.resamples; ++r) {
    std::uint64_t at = static_cast<std::uint64_t>(r) * draws;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const std::vector<double>& s = seed_losses[i];
      double sum = 0.0;
      for (std::size_t k = 0; k < s.size(); ++k) {
        const std::uint32_t bits = stream.bits(at++)[0];
        sum += s[static_cast<std::size_t>((static_cast<std::uint64_t>(bits) * s.size()) >> 32)];
      }
      resample[i].loss = sum / static_cast<double>(s.size());
    }
    detail::add_resample(
        out, detail::power_law_data(resample, std::vector<double>(runs.size(), 1.0), fit_options.huber_delta), full,
        fit_options);
  }
  detail::finish(out, "seed");
  return out;
}

namespace detail {

// bootstrap_chinchilla, where too few usable resamples are `refusal` (the report notes
// it and goes on without Chinchilla) rather than an error.
inline ChinchillaBootstrap chinchilla_bootstrap(std::span<const ScalingRun> runs, const ChinchillaFit& full,
                                                const BootstrapOptions& options, const ChinchillaOptions& fit_options,
                                                std::string& refusal) {
  // The grid points with the lowest full-data objective, as (a, b, e, α, β) so that each
  // resample can centre them on its own means.
  std::vector<std::array<double, 5>> screened;
  {
    const detail::ChinchillaData d =
        detail::chinchilla_data(runs, std::vector<double>(runs.size(), 1.0), fit_options.huber_delta);
    std::vector<std::pair<double, detail::Vec<5>>> scored;
    detail::Vec<5> grad;
    for (const detail::Vec<5>& th : detail::chinchilla_grid(d, fit_options.starts))
      scored.emplace_back(detail::chinchilla_objective(d, th, grad), th);
    const auto keep = std::min(scored.size(), static_cast<std::size_t>(fit_options.bootstrap_starts));
    std::partial_sort(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(keep), scored.end(),
                      [](const auto& x, const auto& y) { return x.first < y.first; });
    for (std::size_t k = 0; k < keep; ++k) {
      const detail::Vec<5>& th = scored[k].second;
      screened.push_back({th[0] + th[3] * d.mean_log_params, th[1] + th[4] * d.mean_log_tokens, th[2], th[3], th[4]});
    }
  }
  ChinchillaBootstrap out;
  out.options = options;
  const rng::Stream stream = rng::Stream::named(options.seed, "plan.scaling.bootstrap.chinchilla");
  for (int r = 0; r < options.resamples; ++r) {
    std::vector<double> weight = detail::resample_weights(stream, r, runs.size());
    if (!detail::chinchilla_refusal(detail::distinct_runs(runs, weight), detail::kChinchillaMinRuns - 1).empty()) {
      ++out.degenerate;
      continue;
    }
    const detail::ChinchillaData d = detail::chinchilla_data(runs, std::move(weight), fit_options.huber_delta);
    std::vector<detail::Vec<5>> starts = {detail::chinchilla_theta(d, full)};
    for (const auto& s : screened) starts.push_back(detail::chinchilla_theta(d, s[0], s[1], s[2], s[3], s[4]));
    const std::optional<ChinchillaFit> fit = detail::fit_chinchilla(d, fit_options.lbfgs, starts);
    if (!fit) {
      ++out.degenerate;
      continue;
    }
    out.samples.push_back(*fit);
  }
  refusal = detail::unusable("Chinchilla", options, out.samples.size(), out.degenerate);
  if (!refusal.empty()) return out;
  const double conf = options.confidence;
  out.E = detail::interval_of(out.samples, conf, [](const ChinchillaFit& f) { return f.E; });
  out.A = detail::interval_of(out.samples, conf, [](const ChinchillaFit& f) { return f.A; });
  out.B = detail::interval_of(out.samples, conf, [](const ChinchillaFit& f) { return f.B; });
  out.alpha = detail::interval_of(out.samples, conf, [](const ChinchillaFit& f) { return f.alpha; });
  out.beta = detail::interval_of(out.samples, conf, [](const ChinchillaFit& f) { return f.beta; });
  return out;
}

}  // namespace detail

// Percentile intervals of the Chinchilla fit; `full` is fit_chinchilla(runs, fit_options).
inline ChinchillaBootstrap bootstrap_chinchilla(std::span<const ScalingRun> runs, const ChinchillaFit& full,
                                                const BootstrapOptions& options = {},
                                                const ChinchillaOptions& fit_options = {}) {
  options.validate();
  fit_options.validate();
  detail::check_positive(
      runs, "Chinchilla bootstrap",
      {{"params", &ScalingRun::params}, {"tokens", &ScalingRun::tokens}, {"loss", &ScalingRun::loss}});
  std::string refusal;
  ChinchillaBootstrap out = detail::chinchilla_bootstrap(runs, full, options, fit_options, refusal);
  LLMPAR_CHECK(refusal.empty(), refusal);
  return out;
}

// ---------------------------------------------------------------------------------------
// The report.

enum class Parametrization { sp, mup };
inline const char* parametrization_name(Parametrization p) { return p == Parametrization::sp ? "sp" : "mup"; }

// One run of a learning-rate sweep (loss NaN: the run diverged; JSON null).
struct LrSweepPoint {
  Parametrization parametrization = Parametrization::sp;
  std::int64_t width = 0;  // model dim
  double lr = 0.0;
  double loss = 0.0;
};

// How a sweep's runs set their learning rate: lr · (base_width / width)^exponent, in one
// parametrisation (exponent 0: one rate for every width, what µP promises).
struct RateRule {
  Parametrization parametrization = Parametrization::mup;
  double lr = 4e-3;
  std::int64_t base_width = 16;
  double exponent = 0.0;
  std::string why;  // what chose it

  double at(std::int64_t width) const {
    return lr * std::pow(static_cast<double>(base_width) / static_cast<double>(width), exponent);
  }
};

// The learning rate at which one parametrisation's sweep at one width is lowest: the
// vertex of the parabola in log(lr) through the lowest point and its two neighbours on
// the grid (the lowest point itself at an end of the grid, or where the three do not
// curve upwards). A diverged run (NaN) counts as the worst.
inline double best_rate(const std::vector<LrSweepPoint>& sweep, Parametrization p, std::int64_t width) {
  std::vector<LrSweepPoint> curve;
  for (const LrSweepPoint& s : sweep)
    if (s.parametrization == p && s.width == width) curve.push_back(s);
  LLMPAR_CHECK(!curve.empty(), "learning-rate sweep: no ", parametrization_name(p), " run at width ", width);
  std::sort(curve.begin(), curve.end(), [](const LrSweepPoint& a, const LrSweepPoint& b) { return a.lr < b.lr; });
  auto loss = [](const LrSweepPoint& s) { return std::isfinite(s.loss) ? s.loss : std::numeric_limits<double>::max(); };
  std::size_t i = 0;
  for (std::size_t k = 1; k < curve.size(); ++k)
    if (loss(curve[k]) < loss(curve[i])) i = k;
  if (i == 0 || i + 1 == curve.size()) return curve[i].lr;
  const double x0 = std::log(curve[i - 1].lr), x1 = std::log(curve[i].lr), x2 = std::log(curve[i + 1].lr);
  const double y0 = loss(curve[i - 1]), y1 = loss(curve[i]), y2 = loss(curve[i + 1]);
  const double curvature = y0 - 2.0 * y1 + y2;
  if (!std::isfinite(curvature) || !(curvature > 0.0) || std::abs((x2 - x1) - (x1 - x0)) > 1e-9 * std::abs(x2 - x0))
    return curve[i].lr;
  const double step = x1 - x0;
  return std::exp(std::clamp(x1 + 0.5 * step * (y0 - y2) / curvature, x0, x2));
}

// The lowest finite loss of one parametrisation's sweep at one width (infinity when
// every run diverged).
inline double lowest_loss(const std::vector<LrSweepPoint>& sweep, Parametrization p, std::int64_t width) {
  double lowest = std::numeric_limits<double>::infinity();
  for (const LrSweepPoint& s : sweep)
    if (s.parametrization == p && s.width == width && std::isfinite(s.loss)) lowest = std::min(lowest, s.loss);
  return lowest;
}

// How much worse than SP's (relative) µP's lowest loss at the wide width may be for the
// rule to keep µP: a parametrisation whose rate transfers but which trains the wide
// model worse makes every model wider than its base worse, the held-out one most.
inline constexpr double kMupLossMargin = 0.005;

// The rule a sweep at two widths (base and wide) supports. µP (when `prefer_mup`) where
// its best rate stays within a factor sqrt 2 (half a grid step of factor 2) between the
// widths and its lowest loss at the wide width is within kMupLossMargin of SP's: the
// base width's best rate then serves every width. Otherwise the standard
// parametrisation, with the power of width by which its own best rate moved, so that
// every size is trained near its best rate (a fit over badly tuned runs measures the
// tuning, not the model). Measured on the documentation corpus (docs/scaling.md): µP's
// rate held between widths 64 and 256 while its wide model's best loss was 1.5% above
// SP's, and the held-out model trained 3.1% worse under µP than under SP.
inline RateRule rate_rule(const std::vector<LrSweepPoint>& sweep, std::int64_t base_width, std::int64_t wide_width,
                          bool prefer_mup) {
  LLMPAR_CHECK(base_width > 0 && wide_width > base_width, "learning-rate sweep: widths ", base_width, " and ",
               wide_width, "; the rule needs a base width and a wider one");
  const double ratio = std::log(static_cast<double>(wide_width) / static_cast<double>(base_width));
  const auto shift = [&](Parametrization p) {
    return std::log(best_rate(sweep, p, wide_width) / best_rate(sweep, p, base_width)) / ratio;
  };
  const std::string widths = llmpar::detail::concat(" between widths ", base_width, " and ", wide_width);
  RateRule rule;
  rule.base_width = base_width;
  if (prefer_mup) {
    const double moved = shift(Parametrization::mup);
    const double mup_loss = lowest_loss(sweep, Parametrization::mup, wide_width);
    const double sp_loss = lowest_loss(sweep, Parametrization::sp, wide_width);
    const bool transfers = std::abs(moved) * ratio <= 0.5 * std::log(2.0);
    const bool trains_as_well = mup_loss <= (1.0 + kMupLossMargin) * sp_loss;
    rule.why = llmpar::detail::concat("under µP the best rate moved by width^", moved, widths);
    if (transfers && trains_as_well) {
      rule.parametrization = Parametrization::mup;
      rule.lr = best_rate(sweep, Parametrization::mup, base_width);
      rule.why += ": it transfers";
      return rule;
    }
    if (transfers)
      rule.why += llmpar::detail::concat(", but its lowest loss at width ", wide_width, " (", mup_loss, ") is ",
                                         100.0 * (mup_loss / sp_loss - 1.0), "% above SP's (", sp_loss, ")");
    rule.why += "; ";
  }
  const double moved = shift(Parametrization::sp);
  rule.parametrization = Parametrization::sp;
  rule.lr = best_rate(sweep, Parametrization::sp, base_width);
  rule.exponent = -moved;
  rule.why += llmpar::detail::concat("the standard parametrisation's best rate moved by width^", moved, widths);
  return rule;
}

// How many sequences each step of a sweep's run takes: one at the sweep's smallest
// compute, `largest` at its largest, geometrically in between (batch ∝ C^e with
// e = log(largest) / log(c_max / c_min)), in multiples of `multiple` (the data-parallel
// ranks). At a fixed token budget a small model learns far more from many small steps
// than from a few large ones (the 9.5k-parameter model of the default sweep: val loss
// 3.23 at 16 sequences per step, 2.68 at 1), so one batch for every size bends the fit's
// small end up; a batch that grows with compute is what compute-optimal sweeps use.
struct BatchRule {
  double c_min = 1.0, c_max = 1.0;  // FLOPs
  std::int64_t largest = 1, multiple = 1;

  void validate() const {
    LLMPAR_CHECK(std::isfinite(c_min) && c_min > 0.0 && std::isfinite(c_max) && c_max >= c_min, "batch rule: compute ",
                 c_min, " to ", c_max, " FLOPs; give a positive range");
    LLMPAR_CHECK(multiple >= 1 && largest >= multiple && largest % multiple == 0, "batch rule: the largest batch ",
                 largest, " must be a positive multiple of ", multiple, " (the ranks)");
  }
  double exponent() const {
    return c_max > c_min ? std::log(static_cast<double>(largest / multiple)) / std::log(c_max / c_min) : 0.0;
  }
  std::int64_t at(double flops) const {
    const double units = std::pow(std::clamp(flops, c_min, c_max) / c_min, exponent());
    return multiple * std::clamp<std::int64_t>(std::llround(units), 1, largest / multiple);
  }
};

// A power law of compute through the best learning rates of the sizes a sweep tuned:
// lr = lr_ref · (C / c_ref)^exponent, least squares in log-log (c_ref their geometric
// mean). One size: its rate at every compute. Best rates fall with compute (DeepSeek
// LLM's sweep found exponent -0.125); where the trend's own runs give it, it tells the
// held-out model its rate.
struct RateTrend {
  double c_ref = 1.0, lr_ref = 1e-3, exponent = 0.0;
  double at(double flops) const { return lr_ref * std::pow(flops / c_ref, exponent); }
};

// (flops, best rate) pairs, at least one; the same compute twice is allowed.
inline RateTrend fit_rate_trend(const std::vector<std::pair<double, double>>& points) {
  LLMPAR_CHECK(!points.empty(), "rate trend: no tuned run to fit");
  double mx = 0.0, my = 0.0;
  for (const auto& [c, lr] : points) {
    LLMPAR_CHECK(std::isfinite(c) && c > 0.0 && std::isfinite(lr) && lr > 0.0, "rate trend: a tuned run at ", c,
                 " FLOPs with rate ", lr, "; both must be positive");
    mx += std::log(c);
    my += std::log(lr);
  }
  const double n = static_cast<double>(points.size());
  mx /= n;
  my /= n;
  double sxx = 0.0, sxy = 0.0;
  for (const auto& [c, lr] : points) {
    sxx += (std::log(c) - mx) * (std::log(c) - mx);
    sxy += (std::log(c) - mx) * (std::log(lr) - my);
  }
  return {.c_ref = std::exp(mx), .lr_ref = std::exp(my), .exponent = sxx > 0.0 ? sxy / sxx : 0.0};
}

// One run's walk over learning rates: the next rate to train, or nullopt when the walk
// is done. It tries `center`, center · step and center / step, then steps past an end of
// what it tried for as long as the lowest loss sits at that end (a diverged run, NaN,
// counts as the worst), at most `max_runs` rates in all. `tried`: (lr, loss) pairs.
inline std::optional<double> next_rate(std::vector<std::pair<double, double>> tried, double center, double step,
                                       std::size_t max_runs) {
  LLMPAR_CHECK(std::isfinite(center) && center > 0.0 && std::isfinite(step) && step > 1.0 && max_runs >= 3,
               "rate walk: centre ", center, ", step ", step, ", at most ", max_runs,
               " runs; give a positive centre, a step above 1 and at least 3 runs");
  const double start[] = {center, center * step, center / step};
  if (tried.size() < 3) return start[tried.size()];
  if (tried.size() >= max_runs) return std::nullopt;
  std::sort(tried.begin(), tried.end());
  auto loss = [](double l) { return std::isfinite(l) ? l : std::numeric_limits<double>::max(); };
  std::size_t best = 0;
  for (std::size_t k = 1; k < tried.size(); ++k)
    if (loss(tried[k].second) < loss(tried[best].second)) best = k;
  if (best == 0) return tried.front().first / step;
  if (best + 1 == tried.size()) return tried.back().first * step;
  return std::nullopt;
}

struct PowerLawResult {
  PowerLawFit fit;
  PowerLawBootstrap bootstrap;
};
struct ChinchillaResult {
  ChinchillaFit fit;
  ChinchillaBootstrap bootstrap;
};

// The power law's predicted loss and interval at one compute budget.
struct BandPoint {
  double flops = 0.0, loss = 0.0, lo = 0.0, hi = 0.0;
};

struct HeldOutPrediction {
  std::string name;
  double flops = 0.0, params = 0.0, tokens = 0.0;
  double achieved = 0.0;                 // the run's loss
  Prediction power_law;                  // at its flops
  std::optional<Prediction> chinchilla;  // at its (params, tokens), when fitted
  std::optional<Interval> seed_noise;    // the power law's interval from the seeds alone, when they were given

  // (predicted − achieved) / achieved.
  double relative_error() const { return (power_law.value - achieved) / achieved; }
  double chinchilla_relative_error() const { return (chinchilla.value().value - achieved) / achieved; }
};

struct ScalingReport {
  std::vector<ScalingRun> fit_runs, held_out;
  // Runs that only the Chinchilla fit takes: off the compute-optimal rule (other tokens
  // per parameter), so they sit above the loss-against-compute frontier of fit_runs.
  std::vector<ScalingRun> chinchilla_only_runs;
  // Runs the sweep made but neither fit takes, and why (llmpar-scaling: those not yet
  // below the bigram loss, on a plateau no power law of compute describes).
  std::vector<ScalingRun> excluded_runs;
  std::string excluded_why;
  PowerLawResult power_law;
  // Each fit run's seeds' losses (fit_runs[i].loss their mean), when they were given, and
  // the power law's seed bootstrap (seed_bootstrap_power_law) where some run has two or more.
  std::vector<std::vector<double>> fit_seed_losses;
  std::optional<PowerLawBootstrap> seed_bootstrap;
  std::optional<ChinchillaResult> chinchilla;
  std::string chinchilla_note;                 // why there is no Chinchilla fit ("" when there is)
  std::vector<BandPoint> band;                 // increasing flops
  std::vector<HeldOutPrediction> predictions;  // one per held-out run, in order
  std::vector<LrSweepPoint> lr_sweep;
  std::optional<RateRule> rate_rule;    // how the fit's runs set their learning rate, where a sweep chose it
  std::optional<RateTrend> rate_trend;  // the tuned runs' best rates against compute, where they were tuned
};

struct ReportOptions {
  PowerLawOptions power_law;
  ChinchillaOptions chinchilla;
  BootstrapOptions bootstrap;
  int band_points = 64;
  double band_margin = 1.5;  // the band extends this factor below the smallest and above the largest C

  void validate() const {
    power_law.validate();
    chinchilla.validate();
    bootstrap.validate();
    LLMPAR_CHECK(band_points >= 2, "report band_points ", band_points, "; a band needs at least 2 points");
    LLMPAR_CHECK(std::isfinite(band_margin) && band_margin >= 1.0, "report band_margin ", band_margin,
                 "; use a factor >= 1 (1: the band spans exactly the runs)");
  }
};

// The power law fitted to fit_runs and Chinchilla to fit_runs and chinchilla_only_runs,
// their bootstraps, the band, and the predictions of the held-out runs. Chinchilla is
// attempted when the runs can identify it; otherwise, or when its fit or bootstrap is
// refused, chinchilla_note says why and the report has none. With fit_seed_losses (one
// list per fit run), the power law's seed bootstrap too.
inline ScalingReport make_report(std::vector<ScalingRun> fit_runs, std::vector<ScalingRun> held_out,
                                 const ReportOptions& options = {}, std::vector<ScalingRun> chinchilla_only_runs = {},
                                 std::vector<std::vector<double>> fit_seed_losses = {}) {
  options.validate();
  detail::check_positive(held_out, "held-out run", {{"flops", &ScalingRun::flops}, {"loss", &ScalingRun::loss}});
  detail::check_positive(
      chinchilla_only_runs, "Chinchilla-only run",
      {{"params", &ScalingRun::params}, {"tokens", &ScalingRun::tokens}, {"loss", &ScalingRun::loss}});
  ScalingReport report;
  report.fit_runs = std::move(fit_runs);
  report.held_out = std::move(held_out);
  report.chinchilla_only_runs = std::move(chinchilla_only_runs);
  const std::span<const ScalingRun> runs(report.fit_runs);
  std::vector<ScalingRun> chinchilla_runs = report.fit_runs;
  chinchilla_runs.insert(chinchilla_runs.end(), report.chinchilla_only_runs.begin(), report.chinchilla_only_runs.end());

  report.power_law.fit = fit_power_law(runs, options.power_law);
  report.power_law.bootstrap = bootstrap_power_law(runs, report.power_law.fit, options.bootstrap, options.power_law);
  report.fit_seed_losses = std::move(fit_seed_losses);
  if (std::any_of(report.fit_seed_losses.begin(), report.fit_seed_losses.end(),
                  [](const std::vector<double>& s) { return s.size() >= 2; }))
    report.seed_bootstrap = seed_bootstrap_power_law(runs, report.fit_seed_losses, report.power_law.fit,
                                                     options.bootstrap, options.power_law);  // checks the lists
  else if (!report.fit_seed_losses.empty())
    detail::check_seed_losses(runs, report.fit_seed_losses);

  bool positive = true;
  for (const auto* set : {&chinchilla_runs, &report.held_out})
    for (const ScalingRun& r : *set)
      positive = positive && std::isfinite(r.params) && r.params > 0.0 && std::isfinite(r.tokens) && r.tokens > 0.0;
  report.chinchilla_note = positive ? detail::chinchilla_refusal(chinchilla_runs)
                                    : "Chinchilla fit: not attempted, as some run has no positive params or tokens";
  if (report.chinchilla_note.empty()) {
    const detail::ChinchillaData d = detail::chinchilla_data(
        chinchilla_runs, std::vector<double>(chinchilla_runs.size(), 1.0), options.chinchilla.huber_delta);
    const std::optional<ChinchillaFit> fit =
        detail::fit_chinchilla(d, options.chinchilla.lbfgs, detail::chinchilla_grid(d, options.chinchilla.starts));
    if (fit) {
      ChinchillaBootstrap boot = detail::chinchilla_bootstrap(chinchilla_runs, *fit, options.bootstrap,
                                                              options.chinchilla, report.chinchilla_note);
      if (report.chinchilla_note.empty()) report.chinchilla = ChinchillaResult{*fit, std::move(boot)};
    } else {
      report.chinchilla_note =
          "Chinchilla fit: its best fit has an exponent that is not positive (the losses do not fall with both "
          "parameters and tokens)";
    }
  }

  double lo = std::numeric_limits<double>::infinity(), hi = 0.0;
  for (const auto* set : {&chinchilla_runs, &report.held_out})
    for (const ScalingRun& r : *set) {
      lo = std::min(lo, r.flops);
      hi = std::max(hi, r.flops);
    }
  const double log_lo = std::log(lo / options.band_margin), log_hi = std::log(hi * options.band_margin);
  for (int k = 0; k < options.band_points; ++k) {
    const double flops = std::exp(log_lo + (log_hi - log_lo) * k / (options.band_points - 1));
    const Interval i = report.power_law.bootstrap.predict(flops);
    report.band.push_back({flops, report.power_law.fit.predict(flops), i.lo, i.hi});
  }

  for (const ScalingRun& r : report.held_out) {
    HeldOutPrediction p;
    p.name = r.name;
    p.flops = r.flops;
    p.params = r.params;
    p.tokens = r.tokens;
    p.achieved = r.loss;
    const Interval i = report.power_law.bootstrap.predict(r.flops);
    p.power_law = {report.power_law.fit.predict(r.flops), i.lo, i.hi};
    if (report.seed_bootstrap) p.seed_noise = report.seed_bootstrap->predict(r.flops);
    if (report.chinchilla) {
      const Interval c = report.chinchilla->bootstrap.predict(r.params, r.tokens);
      p.chinchilla = Prediction{report.chinchilla->fit.predict(r.params, r.tokens), c.lo, c.hi};
    }
    report.predictions.push_back(std::move(p));
  }
  return report;
}

// ---------------------------------------------------------------------------------------
// JSON.

namespace detail {

using nlohmann::json;

inline json interval_json(const Interval& i) { return {{"lo", i.lo}, {"hi", i.hi}}; }
inline json prediction_json(const Prediction& p, double achieved) {
  return {{"predicted", p.value}, {"lo", p.lo}, {"hi", p.hi}, {"relative_error", (p.value - achieved) / achieved}};
}

// Readers: each names the path of what is missing or wrong ("fit_runs[2].loss").
inline void only_keys(const json& j, const std::string& where, std::initializer_list<std::string_view> keys) {
  LLMPAR_CHECK(j.is_object(), "scaling report: ", where, " must be a JSON object, is ", j.type_name());
  for (const auto& item : j.items())
    LLMPAR_CHECK(std::find(keys.begin(), keys.end(), item.key()) != keys.end(), "scaling report: ", where,
                 " has an unknown field \"", item.key(), "\" (misspelt, or written by a newer llmpar?)");
}
inline const json& member(const json& j, const std::string& where, const char* key) {
  LLMPAR_CHECK(j.is_object() && j.contains(key), "scaling report: ", where, " has no field \"", key, "\"");
  return j.at(key);
}
inline double number(const json& j, const std::string& where, const char* key, bool null_is_nan = false) {
  const json& v = member(j, where, key);
  if (null_is_nan && v.is_null()) return std::numeric_limits<double>::quiet_NaN();
  LLMPAR_CHECK(v.is_number(), "scaling report: ", where, ".", key, " must be a number, is ", v.dump());
  return v.get<double>();
}
inline const json& array(const json& j, const std::string& where, const char* key) {
  const json& v = member(j, where, key);
  LLMPAR_CHECK(v.is_array(), "scaling report: ", where, ".", key, " must be an array, is ", v.type_name());
  return v;
}
inline std::string text(const json& j, const std::string& where, const char* key) {
  const json& v = member(j, where, key);
  LLMPAR_CHECK(v.is_string(), "scaling report: ", where, ".", key, " must be a string, is ", v.dump());
  return v.get<std::string>();
}
inline Interval interval_from(const json& j, const std::string& where, const char* key) {
  const json& v = member(j, where, key);
  const std::string at = where + "." + key;
  only_keys(v, at, {"lo", "hi"});
  return {number(v, at, "lo"), number(v, at, "hi")};
}
inline std::vector<double> numbers(const json& j, const std::string& where, std::size_t n) {
  LLMPAR_CHECK(j.is_array() && j.size() == n, "scaling report: ", where, " must be an array of ", n, " numbers, is ",
               j.dump());
  std::vector<double> out;
  for (const json& v : j) {
    LLMPAR_CHECK(v.is_number(), "scaling report: ", where, " must hold numbers, has ", v.dump());
    out.push_back(v.get<double>());
  }
  return out;
}

inline json bootstrap_json(const BootstrapOptions& o, int degenerate, std::size_t used) {
  return {{"resamples", o.resamples},
          {"confidence", o.confidence},
          {"seed", o.seed},
          {"used", used},
          {"degenerate", degenerate}};
}
inline BootstrapOptions bootstrap_options_from(const json& j, const std::string& where, int& degenerate) {
  BootstrapOptions o;
  o.resamples = static_cast<int>(number(j, where, "resamples"));
  o.confidence = number(j, where, "confidence");
  const json& seed = member(j, where, "seed");
  LLMPAR_CHECK(seed.is_number_unsigned() || (seed.is_number_integer() && seed.get<std::int64_t>() >= 0),
               "scaling report: ", where, ".seed must be a non-negative integer, is ", seed.dump());
  o.seed = seed.get<std::uint64_t>();
  degenerate = static_cast<int>(number(j, where, "degenerate"));
  return o;
}

inline json power_law_bootstrap_json(const PowerLawBootstrap& b) {
  json out = bootstrap_json(b.options, b.degenerate, b.samples.size());
  out["a"] = interval_json(b.a);
  out["b"] = interval_json(b.b);
  out["c"] = interval_json(b.c);
  json samples = json::array();
  for (const PowerLawFit& f : b.samples) samples.push_back({f.a, f.b, f.c, f.objective});
  out["samples"] = std::move(samples);
  return out;
}
inline PowerLawBootstrap power_law_bootstrap_from(const json& b, const std::string& where, double huber_delta) {
  only_keys(b, where, {"resamples", "confidence", "seed", "used", "degenerate", "a", "b", "c", "samples"});
  PowerLawBootstrap boot;
  boot.options = bootstrap_options_from(b, where, boot.degenerate);
  boot.a = interval_from(b, where, "a");
  boot.b = interval_from(b, where, "b");
  boot.c = interval_from(b, where, "c");
  const json& samples = array(b, where, "samples");
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const std::vector<double> v = numbers(samples[i], ::llmpar::detail::concat(where, ".samples[", i, "]"), 4);
    boot.samples.push_back({v[0], v[1], v[2], v[3], huber_delta});
  }
  LLMPAR_CHECK(number(b, where, "used") == static_cast<double>(boot.samples.size()), "scaling report: ", where,
               ".used is ", b.at("used").dump(), " but there are ", boot.samples.size(), " samples");
  return boot;
}

}  // namespace detail

inline nlohmann::json to_json(const ScalingRun& r) {
  return {{"name", r.name}, {"params", r.params}, {"tokens", r.tokens}, {"flops", r.flops}, {"loss", r.loss}};
}

// A run from {"name", "params", "tokens", "flops", "loss"}; `where` names it in errors.
inline ScalingRun run_from_json(const nlohmann::json& j, const std::string& where) {
  detail::only_keys(j, where, {"name", "params", "tokens", "flops", "loss"});
  return {detail::text(j, where, "name"), detail::number(j, where, "params"), detail::number(j, where, "tokens"),
          detail::number(j, where, "flops"), detail::number(j, where, "loss")};
}

inline nlohmann::json to_json(const ScalingReport& report) {
  using nlohmann::json;
  const auto runs = [](const std::vector<ScalingRun>& v) {
    json a = json::array();
    for (const ScalingRun& r : v) a.push_back(to_json(r));
    return a;
  };
  const PowerLawFit& pl = report.power_law.fit;
  json seed_losses = json::array();
  for (const std::vector<double>& s : report.fit_seed_losses) seed_losses.push_back(s);

  json out = {{"format", kReportFormat},
              {"version", kReportVersion},
              {"fit_runs", runs(report.fit_runs)},
              {"fit_seed_losses", std::move(seed_losses)},
              {"held_out", runs(report.held_out)},
              {"chinchilla_only_runs", runs(report.chinchilla_only_runs)},
              {"excluded_runs", runs(report.excluded_runs)},
              {"excluded_why", report.excluded_why},
              {"power_law",
               {{"a", pl.a},
                {"b", pl.b},
                {"c", pl.c},
                {"objective", pl.objective},
                {"huber_delta", pl.huber_delta},
                {"bootstrap", detail::power_law_bootstrap_json(report.power_law.bootstrap)},
                {"seed_bootstrap",
                 report.seed_bootstrap ? detail::power_law_bootstrap_json(*report.seed_bootstrap) : json(nullptr)}}},
              {"chinchilla", nullptr},
              {"chinchilla_note", report.chinchilla_note}};
  if (report.chinchilla) {
    const ChinchillaFit& ch = report.chinchilla->fit;
    const ChinchillaBootstrap& chb = report.chinchilla->bootstrap;
    json boot = detail::bootstrap_json(chb.options, chb.degenerate, chb.samples.size());
    boot["E"] = detail::interval_json(chb.E);
    boot["A"] = detail::interval_json(chb.A);
    boot["B"] = detail::interval_json(chb.B);
    boot["alpha"] = detail::interval_json(chb.alpha);
    boot["beta"] = detail::interval_json(chb.beta);
    json s = json::array();
    for (const ChinchillaFit& f : chb.samples) s.push_back({f.E, f.A, f.B, f.alpha, f.beta, f.objective});
    boot["samples"] = std::move(s);
    out["chinchilla"] = {{"E", ch.E},
                         {"A", ch.A},
                         {"B", ch.B},
                         {"alpha", ch.alpha},
                         {"beta", ch.beta},
                         {"objective", ch.objective},
                         {"huber_delta", ch.huber_delta},
                         {"allocation_coefficient", ch.allocation_coefficient()},
                         {"bootstrap", std::move(boot)}};
  }
  json band = json::array();
  for (const BandPoint& b : report.band)
    band.push_back({{"flops", b.flops}, {"loss", b.loss}, {"lo", b.lo}, {"hi", b.hi}});
  out["band"] = std::move(band);
  json predictions = json::array();
  for (const HeldOutPrediction& p : report.predictions) {
    json j = detail::prediction_json(p.power_law, p.achieved);
    j["name"] = p.name;
    j["flops"] = p.flops;
    j["params"] = p.params;
    j["tokens"] = p.tokens;
    j["achieved"] = p.achieved;
    j["chinchilla"] = p.chinchilla ? detail::prediction_json(*p.chinchilla, p.achieved) : json(nullptr);
    j["seed_noise"] = p.seed_noise ? detail::interval_json(*p.seed_noise) : json(nullptr);
    predictions.push_back(std::move(j));
  }
  out["held_out_predictions"] = std::move(predictions);
  json sweep = json::array();
  for (const LrSweepPoint& s : report.lr_sweep) {
    sweep.push_back({{"parametrization", parametrization_name(s.parametrization)},
                     {"width", s.width},
                     {"lr", s.lr},
                     {"loss", std::isfinite(s.loss) ? json(s.loss) : json(nullptr)}});
  }
  out["lr_sweep"] = std::move(sweep);
  if (report.rate_rule) {
    const RateRule& r = *report.rate_rule;
    out["rate_rule"] = {{"parametrization", parametrization_name(r.parametrization)},
                        {"lr", r.lr},
                        {"base_width", r.base_width},
                        {"exponent", r.exponent},
                        {"why", r.why}};
  } else {
    out["rate_rule"] = nullptr;
  }
  if (report.rate_trend) {
    const RateTrend& t = *report.rate_trend;
    out["rate_trend"] = {{"c_ref", t.c_ref}, {"lr_ref", t.lr_ref}, {"exponent", t.exponent}};
  } else {
    out["rate_trend"] = nullptr;
  }
  return out;
}

// The report to_json wrote; every field is checked, and the error names its path.
inline ScalingReport from_json(const nlohmann::json& j) {
  using detail::array;
  using detail::interval_from;
  using detail::number;
  using nlohmann::json;
  detail::only_keys(j, "the report",
                    {"format", "version", "fit_runs", "fit_seed_losses", "held_out", "chinchilla_only_runs",
                     "excluded_runs", "excluded_why", "power_law", "chinchilla", "chinchilla_note", "band",
                     "held_out_predictions", "lr_sweep", "rate_rule", "rate_trend"});
  const json& format = detail::member(j, "the report", "format");
  LLMPAR_CHECK(format == kReportFormat, "scaling report: format is ", format.dump(), ", expected \"", kReportFormat,
               "\" (is this a file llmpar-scaling wrote?)");
  LLMPAR_CHECK(number(j, "the report", "version") == kReportVersion, "scaling report: version ",
               detail::member(j, "the report", "version").dump(), " is not ", kReportVersion,
               ", the version this llmpar reads");
  ScalingReport report;
  const auto runs = [&](const char* key, std::vector<ScalingRun>& into) {
    const json& a = array(j, "the report", key);
    for (std::size_t i = 0; i < a.size(); ++i)
      into.push_back(run_from_json(a[i], llmpar::detail::concat(key, "[", i, "]")));
  };
  runs("fit_runs", report.fit_runs);
  runs("held_out", report.held_out);
  runs("chinchilla_only_runs", report.chinchilla_only_runs);
  if (j.contains("excluded_runs")) {  // reports from before the exclusion have neither
    runs("excluded_runs", report.excluded_runs);
    report.excluded_why = detail::text(j, "the report", "excluded_why");
  }

  {
    const json& pl = detail::member(j, "the report", "power_law");
    detail::only_keys(pl, "power_law", {"a", "b", "c", "objective", "huber_delta", "bootstrap", "seed_bootstrap"});
    PowerLawFit& f = report.power_law.fit;
    f = {number(pl, "power_law", "a"), number(pl, "power_law", "b"), number(pl, "power_law", "c"),
         number(pl, "power_law", "objective"), number(pl, "power_law", "huber_delta")};
    report.power_law.bootstrap = detail::power_law_bootstrap_from(detail::member(pl, "power_law", "bootstrap"),
                                                                  "power_law.bootstrap", f.huber_delta);
    if (pl.contains("seed_bootstrap") && !pl.at("seed_bootstrap").is_null())  // reports from before it have none
      report.seed_bootstrap =
          detail::power_law_bootstrap_from(pl.at("seed_bootstrap"), "power_law.seed_bootstrap", f.huber_delta);
  }
  if (j.contains("fit_seed_losses")) {
    const json& a = array(j, "the report", "fit_seed_losses");
    for (std::size_t i = 0; i < a.size(); ++i) {
      const std::string where = llmpar::detail::concat("fit_seed_losses[", i, "]");
      LLMPAR_CHECK(a[i].is_array(), "scaling report: ", where, " must be an array of losses, is ", a[i].dump());
      report.fit_seed_losses.push_back(detail::numbers(a[i], where, a[i].size()));
    }
    if (!report.fit_seed_losses.empty()) detail::check_seed_losses(report.fit_runs, report.fit_seed_losses);
  }

  const json& ch = detail::member(j, "the report", "chinchilla");
  if (!ch.is_null()) {
    detail::only_keys(
        ch, "chinchilla",
        {"E", "A", "B", "alpha", "beta", "objective", "huber_delta", "allocation_coefficient", "bootstrap"});
    ChinchillaResult result;
    ChinchillaFit& f = result.fit;
    f = {number(ch, "chinchilla", "E"),          number(ch, "chinchilla", "A"),
         number(ch, "chinchilla", "B"),          number(ch, "chinchilla", "alpha"),
         number(ch, "chinchilla", "beta"),       number(ch, "chinchilla", "objective"),
         number(ch, "chinchilla", "huber_delta")};
    const json& b = detail::member(ch, "chinchilla", "bootstrap");
    const std::string where = "chinchilla.bootstrap";
    detail::only_keys(
        b, where, {"resamples", "confidence", "seed", "used", "degenerate", "E", "A", "B", "alpha", "beta", "samples"});
    ChinchillaBootstrap& boot = result.bootstrap;
    boot.options = detail::bootstrap_options_from(b, where, boot.degenerate);
    boot.E = interval_from(b, where, "E");
    boot.A = interval_from(b, where, "A");
    boot.B = interval_from(b, where, "B");
    boot.alpha = interval_from(b, where, "alpha");
    boot.beta = interval_from(b, where, "beta");
    const json& samples = array(b, where, "samples");
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const std::vector<double> v = detail::numbers(samples[i], llmpar::detail::concat(where, ".samples[", i, "]"), 6);
      boot.samples.push_back({v[0], v[1], v[2], v[3], v[4], v[5], f.huber_delta});
    }
    report.chinchilla = std::move(result);
  }
  report.chinchilla_note = detail::text(j, "the report", "chinchilla_note");

  const json& band = array(j, "the report", "band");
  for (std::size_t i = 0; i < band.size(); ++i) {
    const std::string where = llmpar::detail::concat("band[", i, "]");
    detail::only_keys(band[i], where, {"flops", "loss", "lo", "hi"});
    report.band.push_back({number(band[i], where, "flops"), number(band[i], where, "loss"),
                           number(band[i], where, "lo"), number(band[i], where, "hi")});
  }

  const json& predictions = array(j, "the report", "held_out_predictions");
  for (std::size_t i = 0; i < predictions.size(); ++i) {
    const json& p = predictions[i];
    const std::string where = llmpar::detail::concat("held_out_predictions[", i, "]");
    detail::only_keys(p, where,
                      {"name", "flops", "params", "tokens", "achieved", "predicted", "lo", "hi", "relative_error",
                       "chinchilla", "seed_noise"});
    HeldOutPrediction h;
    h.name = detail::text(p, where, "name");
    h.flops = number(p, where, "flops");
    h.params = number(p, where, "params");
    h.tokens = number(p, where, "tokens");
    h.achieved = number(p, where, "achieved");
    h.power_law = {number(p, where, "predicted"), number(p, where, "lo"), number(p, where, "hi")};
    number(p, where, "relative_error");  // derived: checked, not stored
    const json& c = detail::member(p, where, "chinchilla");
    if (!c.is_null()) {
      const std::string at = where + ".chinchilla";
      detail::only_keys(c, at, {"predicted", "lo", "hi", "relative_error"});
      h.chinchilla = Prediction{number(c, at, "predicted"), number(c, at, "lo"), number(c, at, "hi")};
      number(c, at, "relative_error");
    }
    if (p.contains("seed_noise") && !p.at("seed_noise").is_null()) h.seed_noise = interval_from(p, where, "seed_noise");
    report.predictions.push_back(std::move(h));
  }

  const json& sweep = array(j, "the report", "lr_sweep");
  for (std::size_t i = 0; i < sweep.size(); ++i) {
    const json& s = sweep[i];
    const std::string where = llmpar::detail::concat("lr_sweep[", i, "]");
    detail::only_keys(s, where, {"parametrization", "width", "lr", "loss"});
    LrSweepPoint point;
    const std::string p = detail::text(s, where, "parametrization");
    LLMPAR_CHECK(p == "sp" || p == "mup", "scaling report: ", where, ".parametrization is \"", p,
                 "\"; use \"sp\" (standard) or \"mup\" (maximal update)");
    point.parametrization = p == "sp" ? Parametrization::sp : Parametrization::mup;
    const json& width = detail::member(s, where, "width");
    LLMPAR_CHECK(width.is_number_integer() && width.get<std::int64_t>() > 0, "scaling report: ", where,
                 ".width must be a positive whole number (the model dim), is ", width.dump());
    point.width = width.get<std::int64_t>();
    point.lr = number(s, where, "lr");
    point.loss = number(s, where, "loss", /*null_is_nan=*/true);
    report.lr_sweep.push_back(point);
  }
  if (j.contains("rate_rule") && !j.at("rate_rule").is_null()) {
    const json& r = j.at("rate_rule");
    const std::string where = "rate_rule";
    detail::only_keys(r, where, {"parametrization", "lr", "base_width", "exponent", "why"});
    RateRule rule;
    const std::string p = detail::text(r, where, "parametrization");
    LLMPAR_CHECK(p == "sp" || p == "mup", "scaling report: rate_rule.parametrization is \"", p,
                 "\"; use \"sp\" (standard) or \"mup\" (maximal update)");
    rule.parametrization = p == "sp" ? Parametrization::sp : Parametrization::mup;
    rule.lr = number(r, where, "lr");
    const json& width = detail::member(r, where, "base_width");
    LLMPAR_CHECK(width.is_number_integer() && width.get<std::int64_t>() > 0,
                 "scaling report: rate_rule.base_width must be a positive whole number, is ", width.dump());
    rule.base_width = width.get<std::int64_t>();
    rule.exponent = number(r, where, "exponent");
    rule.why = detail::text(r, where, "why");
    report.rate_rule = rule;
  }
  if (j.contains("rate_trend") && !j.at("rate_trend").is_null()) {
    const json& t = j.at("rate_trend");
    const std::string where = "rate_trend";
    detail::only_keys(t, where, {"c_ref", "lr_ref", "exponent"});
    RateTrend trend{.c_ref = number(t, where, "c_ref"),
                    .lr_ref = number(t, where, "lr_ref"),
                    .exponent = number(t, where, "exponent")};
    LLMPAR_CHECK(trend.c_ref > 0.0 && trend.lr_ref > 0.0, "scaling report: rate_trend.c_ref ", trend.c_ref,
                 " and lr_ref ", trend.lr_ref, " must be positive");
    report.rate_trend = trend;
  }
  return report;
}

// ---------------------------------------------------------------------------------------
// CSV: name,params,tokens,flops,loss,role (role "fit", "chinchilla_only", "excluded" or "held_out"); numbers in the
// shortest form that reads back exactly, names quoted where they need it (RFC 4180).

namespace detail {

inline std::string shortest(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::string("nan");
}
inline std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace detail

inline void write_csv(std::ostream& out, std::span<const ScalingRun> fit_runs,
                      std::span<const ScalingRun> held_out = {}, std::span<const ScalingRun> chinchilla_only_runs = {},
                      std::span<const ScalingRun> excluded_runs = {}) {
  out << "name,params,tokens,flops,loss,role\n";
  for (const auto& [runs, role] : {std::pair{fit_runs, "fit"}, std::pair{chinchilla_only_runs, "chinchilla_only"},
                                   std::pair{excluded_runs, "excluded"}, std::pair{held_out, "held_out"}})
    for (const ScalingRun& r : runs)
      out << detail::csv_field(r.name) << ',' << detail::shortest(r.params) << ',' << detail::shortest(r.tokens) << ','
          << detail::shortest(r.flops) << ',' << detail::shortest(r.loss) << ',' << role << '\n';
}
inline void write_csv(std::ostream& out, const ScalingReport& report) {
  write_csv(out, report.fit_runs, report.held_out, report.chinchilla_only_runs, report.excluded_runs);
}
inline void write_csv(const std::string& path, const ScalingReport& report) {
  std::ofstream out(path);
  LLMPAR_CHECK(out.good(), "cannot open '", path,
               "' for writing the runs' CSV; check the directory exists and is writable");
  write_csv(out, report);
  out.flush();
  LLMPAR_CHECK(out.good(), "writing the runs' CSV to '", path, "' failed (disk full?)");
}

}  // namespace llmpar::scaling
