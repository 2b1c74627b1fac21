// bench_checkpoint — how fast a checkpoint is saved and loaded, against the disk's
// sequential write speed: GPT-2 124M (fp32; parameters and both AdamW moments, 1.49 GB)
// on one rank, in the directory $LLMPAR_BENCH_DIR (default: the working directory).
//
//   DiskSequentialWrite  the same bytes written with write() and one fsync: the ceiling
//   Snapshot             Trainer::snapshot into a reused snapshot: the copy to host memory
//                        (what stops training)
//   Save                 Checkpointer: the shard (safetensors, fsynced), metadata, commit;
//                        of_disk: its speed over a plain write of the same bytes just
//                        before (the disk's speed drifts)
//   Load                 Checkpoint::open + Trainer::restore (from the page cache: the
//                        files were just written)
//
// Counter GB/s is bytes of state over the time (decimal GB). Save runs on the training
// thread here (background = false) to time it; in train_gpt it overlaps training, and
// only Snapshot stops it.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <llmpar/llmpar.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using namespace llmpar;
namespace fs = std::filesystem;

namespace {

std::string bench_dir() {
  const char* d = std::getenv("LLMPAR_BENCH_DIR");
  const fs::path dir = fs::path(d ? d : ".") / "bench_checkpoint.tmp";
  fs::create_directories(dir);
  return dir.string();
}

// GPT-2 124M with its trainer, built once.
struct Setup {
  using Model = models::GPT2<float>;
  backend::cpu::Context ctx;
  std::vector<std::uint16_t> tokens = std::vector<std::uint16_t>(1 << 16, 7);
  data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 50257, "bench");
  data::DataLoader loader{dataset, {.batch_size = 1, .seq_len = 64}};
  Model model{models::GPT2Config{}, 1};
  train::Trainer<Model> trainer{ctx,    model,        {}, {.peak_lr = 1e-4f, .warmup_steps = 0, .total_steps = 10},
                                loader, {.steps = 10}};
  std::string dir = bench_dir();
};
Setup& setup() {
  static Setup s;
  return s;
}

void report(benchmark::State& state, double bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB"] = bytes * 1e-9;
}

// The snapshot's bytes written with write() (64 MiB at a time) and one fsync: seconds.
double write_plainly(const std::string& path, const checkpoint::Snapshot& snap) {
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (const auto& d : snap.data) {
    const char* p = reinterpret_cast<const char*>(d.data());
    const std::size_t n = d.size() * sizeof(float);
    for (std::size_t done = 0; done < n;) {
      const ssize_t w = ::write(fd, p + done, std::min<std::size_t>(n - done, std::size_t{64} << 20));
      if (w <= 0) break;
      done += static_cast<std::size_t>(w);
    }
  }
  ::fsync(fd);
  ::close(fd);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void DiskSequentialWrite(benchmark::State& state) {
  Setup& s = setup();
  const auto snap = s.trainer.snapshot(train::SnapshotScope::saved);
  for (auto _ : state) write_plainly(s.dir + "/sequential.bin", snap);
  fs::remove(s.dir + "/sequential.bin");
  report(state, static_cast<double>(snap.bytes()));
}

void Snapshot(benchmark::State& state) {
  Setup& s = setup();
  checkpoint::Snapshot snap;
  s.trainer.snapshot(train::SnapshotScope::saved, snap);  // the buffers' first touch
  for (auto _ : state) {
    s.trainer.snapshot(train::SnapshotScope::saved, snap);
    benchmark::DoNotOptimize(snap.data[0].data());
  }
  report(state, static_cast<double>(snap.bytes()));
}

// Each iteration also writes the same bytes plainly just before (not timed): the disk's
// speed varies by 2-4x from minute to minute here (a virtual disk), so the ratio of
// adjacent measurements is the comparison.
void Save(benchmark::State& state) {
  Setup& s = setup();
  auto snap = s.trainer.snapshot(train::SnapshotScope::saved);
  const std::size_t bytes = snap.bytes();
  double disk = 0.0, save = 0.0;
  comm::run_threads(1, [&](comm::ThreadComm& world) {
    checkpoint::Checkpointer saver(world, {.dir = s.dir + "/ck", .keep = 1, .background = false});
    std::int64_t step = 1;
    for (auto _ : state) {
      state.PauseTiming();
      disk += write_plainly(s.dir + "/plain.bin", snap);
      auto copy = snap;
      const auto t0 = std::chrono::steady_clock::now();
      state.ResumeTiming();
      saver.save(step++, std::move(copy), {{"model", nlohmann::json::object()}, {"layout", s.trainer.layout()}});
      state.PauseTiming();
      save += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      state.ResumeTiming();
    }
  });
  fs::remove(s.dir + "/plain.bin");
  report(state, static_cast<double>(bytes));
  state.counters["disk_GB/s"] = static_cast<double>(bytes) * 1e-9 * static_cast<double>(state.iterations()) / disk;
  state.counters["of_disk"] = disk / save;
}

void Load(benchmark::State& state) {
  Setup& s = setup();
  std::size_t bytes = 0;
  for (auto _ : state) {
    const auto c = checkpoint::Checkpoint::open(s.dir + "/ck");
    s.trainer.restore(c.source(), c.state());
    bytes = static_cast<std::size_t>(fs::file_size(c.dir() + "/rank_00000.safetensors"));
  }
  report(state, static_cast<double>(bytes));
}

}  // namespace

BENCHMARK(DiskSequentialWrite)->Unit(benchmark::kMillisecond)->Iterations(2)->UseRealTime();
BENCHMARK(Snapshot)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(Save)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(Load)->Unit(benchmark::kMillisecond)->Iterations(2)->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::error_code ec;
  fs::remove_all(bench_dir(), ec);
  return 0;
}
