// llmpar/parallel/compose.hpp — the policy tags of a training run and Compose<Tags...>.
//
// "Policies at compile time, sizes at run time" (docs/design.md): which algorithm each part of
// a run uses is a type, how many ranks each dimension gets comes from the launch (Grid).
// A trainer names its policies once:
//
//   using Policy = Compose<backend::Cpu, precision::BF16Mixed,
//                          parallel::Pipeline<schedule::OneFOneB>,
//                          parallel::Data<zero::Stage<1>>>;
//   Policy::precision, Policy::kZeroStage, Policy::kPipelineChunks, ...
//
// There are five kinds of policy, each with a default when none is given:
//   backend    backend::Cpu | backend::Cuda                                 (Cpu)
//   precision  precision::FP32 | BF16Mixed | FP16Mixed<DynamicLossScale>    (FP32)
//   pipeline   parallel::NoPipeline |
//              parallel::Pipeline<schedule::GPipe | OneFOneB | Interleaved1F1B<chunks> |
//                                 ZeroBubbleH1 | Configured>                (NoPipeline)
//   data       parallel::Data<zero::Stage<0..3>>                            (Stage<0>)
//   recompute  recompute::None | Full | Selective | Configured              (None)
// A degree of 1 at run time switches a dimension off (tp = 1 splits nothing, dp = 1
// replicates nothing), so the defaults cost nothing. The degrees, sequence parallelism
// and the rest of what only reorders or sizes work are the run's layout, a value
// (parallel::LayoutConfig, parallel/layout.hpp): a policy is a type only where it selects
// code.
//
// A policy that is accepted does what it says (docs/design.md); every tag here is built. A
// tag whose algorithm is not built yet would be rejected with a sentence saying so,
// never trained as something else.
//
// The pipeline schedule and the recomputation change only the order of calls, not any
// type, so besides the fixed tags each has a Configured tag: the choice is the run's
// (train::TrainerConfig; train_gpt --schedule, --virtual-stages, --recompute), which
// saves a program that offers every choice one instantiation per combination. A fixed
// tag and a configuration that names something else are an error at construction.
//
// How it is built, and why:
//  - Tags are empty structs carrying their Kind (a type in policy_kind::) and their name
//    as written. The backend tags are only declared in backend/backend.hpp (a .cpp file
//    gets Cpu, a .cu file Cuda), so PolicyTraits classifies them by specialisation and
//    Compose never needs them complete.
//  - Compose is an alias for one canonical type, PolicySet<Backend, Precision,
//    Pipeline, Data, Recompute>: tags in any order, defaults filled, and two spellings of
//    the same choice are the same type (Compose<A, B> is Compose<B, A>), so a trainer
//    instantiated for either is instantiated once. Naming the alias checks the tags.
//  - Mistakes fail at compile time with a sentence (Kokkos' trait matching and CuTe's
//    dependent-false habit): a static_assert inside a small template specialised on the
//    offending tag(s), so the compiler's "in instantiation of" note beside the sentence
//    names them. C++20 static_assert messages must be literals, hence one template per
//    message rather than the tag's name spliced into the text.
//  - Combinations are rejected only where they cannot work; see detail::CheckCombination.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/nn/recompute.hpp"
#include "llmpar/precision/policy.hpp"

// The kinds of policy: every tag's Kind is one of these.
namespace llmpar::policy_kind {
struct Backend {};
struct Precision {};
struct Pipeline {};
struct Data {};
struct Recompute {};
}  // namespace llmpar::policy_kind

