// llmpar/comm/init.hpp — llmpar::init: the launch decides the engine, not the trainer.
//
//   int main(int argc, char** argv) {
//     auto launch = llmpar::init(argc, argv);      // consumes --ranks and --comm-* flags
//     launch.run([&](llmpar::comm::Comm& world) {  // once per rank
//       llmpar::comm::Grid grid(world, {.tp = 2});
//       ...
//     });
//   }
//
// * `--ranks N` (or nothing, for one rank): N ranks as threads of this process.
// * Started by mpirun/srun (their environment variables say so): one rank per process
//   over MPI; `run` calls the body once.
// * With the CUDA backend (InitOptions::device = Device::cuda), NCCL carries the
//   collectives on device buffers, one process per GPU, bootstrapped over MPI (a
//   process started without mpirun is a world of one). A build without NCCL runs the
//   CUDA backend on one GPU, a world of one rank that needs no MPI.
//
// Thread ranks cannot share the rest of main() the way processes do, which is why the
// per-rank part of a trainer is a body passed to run(): the same code then runs on
// every engine. A rank that throws aborts the world (other ranks' operations fail with
// its message) and run() rethrows the first rank's exception.
//
// comm::Comm is the engine chosen at run time behind the one Communicator interface
// (a std::variant, so dispatch is a switch, not a virtual call, and each engine keeps
// its own fast path).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/error.hpp"

#if defined(LLMPAR_WITH_MPI)
#include "llmpar/comm/mpi_comm.hpp"
#endif
#if defined(LLMPAR_WITH_NCCL)
#include "llmpar/comm/nccl_comm.hpp"
#endif

namespace llmpar {

namespace comm {

// The communicator an engine chosen at run time provides.
class Comm : public Collectives<Comm> {
 public:
#if defined(LLMPAR_WITH_NCCL)
  using Impl = std::variant<ThreadComm, MpiComm, NcclComm>;
#elif defined(LLMPAR_WITH_MPI)
  using Impl = std::variant<ThreadComm, MpiComm>;
#else
  using Impl = std::variant<ThreadComm>;
#endif

  class Request {
   public:
#if defined(LLMPAR_WITH_NCCL)
    using Impl = std::variant<ThreadComm::Request, MpiComm::Request, NcclComm::Request>;
#elif defined(LLMPAR_WITH_MPI)
    using Impl = std::variant<ThreadComm::Request, MpiComm::Request>;
#else
    using Impl = std::variant<ThreadComm::Request>;
#endif
    Request() = default;
    explicit Request(Impl impl) : impl_(std::move(impl)) {}
    void wait() {
      std::visit([](auto& r) { r.wait(); }, impl_);
    }
    bool test() {
      return std::visit([](auto& r) { return r.test(); }, impl_);
    }

   private:
    Impl impl_;
  };

  template <class Engine>
  requires(!std::is_same_v<std::remove_cvref_t<Engine>, Comm>) explicit Comm(Engine&& engine)
      : impl_(std::forward<Engine>(engine)) {}

  int rank() const {
    return std::visit([](const auto& c) { return c.rank(); }, impl_);
  }
  int size() const {
    return std::visit([](const auto& c) { return c.size(); }, impl_);
  }
  const GroupInfo& group() const {
    return std::visit([](const auto& c) -> const GroupInfo& { return c.group(); }, impl_);
  }
  void run(const Op& op) {
    std::visit([&](auto& c) { c.run(op); }, impl_);
  }
  Request start(const Op& op) {
    return std::visit([&](auto& c) { return Request(Request::Impl(c.start(op))); }, impl_);
  }
  Request start_batch(std::span<const Op> ops) {
    return std::visit([&](auto& c) { return Request(Request::Impl(c.start_batch(ops))); }, impl_);
  }
  Comm split(int color, int key, std::string name) {
    return std::visit([&](auto& c) { return Comm(c.split(color, key, std::move(name))); }, impl_);
  }

  // The engine underneath, for code that needs its native handle.
  template <class Engine>
  Engine* get() {
    return std::get_if<Engine>(&impl_);
  }
  std::string_view engine_name() const {
    constexpr std::string_view kNames[] = {"thread", "mpi", "nccl"};
    return kNames[impl_.index()];
  }

 private:
  Impl impl_;
};

static_assert(Communicator<Comm>);

}  // namespace comm

enum class Engine { thread, mpi, nccl };
enum class Device { cpu, cuda };

constexpr std::string_view name_of(Engine e) {
  return e == Engine::thread ? "thread" : e == Engine::mpi ? "mpi" : "nccl";
}

struct InitOptions {
  Device device = Device::cpu;
  // Defaults for the flags below.
  int ranks = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  bool verify = false;
};

// What init() found: the engine and the world size, and the way to run the ranks.
class Launch {
 public:
  Engine engine() const { return engine_; }
  int world_size() const { return world_size_; }
  const InitOptions& options() const { return options_; }

  // Runs body(comm::Comm& world) on every rank of this process (N threads, or this
  // process's one MPI rank) and returns when they have all finished.
  template <class Body>
  void run(Body&& body) {
    if (engine_ == Engine::thread) {
      comm::ThreadOptions thread_options;
      thread_options.timeout = options_.timeout;
      comm::run_threads(
          world_size_,
          [&](comm::ThreadComm& world) {
            comm::Comm any(std::move(world));
            body(any);
          },
          thread_options);
      return;
    }
#if defined(LLMPAR_WITH_NCCL)
    if (engine_ == Engine::nccl) {
      comm::NcclOptions nccl_options;
      nccl_options.timeout = options_.timeout;
      nccl_options.verify = options_.verify;
      comm::Comm any(comm::NcclComm(MPI_COMM_WORLD, comm::NcclComm::local_device(MPI_COMM_WORLD), nccl_options));
      body(any);
      return;
    }
#endif
#if defined(LLMPAR_WITH_MPI)
    comm::MpiOptions mpi_options;
    mpi_options.timeout = options_.timeout;
    mpi_options.verify = options_.verify;
    comm::Comm any(comm::MpiComm::world(mpi_options));
    body(any);
#endif
  }

