// llmpar/testing/gradcheck.hpp — checks a layer's or a model's backward against central
// finite differences, in double precision, and reports the worst element by name.
//
//   nn::ParameterStore<double> store;           // or let check_layer bind one
//   MyBlock<double> block("h.0", cfg);
//   const auto report = testing::check_layer(ctx, block, {.batch = 2, .seq = 5, .dim = cfg.dim});
//   if (!report.ok()) std::cerr << report.summary() << "\n";
//
// Why double, and why a report rather than a boolean: a float central difference of a
// transformer block has errors near 1e-3 relative (h must be large for float, and then
// the curvature shows), which hides a wrong factor of 1.001 as easily as a right
// answer; in double h = 1e-5 leaves ~1e-9, so a tolerance of 1e-6 separates a correct
// backward from an almost-correct one. A layer templated on its element type, as
// llmpar's are, is checked as Layer<double> and trained as Layer<float> or <bf16>: the
// same code. The report names the tensor and element that came worst (and the first
// failures), which is where a wrong backward shows first.
//
// What is compared, per element: the analytic gradient a (the layer's backward) and the
// numeric n = (f(p + h) - f(p - h)) / 2h. An element passes when
//     |a - n| <= max(atol, r, rtol · (|a| + |n|)),   r = 64 ε |f| / 2h,
// r being what the difference quotient can resolve at all (f's rounding, ε = 2^-52,
// over 2h). atol and r cover gradients that are zero by symmetry (GPT-2's key bias
// shifts every score of a row equally, which softmax ignores), where both sides are
// rounding noise.
//   - check_layer: f = Σ w ⊙ layer(x) for a random x (B·S, C) and a random w, so
//     ∂f/∂out = w; compares ∂f/∂x (a sample of x) and every parameter's gradient.
//   - check_model: f = the model's mean loss on random tokens and targets (evaluate),
//     against the gradients of one forward and backward.
// `samples` elements of each tensor are checked, spread evenly (all of a smaller one).
// Parameters that start as zeros or ones (biases, norm gains) are moved off those values
// first (move_constant_inits), since at exactly 0 or 1 some gradient paths vanish.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/nn/layer.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::testing {

struct GradcheckOptions {
  double step = 1e-5;                // h of the central differences
  double rtol = 1e-6;                // relative tolerance, on |a| + |n|
  double atol = 1e-10;               // absolute tolerance
  std::int64_t samples = 13;         // elements checked per tensor
  std::uint64_t seed = 1;            // the inputs, the targets, the output weights, the moved inits
  bool move_constant_inits = true;   // move zeros- and ones-initialised parameters by 0.1 σ first
  std::size_t failures_kept = 10;    // failures listed in the report

  void validate() const {
    LLMPAR_CHECK(step > 0.0 && std::isfinite(step), "gradcheck step is ", step, "; use a small positive h (1e-5)");
    LLMPAR_CHECK(rtol >= 0.0 && atol >= 0.0, "gradcheck tolerances rtol ", rtol, " and atol ", atol,
                 " must be >= 0");
    LLMPAR_CHECK(samples > 0, "gradcheck samples is ", samples, "; check at least 1 element per tensor");
  }
};

// One compared element.
struct GradcheckElement {
  std::string tensor;      // a parameter's name, or "x" (the layer's input)
  std::int64_t index = -1; // in the tensor's local elements
  double analytic = 0.0;
  double numeric = 0.0;
  double excess = 0.0;     // |a - n| over what is allowed (above): > 1 fails
};

struct GradcheckReport {
  std::int64_t checked = 0;
  std::int64_t failed = 0;
  GradcheckElement worst;                  // the largest excess
  std::vector<GradcheckElement> failures;  // the first GradcheckOptions::failures_kept