namespace llmpar::parallel::detail {

template <class T>
inline constexpr bool kDependentFalse = false;

// A tag's name, built at compile time (Interleaved1F1B<4> spells its 4).
struct TagName {
  char chars[256] = {};
  std::size_t size = 0;
};
constexpr void append(TagName& name, std::string_view text) {
  for (const char c : text) {
    if (name.size + 1 >= sizeof(name.chars)) throw "llmpar: a policy name is longer than detail::TagName holds";
    name.chars[name.size++] = c;
  }
}
constexpr void append(TagName& name, int value) {
  if (value < 0) append(name, "-");
  unsigned magnitude = value < 0 ? 0u - static_cast<unsigned>(value) : static_cast<unsigned>(value);
  char digits[16] = {};
  int count = 0;
  do {
    digits[count++] = static_cast<char>('0' + magnitude % 10);
    magnitude /= 10;
  } while (magnitude != 0);
  while (count > 0) append(name, std::string_view(&digits[--count], 1));
}
template <class... Parts>
constexpr TagName tag_name(Parts... parts) {
  TagName name;
  (append(name, parts), ...);
  return name;
}

template <class K>
inline constexpr bool kIsPolicyKind =
    std::is_same_v<K, policy_kind::Backend> || std::is_same_v<K, policy_kind::Precision> ||
    std::is_same_v<K, policy_kind::Pipeline> || std::is_same_v<K, policy_kind::Data> ||
    std::is_same_v<K, policy_kind::Recompute>;

}  // namespace llmpar::parallel::detail

// Pipeline schedules (the executor lives in pipeline/). kChunks is the number of model
// chunks (virtual stages) each pipeline rank holds.
namespace llmpar::schedule {

// All forwards of a step, then all backwards (GPipe): simplest, most activation memory.
// kFlag is the schedule's name in pipeline::make_schedule and train_gpt --schedule.
struct GPipe {
  static constexpr bool kIsPipelineSchedule = true;
  static constexpr const char* kName = "schedule::GPipe";
  static constexpr const char* kFlag = "gpipe";
  static constexpr int kChunks = 1;
};

// One forward, one backward in the steady state (PipeDream-Flush / Megatron's default):
// GPipe's bubble with at most pp micro-batches of activations in flight.
struct OneFOneB {
  static constexpr bool kIsPipelineSchedule = true;
  static constexpr const char* kName = "schedule::OneFOneB";
  static constexpr const char* kFlag = "1f1b";
  static constexpr int kChunks = 1;
};

// 1F1B over Chunks model chunks per rank (Megatron's virtual pipeline): the bubble
// shrinks by Chunks at the price of Chunks times the pipeline messages.
template <int Chunks>
struct Interleaved1F1B {
  static_assert(Chunks >= 2,
                "llmpar: schedule::Interleaved1F1B<Chunks> needs Chunks >= 2 model chunks per pipeline rank; "
                "with one chunk it is schedule::OneFOneB");
  static constexpr bool kIsPipelineSchedule = true;
  static constexpr parallel::detail::TagName kNameStorage =
      parallel::detail::tag_name("schedule::Interleaved1F1B<", Chunks, ">");
  static constexpr const char* kName = kNameStorage.chars;
  static constexpr const char* kFlag = "interleaved";
  static constexpr int kChunks = Chunks;
};

// Zero bubble, ZB-H1 (Qi et al. 2023): backward split into the input gradient and the
// weight gradient, the weight gradients deferred into the bubble; 1F1B's memory.
struct ZeroBubbleH1 {
  static constexpr bool kIsPipelineSchedule = true;
  static constexpr const char* kName = "schedule::ZeroBubbleH1";
  static constexpr const char* kFlag = "zb";
  static constexpr int kChunks = 1;
};

// The schedule and its chunks per rank come from the run's configuration
// (train::TrainerConfig::schedule, ::virtual_stages). kChunks 0: not known at compile time.
struct Configured {
  static constexpr bool kIsPipelineSchedule = true;
  static constexpr const char* kName = "schedule::Configured";
  static constexpr const char* kFlag = "";
  static constexpr int kChunks = 0;
};

template <class S>
concept PipelineSchedule = requires {
  requires S::kIsPipelineSchedule;
  { S::kName } -> std::convertible_to<const char*>;
  { S::kFlag } -> std::convertible_to<const char*>;
  { S::kChunks } -> std::convertible_to<int>;
};

}  // namespace llmpar::schedule

// ZeRO stages: what data-parallel ranks shard instead of replicating.
namespace llmpar::zero {

template <int N>
struct Stage {
  static_assert(N >= 0 && N <= 3,
                "llmpar: zero::Stage<N> takes N = 0 (nothing sharded), 1 (optimizer state), 2 (optimizer state and "
                "gradients) or 3 (optimizer state, gradients and parameters)");
  static constexpr int kStage = N;
  static constexpr parallel::detail::TagName kNameStorage = parallel::detail::tag_name("zero::Stage<", N, ">");
  static constexpr const char* kName = kNameStorage.chars;
};

}  // namespace llmpar::zero

