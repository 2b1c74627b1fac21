// llmpar/plan/cluster.hpp — what the planner knows of a machine: devices, their memory,
// GEMM throughput by precision, memory bandwidth, and the links between them.
//
// A cost model is only as good as the numbers it is given, so a Cluster holds measured
// or data-sheet numbers, never guesses spread through the formulas:
//  - GEMM throughput is not one peak. Thin products run far below it, and a layout
//    that splits a layer over tp ranks makes its products thinner. A Gemm curve says
//    how fast a product whose smallest dimension is d runs: peak · d / (d + half), one
//    (peak, half) per precision. A training step's products are tall (B·S rows) and as
//    wide as a layer (C, 4C, C/tp), so the smallest dimension is what limits them. The
//    CPU's curve is fitted to (2048, d, d) products the planner times itself
//    (llmpar-plan --calibrate); the GPUs' take the data sheet's dense peak and a half
//    size typical of cuBLASLt on large-SM parts.
//  - Links carry the bus bandwidth a collective reaches (nccl-tests' busbw, the same
//    definition as benchmarks/comm_bench.hpp), and the latency of one small message. A
//    group whose ranks all sit on one node uses the intra-node link; one that spans
//    nodes runs at the inter-node link's busbw.
//  - shared_node: the ranks of a node share its cores, its GEMM throughput and its
//    memory bandwidth (llmpar's thread ranks, and MPI processes on one CPU). Each rank
//    gets 1/ranks of the node. GPUs are not shared.
//  - overlap: the fraction of a data-parallel reduction that runs hidden under
//    backward. A GPU reduces on its own stream while the SMs compute; a CPU's
//    communication thread takes cores from the compute, so it hides nothing.
//  - A collective costs more than its bytes. Link::latency is what one ring step adds
//    when the ranks arrive from compute (on a CPU: the wake-ups and the ranks' uneven
//    arrival, measured between GEMMs, not in a tight loop); collective_overhead is what
//    one collective issued by a rank's communication thread costs the ranks' compute
//    (on a shared node the thread takes a core's time slice from it; ~0 on a GPU).
// Presets: h100x8xN and h200x8xN (SXM parts, NVLink 4 within a node of 8, one 400 Gb/s
// InfiniBand NIC per GPU between nodes), and files written by --calibrate.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::plan {

// Achieved GEMM throughput against product size: peak · d / (d + half), d = min(m, n, k).
struct Gemm {
  double peak_flops = 0.0;  // FLOP/s a large product approaches (per device; per node when shared)
  double half = 0.0;        // the size at which a product reaches half the peak

  double flops_per_second(double m, double n, double k) const {
    const double d = std::min({m, n, k});
    return peak_flops * d / (d + half);
  }
  double seconds(double m, double n, double k) const { return 2.0 * m * n * k / flops_per_second(m, n, k); }
};

// What the rest of a step runs at, per precision: the element-wise kernels (norms,
// GELU, residual adds: bytes of activations read and written per second, conversions of
// 16-bit values included) and the attention core (its causal FLOPs per second).
struct Kernels {
  double elementwise = 0.0;  // bytes/s
  double attention = 0.0;    // FLOP/s
};

// One kind of link: the bus bandwidth a large collective reaches, and one message's latency.
struct Link {
  double busbw = 0.0;    // bytes/s (nccl-tests' busbw)
  double latency = 0.0;  // seconds per message step
};

struct Cluster {
  std::string name;
  int nodes = 1;
  int devices_per_node = 1;
  double memory_bytes = 0.0;                         // per device (per node when shared)
  double reserved_bytes = 0.0;                       // per device, not the run's: a CUDA context, NCCL's buffers
  Gemm fp32, bf16, fp16;                             // GEMMs by storage precision
  Kernels fp32_kernels, bf16_kernels, fp16_kernels;  // the rest, by storage precision
  double memory_bandwidth = 0.0;                     // bytes/s per device (per node when shared)
  Link intra, inter;
  bool shared_node = false;
  double overlap = 0.0;              // the fraction of data-parallel communication hidden under backward
  double collective_overhead = 0.0;  // seconds of compute one communication-thread collective costs
  double kernel_overhead = 0.0;      // seconds a kernel call costs beyond its work (launch, fork/join)
  double gemm_overhead = 0.0;        // seconds a GEMM call costs beyond its work
  double shared_ranks = 1.0;         // a shared node's throughput with a rank per core, relative to one rank on all
  double oversubscribed = 1.0;       // a shared node's throughput with twice as many ranks as cores, relative