  bool ok() const { return checked > 0 && failed == 0; }
  // "gradcheck: 182 elements, 0 failed; worst h.0.attn.c_attn.weight[40]: analytic ..."
  std::string summary() const {
    std::ostringstream s;
    s.precision(10);
    s << "gradcheck: " << checked << " elements, " << failed << " failed";
    if (checked > 0) s << "; worst " << describe(worst);
    for (const GradcheckElement& e : failures)
      if (&e != &worst) s << "\n  failed " << describe(e);
    return s.str();
  }
  static std::string describe(const GradcheckElement& e) {
    std::ostringstream s;
    s.precision(10);
    s << e.tensor << "[" << e.index << "]: analytic " << e.analytic << ", numeric " << e.numeric << " ("
      << e.excess << " of the tolerance)";
    return s.str();
  }
};

namespace detail {

inline std::vector<double> normal_values(std::int64_t n, std::uint64_t seed, const char* name, double std) {
  const auto stream = rng::Stream::named(seed, name);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = std * stream.normal(static_cast<std::uint64_t>(i));
  return v;
}

inline std::vector<std::int32_t> random_ids(std::int64_t n, std::int64_t vocab, std::uint64_t seed, const char* name) {
  const auto stream = rng::Stream::named(seed, name);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(i))[0] %
                                                               static_cast<std::uint64_t>(vocab));
  return t;
}

// Compares the analytic gradient of `n` elements at `values` with central differences
// of f, sampling `samples` of them; restores every value it moves.
template <class F>
void compare(GradcheckReport& report, const GradcheckOptions& o, const std::string& tensor, double* values,
             const double* analytic, std::int64_t n, F&& f) {
  const std::int64_t stride = std::max<std::int64_t>(1, n / o.samples);
  for (std::int64_t i = 0; i < n; i += stride) {
    const double saved = values[i];
    values[i] = saved + o.step;
    const double up = f();
    values[i] = saved - o.step;
    const double down = f();
    values[i] = saved;
    const double numeric = (up - down) / (2.0 * o.step);
    const double a = analytic[i];
    // What the difference quotient itself cannot resolve: f's rounding over 2h.
    const double resolution =
        64.0 * std::numeric_limits<double>::epsilon() * std::max(std::abs(up), std::abs(down)) / (2.0 * o.step);
    const double allowed = std::max({o.atol, resolution, o.rtol * (std::abs(a) + std::abs(numeric))});
    const double excess = std::isfinite(a) && std::isfinite(numeric) ? std::abs(a - numeric) / allowed : std::numeric_limits<double>::infinity();
    GradcheckElement e{tensor, i, a, numeric, excess};
    if (report.checked == 0 || !(excess <= report.worst.excess)) report.worst = e;
    if (!(excess <= 1.0)) {
      ++report.failed;
      if (report.failures.size() < o.failures_kept) report.failures.push_back(e);
    }
    ++report.checked;
  }
}

// compare() for every parameter's gradient as backward left it (a copy: f's evaluations
// may write the gradient buffers).
template <class F>
void compare_parameters(GradcheckReport& report, const GradcheckOptions& o, std::span<nn::Parameter<double>* const> params,
                        F&& f) {
  std::vector<std::vector<double>> grads;
  for (const nn::Parameter<double>* p : params) grads.emplace_back(p->grad, p->grad + p->numel());
  for (std::size_t k = 0; k < params.size(); ++k)
    compare(report, o, params[k]->name, params[k]->value, grads[k].data(), params[k]->numel(), f);
}

inline void move_constant_inits(std::span<nn::Parameter<double>* const> params, std::uint64_t seed) {
  for (nn::Parameter<double>* p : params)
    if (p->init.kind != nn::Init::Kind::normal) {
      const auto stream = rng::Stream::named(seed + 2, p->name);
      for (std::int64_t i = 0; i < p->numel(); ++i) p->value[i] += 0.1 * stream.normal(static_cast<std::uint64_t>(i));
    }
}

}  // namespace detail

// The shape of check_layer's input: x is (batch·seq, dim).
struct LayerInput {
  std::int64_t batch = 2;
  std::int64_t seq = 5;
  std::int64_t dim = 0;  // the layer's channels C
};