// Activation recomputation: what a layer keeps for backward and what it recomputes.
namespace llmpar::recompute {

// Keep every activation backward needs.
struct None {
  using Kind = policy_kind::Recompute;
  static constexpr const char* kName = "recompute::None";
  static constexpr Mode kMode = Mode::none;
};
// Keep only each block's input; rerun the block's forward just before its backward.
struct Full {
  using Kind = policy_kind::Recompute;
  static constexpr const char* kName = "recompute::Full";
  static constexpr Mode kMode = Mode::full;
};
// Recompute only the attention core (Korthikanti et al. 2022, Megatron's selective
// recomputation): its outputs are dropped in forward and rebuilt in backward from the
// kept q, k, v; the GEMM outputs are kept.
struct Selective {
  using Kind = policy_kind::Recompute;
  static constexpr const char* kName = "recompute::Selective";
  static constexpr Mode kMode = Mode::selective;
};
// The run's configuration says (train::TrainerConfig::recompute).
struct Configured {
  using Kind = policy_kind::Recompute;
  static constexpr const char* kName = "recompute::Configured";
  static constexpr bool kConfigured = true;
};

}  // namespace llmpar::recompute

namespace llmpar::parallel {

// Pipeline parallelism over the Grid's pp ranks, with the given schedule.
template <class ScheduleTag>
struct Pipeline {
  static_assert(schedule::PipelineSchedule<ScheduleTag>,
                "llmpar: parallel::Pipeline<Schedule> takes a schedule tag: schedule::GPipe, schedule::OneFOneB, "
                "schedule::Interleaved1F1B<chunks>, schedule::ZeroBubbleH1 or schedule::Configured");
  using Kind = policy_kind::Pipeline;
  using Schedule = ScheduleTag;
  static constexpr int kChunks = [] {
    if constexpr (schedule::PipelineSchedule<ScheduleTag>) return ScheduleTag::kChunks;
    return 1;
  }();
  static constexpr detail::TagName kNameStorage = [] {
    if constexpr (schedule::PipelineSchedule<ScheduleTag>)
      return detail::tag_name("parallel::Pipeline<", ScheduleTag::kName, ">");
    return detail::tag_name("parallel::Pipeline<?>");
  }();
  static constexpr const char* kName = kNameStorage.chars;
};

// No pipeline: the whole model on every rank of the Grid's pp dimension, which must be 1.
struct NoPipeline {
  using Kind = policy_kind::Pipeline;
  static constexpr int kChunks = 1;
  static constexpr const char* kName = "parallel::NoPipeline";
};

// Data parallelism over the Grid's dp ranks, with a ZeRO stage.
template <class ZeroStage>
struct Data {
  static_assert(detail::kDependentFalse<ZeroStage>,
                "llmpar: parallel::Data<Z> takes a ZeRO stage: parallel::Data<zero::Stage<N>> with N from 0 to 3");
  using Kind = policy_kind::Data;
  static constexpr const char* kName = "parallel::Data<?>";
  static constexpr int kZeroStage = 0;
};
template <int N>
struct Data<zero::Stage<N>> {
  static_assert(sizeof(zero::Stage<N>) > 0);  // completes the stage, which checks N itself
  using Kind = policy_kind::Data;
  using Zero = zero::Stage<N>;
  static constexpr int kZeroStage = Zero::kStage;
  static constexpr detail::TagName kNameStorage = detail::tag_name("parallel::Data<", Zero::kName, ">");
  static constexpr const char* kName = kNameStorage.chars;
};

// What Compose knows about a type: whether it is a policy tag, its kind and its name.
// A tag says so itself (a Kind from policy_kind:: and a kName); the backend tags, which
// are only declared here, are classified by the specialisations below.
template <class Tag>
struct PolicyTraits {
  static constexpr bool kIsPolicy = false;
};
template <class Tag>
requires requires {
  typename Tag::Kind;
  requires detail::kIsPolicyKind<typename Tag::Kind>;
  { Tag::kName } -> std::convertible_to<const char*>;
}
struct PolicyTraits<Tag> {
  static constexpr bool kIsPolicy = true;
  using Kind = typename Tag::Kind;
  static constexpr const char* kName = Tag::kName;
};
// The tag templates that reject some arguments (FP16Mixed<void>, Pipeline<int>,
// Data<int>) are classified by template as well: a compiler that marks a rejected
// specialisation invalid (clang) would otherwise also report it as "not a policy tag".
template <class Scaler>
struct PolicyTraits<precision::FP16Mixed<Scaler>> {
  static constexpr bool kIsPolicy = true;
  using Kind = policy_kind::Precision;
  static constexpr const char* kName = precision::FP16Mixed<Scaler>::kName;
};
template <class ScheduleTag>
struct PolicyTraits<Pipeline<ScheduleTag>> {
  static constexpr bool kIsPolicy = true;
  using Kind = policy_kind::Pipeline;
  static constexpr const char* kName = Pipeline<ScheduleTag>::kName;
};
template <class ZeroStage>
struct PolicyTraits<Data<ZeroStage>> {
  static constexpr bool kIsPolicy = true;
  using Kind = policy_kind::Data;
  static constexpr const char* kName = Data<ZeroStage>::kName;
};
template <>
struct PolicyTraits<backend::Cpu> {
  static constexpr bool kIsPolicy = true;
  using Kind = policy_kind::Backend;
  static constexpr const char* kName = "backend::Cpu";
};
template <>
struct PolicyTraits<backend::Cuda> {
  static constexpr bool kIsPolicy = true;
  using Kind = policy_kind::Backend;
  static constexpr const char* kName = "backend::Cuda";
};

template <class Tag>
concept PolicyTag = PolicyTraits<Tag>::kIsPolicy;

namespace detail {

template <class Tag, class Kind>
consteval bool is_of_kind() {
  if constexpr (PolicyTraits<Tag>::kIsPolicy)
    return std::is_same_v<typename PolicyTraits<Tag>::Kind, Kind>;
  else
    return false;
}

template <class Kind, class... Tags>
inline constexpr int kCountOfKind = (0 + ... + static_cast<int>(is_of_kind<Tags, Kind>()));

// The (Skip+1)-th tag of Kind among Tags, or Default when there is none.
template <class Kind, int Skip, class Default, class... Tags>
struct FindOfKind {
  using type = Default;
};
template <class Kind, int Skip, class Default, class Tag, class... Rest>
struct FindOfKind<Kind, Skip, Default, Tag, Rest...> {
  using type = typename std::conditional_t<
      is_of_kind<Tag, Kind>(),
      std::conditional_t<Skip == 0, std::type_identity<Tag>, FindOfKind<Kind, Skip - 1, Default, Rest...>>,
      FindOfKind<Kind, Skip, Default, Rest...>>::type;
};

// ---- The errors. Each is instantiated only when its mistake is present; the compiler
// prints the instantiation (and with it the offending tags) next to the sentence.

template <class NotATag>
struct NotAPolicyTag {
  static_assert(kDependentFalse<NotATag>,
                "llmpar::Compose: a template argument is not a policy tag (the type is the argument of "
                "detail::NotAPolicyTag<...> in the instantiation shown with this error); Compose takes backend::, "
                "precision::, parallel::Pipeline<...>, parallel::Data<...> and recompute:: tags (tensor and "
                "sequence parallelism are the run's layout: parallel::LayoutConfig::tp, ::sp)");
  static constexpr bool kOk = true;
};

template <class Kind, class First, class Second>
struct TwoPoliciesOfOneKind;
template <class First, class Second>
struct TwoPoliciesOfOneKind<policy_kind::Backend, First, Second> {
  static_assert(kDependentFalse<First>,
                "llmpar::Compose: two backend policies were given; keep one (both tags are named in the "
                "detail::TwoPoliciesOfOneKind<...> instantiation shown with this error)");
  static constexpr bool kOk = true;
};
template <class First, class Second>
struct TwoPoliciesOfOneKind<policy_kind::Precision, First, Second> {
  static_assert(kDependentFalse<First>,
                "llmpar::Compose: two precision policies were given; keep one (both tags are named in the "
                "detail::TwoPoliciesOfOneKind<...> instantiation shown with this error)");
  static constexpr bool kOk = true;
};
template <class First, class Second>
struct TwoPoliciesOfOneKind<policy_kind::Pipeline, First, Second> {
  static_assert(kDependentFalse<First>,
                "llmpar::Compose: two pipeline policies (parallel::Pipeline<...>) were given; keep one (both tags "
                "are named in the detail::TwoPoliciesOfOneKind<...> instantiation shown with this error)");
  static constexpr bool kOk = true;
};
template <class First, class Second>
struct TwoPoliciesOfOneKind<policy_kind::Data, First, Second> {
  static_assert(kDependentFalse<First>,
                "llmpar::Compose: two data-parallel policies (parallel::Data<...>) were given; keep one (both tags "
                "are named in the detail::TwoPoliciesOfOneKind<...> instantiation shown with this error)");
  static constexpr bool kOk = true;
};
template <class First, class Second>
struct TwoPoliciesOfOneKind<policy_kind::Recompute, First, Second> {
  static_assert(kDependentFalse<First>,
                "llmpar::Compose: two recompute policies were given; keep one (both tags are named in the "
                "detail::TwoPoliciesOfOneKind<...> instantiation shown with this error)");
  static constexpr bool kOk = true;
};

// ---- The checks: classes whose kOk is true, or which derive from the error above that
// applies. A mistake fails inside its error class with its sentence, so the caller's own
// static_assert never adds a second, wordless error.

struct Passed {
  static constexpr bool kOk = true;
};

template <class Tag>
struct CheckIsPolicy : std::conditional_t<PolicyTraits<Tag>::kIsPolicy, Passed, NotAPolicyTag<Tag>> {};

template <class Kind, class... Tags>
struct CheckAtMostOne : std::conditional_t<(kCountOfKind<Kind, Tags...> > 1),
                                           TwoPoliciesOfOneKind<Kind, typename FindOfKind<Kind, 0, void, Tags...>::type,
                                                                typename FindOfKind<Kind, 1, void, Tags...>::type>,
                                           Passed> {};

// The combinations that cannot work. Kept short on purpose: everything Megatron or
// DeepSpeed runs together is allowed (ZeRO with any pipeline schedule including the
// interleaved one, selective or full recompute with or without sequence parallelism,
// any precision on either backend: fp16 on the CPU stores f16 and computes in f32, which
// is slow but exact to the format, and is how the loss scaler is tested without a GPU).
// Beyond what each tag checks itself (FP16Mixed without a loss scaler,
// Interleaved1F1B<1>, zero::Stage<4>), one combination is rejected: a pipeline with ZeRO
// stage 2 or 3, which reduce (and gather) every micro-batch's gradients per unit while a
// pipeline interleaves the micro-batches (neither DeepSpeed nor Megatron-LM runs them
// together; stage 1, Megatron's distributed optimizer, works with every schedule).
template <class Backend, class Precision>
struct CheckCombination : Passed {};

template <class PipelinePolicy, class DataPolicy>
struct CheckPipelineData : Passed {};
template <class ScheduleTag, class DataPolicy>
requires(DataPolicy::kZeroStage >= 2) struct CheckPipelineData<Pipeline<ScheduleTag>, DataPolicy> {
  static_assert(kDependentFalse<ScheduleTag>,
                "llmpar::Compose: parallel::Pipeline<...> with zero::Stage<2> or <3>: those stages reduce and gather "
                "each micro-batch's gradients per unit, which a pipeline interleaves; use parallel::Data<"
                "zero::Stage<1>> (the optimizer state sharded, as Megatron-LM's distributed optimizer) with a "
                "pipeline");
  static constexpr bool kOk = true;
};

}  // namespace detail

// One policy of each kind, in a fixed order: what Compose<Tags...> names. Build it with
// Compose (any order, defaults filled); written by hand, its slots are checked too.
template <class Backend, class Precision, class PipelinePolicy, class DataPolicy, class RecomputePolicy>
struct PolicySet {
  static_assert(detail::is_of_kind<Backend, policy_kind::Backend>(),
                "llmpar::parallel::PolicySet: the 1st argument must be a backend tag (backend::Cpu or "
                "backend::Cuda); llmpar::Compose<...> takes the tags in any order");
  static_assert(detail::is_of_kind<Precision, policy_kind::Precision>(),
                "llmpar::parallel::PolicySet: the 2nd argument must be a precision tag (precision::FP32, "
                "precision::BF16Mixed or precision::FP16Mixed<...>); llmpar::Compose<...> takes the tags in any order");
  static_assert(detail::is_of_kind<PipelinePolicy, policy_kind::Pipeline>(),
                "llmpar::parallel::PolicySet: the 3rd argument must be parallel::Pipeline<...>; llmpar::Compose<...> "
                "takes the tags in any order");
  static_assert(detail::is_of_kind<DataPolicy, policy_kind::Data>(),
                "llmpar::parallel::PolicySet: the 4th argument must be parallel::Data<...>; llmpar::Compose<...> "
                "takes the tags in any order");
  static_assert(detail::is_of_kind<RecomputePolicy, policy_kind::Recompute>(),
                "llmpar::parallel::PolicySet: the 5th argument must be a recompute tag (recompute::None, "
                "recompute::Full or recompute::Selective); llmpar::Compose<...> takes the tags in any order");
  static_assert(detail::CheckCombination<Backend, Precision>::kOk &&
                detail::CheckPipelineData<PipelinePolicy, DataPolicy>::kOk);