  int devices() const { return nodes * devices_per_node; }
  const Kernels& kernels(DType storage) const {
    return storage == DType::bf16 ? bf16_kernels : storage == DType::f16 ? fp16_kernels : fp32_kernels;
  }
  const Gemm& gemm(DType storage) const {
    switch (storage) {
      case DType::bf16:
        return bf16;
      case DType::f16:
        return fp16;
      default:
        return fp32;
    }
  }

  void validate() const {
    LLMPAR_CHECK(nodes >= 1 && devices_per_node >= 1, "cluster '", name, "': ", nodes, " nodes of ", devices_per_node,
                 " devices; give at least 1 of each");
    LLMPAR_CHECK(memory_bytes > 0.0, "cluster '", name, "': memory_bytes is ", memory_bytes,
                 "; give each device's memory in bytes");
    for (const auto& [g, what] : {std::pair{&fp32, "fp32"}, std::pair{&bf16, "bf16"}, std::pair{&fp16, "fp16"}})
      LLMPAR_CHECK(g->peak_flops > 0.0 && g->half >= 0.0, "cluster '", name, "': the ", what, " GEMM peak is ",
                   g->peak_flops, " FLOP/s with half size ", g->half, "; give a positive peak and a half size >= 0");
    for (const auto& [k, what] :
         {std::pair{&fp32_kernels, "fp32"}, std::pair{&bf16_kernels, "bf16"}, std::pair{&fp16_kernels, "fp16"}})
      LLMPAR_CHECK(k->elementwise > 0.0 && k->attention > 0.0, "cluster '", name, "': the ", what,
                   " kernels' rates are ", k->elementwise, " B/s element-wise and ", k->attention,
                   " FLOP/s attention; give positive rates");
    LLMPAR_CHECK(memory_bandwidth > 0.0, "cluster '", name, "': memory_bandwidth is ", memory_bandwidth,
                 "; give bytes per second");
    LLMPAR_CHECK(intra.busbw > 0.0 && inter.busbw > 0.0 && intra.latency >= 0.0 && inter.latency >= 0.0, "cluster '",
                 name, "': links need a positive busbw and a latency >= 0 (intra ", intra.busbw, " B/s, inter ",
                 inter.busbw, " B/s)");
    LLMPAR_CHECK(overlap >= 0.0 && overlap <= 1.0, "cluster '", name, "': overlap is ", overlap,
                 "; it is a fraction in [0, 1]");
    LLMPAR_CHECK(kernel_overhead >= 0.0 && gemm_overhead >= 0.0, "cluster '", name, "': call overheads (kernel ",
                 kernel_overhead, " s, GEMM ", gemm_overhead, " s) must be >= 0");
    LLMPAR_CHECK(shared_ranks > 0.0 && shared_ranks <= 2.0, "cluster '", name, "': shared_ranks is ", shared_ranks,
                 "; it is a throughput ratio in (0, 2]");
    LLMPAR_CHECK(oversubscribed > 0.0 && oversubscribed <= 1.0, "cluster '", name, "': oversubscribed is ",
                 oversubscribed, "; it is a throughput fraction in (0, 1]");
    LLMPAR_CHECK(collective_overhead >= 0.0, "cluster '", name, "': collective_overhead is ", collective_overhead,
                 "; give seconds >= 0");
  }

  // "h100x8x4" / "h200x8x2": N nodes of 8 SXM GPUs. Data-sheet dense peaks (989 TFLOP/s
  // bf16 and fp16, 67 fp32 without TF32), HBM bandwidth, NVLink 4 at the ~360 GB/s busbw
  // NCCL's all-reduce reaches on 8 GPUs, and one 400 Gb/s NIC per GPU (~45 GB/s busbw).
  static Cluster preset(std::string_view name) {
    Cluster c;
    int gpus = 0, nodes = 0;
    char part[8] = {};
    if (std::sscanf(std::string(name).c_str(), "%4[a-z0-9]x%dx%d", part, &gpus, &nodes) == 3 && gpus == 8 &&
        nodes >= 1 && (std::string_view(part) == "h100" || std::string_view(part) == "h200")) {
      const bool h200 = std::string_view(part) == "h200";
      c.name = std::string(name);
      c.nodes = nodes;
      c.devices_per_node = 8;
      c.memory_bytes = h200 ? 141e9 : 80e9;
      c.reserved_bytes = 1.5e9;  // CUDA context, cuBLASLt workspace, NCCL buffers, allocator slack
      c.bf16 = {989e12, 512.0};  // a 768-wide layer's GEMMs at 60% of peak, a 1600-wide one's at 76%
      c.fp16 = {989e12, 512.0};
      c.fp32 = {67e12, 128.0};
      c.memory_bandwidth = h200 ? 4.8e12 : 3.35e12;
      // Element-wise kernels at 70% of HBM bandwidth; flash attention at 40% of the
      // tensor cores' peak in 16 bits, its SIMT fp32 path at half the fp32 peak.
      c.fp32_kernels = {0.7 * c.memory_bandwidth, 0.5 * c.fp32.peak_flops};
      c.bf16_kernels = {0.7 * c.memory_bandwidth, 0.4 * c.bf16.peak_flops};
      c.fp16_kernels = c.bf16_kernels;
      c.kernel_overhead = 4e-6;  // a kernel launch
      c.gemm_overhead = 6e-6;
      c.intra = {360e9, 8e-6};
      c.inter = {45e9, 15e-6};
      c.shared_node = false;
      c.overlap = 0.9;
      return c;
    }
    LLMPAR_FAIL("unknown cluster '", name,
                "'; use h100x8xN or h200x8xN (N nodes of 8 GPUs), or a JSON file written by llmpar-plan --calibrate");
  }