// Checks `layer` (an nn::Layer of double on the CPU backend) against finite differences
// of Σ w ⊙ layer(x). Its parameters are used as they are when bound to a store;
// otherwise a store of the check binds them and initialises them from opts.seed.
template <class L>
GradcheckReport check_layer(backend::cpu::Context& ctx, L& layer, const LayerInput& in,
                            const GradcheckOptions& opts = {}) {
  static_assert(nn::check_layer<L, backend::Cpu, double>(),
                "llmpar::testing::check_layer: the layer is checked as a Layer of double elements on backend::Cpu "
                "(write it as a template on its element type and pass Layer<double>)");
  opts.validate();
  LLMPAR_CHECK(in.batch > 0 && in.seq > 0 && in.dim > 0, "check_layer: batch ", in.batch, ", seq ", in.seq,
               ", dim ", in.dim, "; give the layer's channels as dim and a positive batch and seq");
  std::vector<nn::Parameter<double>*> params;
  bool bound = true;
  layer.parameters([&](nn::Parameter<double>& p) {
    params.push_back(&p);
    bound = bound && p.value != nullptr;
  });
  nn::ParameterStore<double> own;
  if (!bound) {
    own.bind(layer);
    own.initialize(opts.seed);
  }
  if (opts.move_constant_inits) detail::move_constant_inits(params, opts.seed);

  const std::int64_t n = in.batch * in.seq * in.dim;
  std::vector<double> x = detail::normal_values(n, opts.seed, "gradcheck.x", 1.0);
  const std::vector<double> w = detail::normal_values(n, opts.seed, "gradcheck.w", 1.0);
  std::vector<double> out(static_cast<std::size_t>(n)), dx(static_cast<std::size_t>(n));
  typename L::Saved saved;
  auto f = [&] {
    layer.forward(ctx, saved, out.data(), x.data(), in.batch, in.seq);
    double sum = 0.0;
    for (std::int64_t i = 0; i < n; ++i) sum += w[static_cast<std::size_t>(i)] * out[static_cast<std::size_t>(i)];
    return sum;
  };
  f();
  for (nn::Parameter<double>* p : params) std::fill(p->grad, p->grad + p->numel(), 0.0);
  layer.backward(ctx, saved, dx.data(), w.data(), x.data(), in.batch, in.seq);
  GradcheckReport report;
  detail::compare(report, opts, "x", x.data(), dx.data(), n, f);
  detail::compare_parameters(report, opts, params, f);
  return report;
}

// The shape of check_model's batch: random tokens and targets in [0, vocab).
struct ModelInput {
  std::int64_t batch = 2;
  std::int64_t seq = 5;
  std::int64_t vocab = 0;  // the model's real vocabulary
};

// Checks a whole model of double elements (models::Transformer<double>, or any type
// with zero_grad, forward, backward, evaluate and parameter_store as it has) against
// finite differences of its loss.
template <class Model>
GradcheckReport check_model(backend::cpu::Context& ctx, Model& model, const ModelInput& in,
                            const GradcheckOptions& opts = {}) {
  static_assert(std::is_same_v<typename Model::value_type, double>,
                "llmpar::testing::check_model: the model is checked in double (Model<double>): finite differences "
                "in float carry errors near 1e-3, larger than the bugs they should find");
  opts.validate();
  LLMPAR_CHECK(in.batch > 0 && in.seq > 0 && in.vocab > 0, "check_model: batch ", in.batch, ", seq ", in.seq,
               ", vocab ", in.vocab, "; give the model's vocabulary and a positive batch and seq");
  const auto params = model.parameter_store().parameters();
  if (opts.move_constant_inits) detail::move_constant_inits(params, opts.seed);
  const std::int64_t rows = in.batch * in.seq;
  const auto tokens = detail::random_ids(rows, in.vocab, opts.seed, "gradcheck.tokens");
  const auto targets = detail::random_ids(rows, in.vocab, opts.seed, "gradcheck.targets");
  model.zero_grad(ctx);
  model.forward(ctx, tokens.data(), targets.data(), in.batch, in.seq);
  model.backward(ctx);
  auto f = [&] { return static_cast<double>(model.evaluate(ctx, tokens.data(), targets.data(), in.batch, in.seq)); };
  GradcheckReport report;
  detail::compare_parameters(report, opts, params, f);
  return report;
}

}  // namespace llmpar::testing