  using backend = Backend;
  using precision = Precision;
  using pipeline = PipelinePolicy;
  using data = DataPolicy;
  using recompute = RecomputePolicy;

  static constexpr bool kOnCuda = std::is_same_v<Backend, ::llmpar::backend::Cuda>;
  static constexpr int kPipelineChunks = PipelinePolicy::kChunks;  // model chunks per pipeline rank (0: configured)
  static constexpr int kZeroStage = DataPolicy::kZeroStage;
  static constexpr bool kHasLossScale = Precision::kHasLossScale;
  static constexpr bool kMixedPrecision = !std::is_same_v<typename Precision::Compute, float>;

  // "Compose<backend::Cpu, precision::FP32, ...>", every slot spelled out: for logs.
  static constexpr detail::TagName kNameStorage =
      detail::tag_name("Compose<", PolicyTraits<Backend>::kName, ", ", PolicyTraits<Precision>::kName, ", ",
                       PolicyTraits<PipelinePolicy>::kName, ", ", PolicyTraits<DataPolicy>::kName, ", ",
                       PolicyTraits<RecomputePolicy>::kName, ">");
  static constexpr const char* kName = kNameStorage.chars;
};

namespace detail {

template <class... Tags>
struct Composed {
  static_assert((CheckIsPolicy<Tags>::kOk && ... && true) && CheckAtMostOne<policy_kind::Backend, Tags...>::kOk &&
                CheckAtMostOne<policy_kind::Precision, Tags...>::kOk &&
                CheckAtMostOne<policy_kind::Pipeline, Tags...>::kOk &&
                CheckAtMostOne<policy_kind::Data, Tags...>::kOk &&
                CheckAtMostOne<policy_kind::Recompute, Tags...>::kOk);
  using type = PolicySet<typename FindOfKind<policy_kind::Backend, 0, backend::Cpu, Tags...>::type,
                         typename FindOfKind<policy_kind::Precision, 0, precision::FP32, Tags...>::type,
                         typename FindOfKind<policy_kind::Pipeline, 0, NoPipeline, Tags...>::type,
                         typename FindOfKind<policy_kind::Data, 0, Data<zero::Stage<0>>, Tags...>::type,
                         typename FindOfKind<policy_kind::Recompute, 0, recompute::None, Tags...>::type>;
  static_assert(sizeof(type) > 0);  // completes the set, which runs its own checks
};

template <class P>
inline constexpr bool kIsPolicySet = false;
template <class... Slots>
inline constexpr bool kIsPolicySet<PolicySet<Slots...>> = true;

}  // namespace detail

// The policies of a run, from tags in any order; kinds not given take their defaults.
template <class... Tags>
using Compose = typename detail::Composed<Tags...>::type;

// What a trainer or model takes as its policy parameter: a Compose<...>.
template <class P>
concept ComposedPolicy = detail::kIsPolicySet<P>;

}  // namespace llmpar::parallel

namespace llmpar {
using parallel::Compose;
using parallel::ComposedPolicy;
}  // namespace llmpar