  // A preset's name, or a JSON file (see to_json).
  static Cluster named(const std::string& name_or_file) {
    if (name_or_file.ends_with(".json")) {
      std::ifstream in(name_or_file);
      LLMPAR_CHECK(in.good(), "cluster file ", name_or_file,
                   " cannot be read; check the path (llmpar-plan "
                   "--calibrate FILE writes one for this machine)");
      nlohmann::json j;
      try {
        in >> j;
      } catch (const nlohmann::json::exception& e) {
        LLMPAR_FAIL("cluster file ", name_or_file, " is not JSON (", e.what(), ")");
      }
      return from_json(j, name_or_file);
    }
    return preset(name_or_file);
  }

  // Every real-valued figure of a cluster, with its place in the JSON file (a JSON
  // pointer) and whether a file must hold it: the one list that to_json, from_json and
  // llmpar-plan's median of calibration passes walk. C is Cluster or const Cluster.
  template <class C, class F>
  static void for_each_figure(C& c, F&& f) {
    for (auto [g, key] : {std::pair{&c.fp32, "fp32"}, std::pair{&c.bf16, "bf16"}, std::pair{&c.fp16, "fp16"}}) {
      f(std::string("/gemm/") + key + "/peak_flops", g->peak_flops, true);
      f(std::string("/gemm/") + key + "/half", g->half, true);
    }
    for (auto [k, key] :
         {std::pair{&c.fp32_kernels, "fp32"}, std::pair{&c.bf16_kernels, "bf16"}, std::pair{&c.fp16_kernels, "fp16"}}) {
      f(std::string("/kernels/") + key + "/elementwise", k->elementwise, true);
      f(std::string("/kernels/") + key + "/attention", k->attention, true);
    }
    for (auto [l, key] : {std::pair{&c.intra, "intra"}, std::pair{&c.inter, "inter"}}) {
      f(std::string("/") + key + "/busbw", l->busbw, true);
      f(std::string("/") + key + "/latency", l->latency, true);
    }
    f(std::string("/memory_bytes"), c.memory_bytes, true);
    f(std::string("/reserved_bytes"), c.reserved_bytes, true);
    f(std::string("/memory_bandwidth"), c.memory_bandwidth, true);
    f(std::string("/overlap"), c.overlap, true);
    f(std::string("/collective_overhead"), c.collective_overhead, true);
    f(std::string("/kernel_overhead"), c.kernel_overhead, true);
    f(std::string("/gemm_overhead"), c.gemm_overhead, true);
    f(std::string("/shared_ranks"), c.shared_ranks, false);  // files from before it was measured: 1
    f(std::string("/oversubscribed"), c.oversubscribed, true);
  }

  nlohmann::json to_json() const {
    nlohmann::json j{
        {"name", name}, {"nodes", nodes}, {"devices_per_node", devices_per_node}, {"shared_node", shared_node}};
    for_each_figure(*this, [&](const std::string& at, double v, bool) { j[nlohmann::json::json_pointer(at)] = v; });
    return j;
  }

  static Cluster from_json(const nlohmann::json& j, const std::string& from) {
    Cluster c;
    try {
      c.name = j.at("name").get<std::string>();
      c.nodes = j.at("nodes").get<int>();
      c.devices_per_node = j.at("devices_per_node").get<int>();
      c.shared_node = j.at("shared_node").get<bool>();
      for_each_figure(c, [&](const std::string& at, double& v, bool required) {
        const nlohmann::json::json_pointer ptr(at);
        if (required || j.contains(ptr)) v = j.at(ptr).get<double>();
      });
    } catch (const nlohmann::json::exception& e) {
      LLMPAR_FAIL("cluster ", from, ": ", e.what(), "; rewrite it with llmpar-plan --calibrate FILE");
    }
    c.validate();
    return c;
  }
};

}  // namespace llmpar::plan