 private:
  friend Launch init(int& argc, char** argv, InitOptions options);
  Engine engine_ = Engine::thread;
  int world_size_ = 1;
  InitOptions options_;
#if defined(LLMPAR_WITH_MPI)
  std::shared_ptr<comm::MpiEnvironment> mpi_;
#endif
};

namespace detail {

// Removes the n arguments starting at argv[i] from the command line.
inline void erase_args(int& argc, char** argv, int i, int n) {
  for (int j = i; j + n <= argc; ++j) argv[j] = argv[j + n];
  argc -= n;
}

// Finds "--name value" or "--name=value"; removes it; returns the value.
inline std::optional<std::string> take_flag(int& argc, char** argv, std::string_view name, bool with_value) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == name) {
      if (!with_value) {
        erase_args(argc, argv, i, 1);
        return std::string("1");
      }
      LLMPAR_CHECK(i + 1 < argc, name, " needs a value, e.g. ", name, name == "--ranks" ? " 4" : " 60");
      std::string value = argv[i + 1];
      erase_args(argc, argv, i, 2);
      return value;
    }
    if (with_value && arg.size() > name.size() && arg.substr(0, name.size()) == name && arg[name.size()] == '=') {
      std::string value(arg.substr(name.size() + 1));
      erase_args(argc, argv, i, 1);
      return value;
    }
  }
  return std::nullopt;
}

// The number of processes an MPI launcher started, from the variables it sets (Open
// MPI, hydra/PMI, MVAPICH, Slurm with an MPI plugin); 1 when none is set. Needs no MPI.
inline long launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return std::max(1L, std::strtol(value, nullptr, 10));
  }
  const char* mpi_type = std::getenv("SLURM_MPI_TYPE");
  const char* tasks = std::getenv("SLURM_NTASKS");
  if (mpi_type != nullptr && std::string_view(mpi_type) != "none" && tasks != nullptr && *tasks != '\0')
    return std::max(1L, std::strtol(tasks, nullptr, 10));
  return 1;
}

inline long parse_positive(std::string_view flag, const std::string& value) {
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  LLMPAR_CHECK(!value.empty() && end && *end == '\0' && v >= 1, flag, " ", value,
               " is not a positive whole number; e.g. ", flag, flag == "--ranks" ? " 4" : " 60");
  return v;
}

}  // namespace detail

// Reads the launch: `--ranks N` (thread ranks), `--comm-timeout SECONDS` (how long a
// rank waits for the others before naming the missing ones), `--comm-verify` (check
// that every rank issues the same collective; always on for thread ranks), and the
// MPI launcher's environment. Removes the flags it read from argc/argv, so the
// trainer's own parser sees the rest.
inline Launch init(int& argc, char** argv, InitOptions options = {}) {
  Launch launch;
  const auto ranks = detail::take_flag(argc, argv, "--ranks", true);
  const auto timeout = detail::take_flag(argc, argv, "--comm-timeout", true);
  const auto verify = detail::take_flag(argc, argv, "--comm-verify", false);
  if (ranks) options.ranks = static_cast<int>(detail::parse_positive("--ranks", *ranks));
  if (timeout) options.timeout = std::chrono::seconds(detail::parse_positive("--comm-timeout", *timeout));
  if (verify) options.verify = true;
  LLMPAR_CHECK(options.ranks >= 1, "ranks = ", options.ranks, " is not a number of ranks; use 1 or more");

  const bool cuda = options.device == Device::cuda;
  LLMPAR_CHECK(!cuda || options.ranks == 1, "--ranks ", options.ranks,
               " asks for thread ranks, but the CUDA backend runs one process per GPU: start it with mpirun -np ",
               options.ranks, " ... and without --ranks");
#if defined(LLMPAR_WITH_NCCL)
  const bool over_mpi = comm::launched_by_mpi() || cuda;
#else
  // Without NCCL the CUDA backend has no collectives on device memory: it trains on one
  // GPU, as a world of one rank (no MPI needed).
  LLMPAR_CHECK(!cuda || detail::launcher_world_size() <= 1,
               "the CUDA backend communicates through NCCL and this build has none, so it trains on one GPU; ",
               "build with NCCL and MPI (LLMPAR_NCCL=ON) to run it under mpirun -np ", detail::launcher_world_size());
#if defined(LLMPAR_WITH_MPI)
  const bool over_mpi = comm::launched_by_mpi() && !cuda;
#endif
#endif
#if defined(LLMPAR_WITH_MPI)
  if (over_mpi) {
    launch.mpi_ = std::make_shared<comm::MpiEnvironment>(argc, argv);
    launch.engine_ = cuda ? Engine::nccl : Engine::mpi;
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    LLMPAR_CHECK(!ranks || options.ranks == 1, "--ranks ", options.ranks,
                 " asks for thread ranks, but this program was started by an MPI launcher with ", size, " process",
                 size > 1 ? "es" : "", ": start it with mpirun -np ", size * options.ranks, " ... and without --ranks");
    launch.world_size_ = size;
    launch.options_ = options;
    return launch;
  }
#endif
  launch.engine_ = Engine::thread;
  launch.world_size_ = options.ranks;
  launch.options_ = options;
  return launch;
}

}  // namespace llmpar
