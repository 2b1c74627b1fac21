// Uses the installed headers the way a trainer would, and checks a few known values.
#include <cstdio>
#include <llmpar/core/dtype.hpp>
#include <llmpar/core/rng.hpp>
#include <llmpar/llmpar.hpp>  // the umbrella: every installed CPU header compiles for a user
#include <llmpar/testing/gradcheck.hpp>

int main() {
  int failures = 0;
  if (llmpar::bf16(1.0f).bits != 0x3F80) ++failures;
  if (llmpar::f16(65504.0f).bits != 0x7BFF) ++failures;
  if (static_cast<float>(llmpar::f16::from_bits(0x3C00)) != 1.0f) ++failures;
  const auto stream = llmpar::rng::Stream::named(1234, "wte");
  const float u = stream.uniform(0);
  if (!(u > 0.0f && u < 1.0f) || u != stream.uniform(0)) ++failures;
  if (llmpar::size_of(llmpar::DType::bf16) != 2) ++failures;
  // A GeGLU MLP from the installed sub-layers, checked with the installed gradient checker.
  llmpar::backend::cpu::Context ctx;
  llmpar::nn::Mlp<double, llmpar::backend::Cpu, llmpar::nn::GeGlu> mlp("mlp.up", "mlp.down", {.dim = 8, .hidden = 12});
  const auto report = llmpar::testing::check_layer(ctx, mlp, {.batch = 2, .seq = 3, .dim = 8});
  std::printf("%s\n", report.summary().c_str());
  if (!report.ok()) ++failures;
  std::printf("llmpar package consumer: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
