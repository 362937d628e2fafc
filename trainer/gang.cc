#include "troupe/trainer/gang.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "troupe/runtime/collective/actor_group.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/trainer/failure_recovery.h"

namespace troupe::trainer {

void get_all(std::vector<Future<void>>& fs, std::chrono::milliseconds timeout, const std::function<bool()>& stop,
             const std::string& what) {
  std::exception_ptr first;
  for (auto& f : fs) {
    try {
      get_or_stop(f, timeout, stop, what);
    } catch (const StopRequested&) {
      throw;
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

Gang::Gang(const TrainJobConfig& cfg, SlotPool& pool, const actors::DistributedSampler& sampler, std::string group_name)
    : cfg_(cfg), pool_(pool), sampler_(sampler), group_name_(std::move(group_name)) {}

Gang::~Gang() { release_all(); }

void Gang::release_all() {
  for (auto& s : slots_) pool_.release(s);
  slots_.clear();
}

void Gang::drop_from(size_t keep) {
  while (slots_.size() > keep) {
    pool_.release(slots_.back());
    slots_.pop_back();
  }
}

void Gang::add(std::vector<Slot> more) {
  for (auto& s : more) slots_.push_back(std::move(s));
}

void Gang::set_position(int64_t step, const actors::SamplerCursor& cursor) {
  step_ = step;
  cursor_ = cursor;
}

void Gang::begin_epoch(int64_t epoch) { cursor_ = sampler_.begin_epoch(epoch, world()); }

void Gang::setup_new(std::chrono::milliseconds timeout) {
  std::vector<Future<TrainerInfo>> fs;
  std::vector<size_t> which;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].ready) continue;
    // A standby taken while still setting up: its setup() call, not a second.
    fs.push_back(slots_[i].setting_up ? std::move(*std::exchange(slots_[i].setting_up, std::nullopt))
                                      : slots_[i].trainer.call(&TrainerActor::setup, cfg_.trainer));
    which.push_back(i);
  }
  auto infos = get_all(fs, timeout, cfg_.stop_requested, "the trainers' setup");
  for (size_t k = 0; k < which.size(); ++k) slots_[which[k]].ready = true;
  if (!infos.empty()) info_ = infos[0];
}

void Gang::form(int64_t heal_src, std::chrono::milliseconds timeout) {
  ++generation_;
  std::vector<uint64_t> members;
  for (auto& s : slots_) members.push_back(s.trainer.id());
  std::vector<Future<void>> joins;
  for (int64_t r = 0; r < world(); ++r)
    joins.push_back(slots_[r].trainer.call(&TrainerActor::join,
                                           JoinSpec{group_name_, generation_, r, world(), members, heal_src < 0}));
  await_joins(joins, members, timeout);
  if (heal_src >= 0) {
    auto heals = call_all(&TrainerActor::heal, heal_src);
    // Every call settles; the source's own error wins (the others only
    // say that it could not send, and its error decides a retry).
    std::vector<Progress> ps;
    std::exception_ptr first, source;
    for (size_t r = 0; r < heals.size(); ++r) {
      try {
        ps.push_back(get_or_stop(heals[r], timeout, cfg_.stop_requested, "the heal"));
      } catch (const StopRequested&) {
        throw;
      } catch (...) {
        if (!first) first = std::current_exception();
        if (static_cast<int64_t>(r) == heal_src) source = std::current_exception();
      }
    }
    if (source) std::rethrow_exception(source);
    if (first) std::rethrow_exception(first);
    // At the driver's own step its cursor is the truth (it may already
    // stand at the next epoch's start, which the trainers have not seen);
    // past it, the survivors completed steps of a failed round.
    if (ps[0].step != step_) set_position(ps[0].step, ps[0].cursor);
  }
  cursor_ = sampler_.resize(cursor_, world());
  for (auto& s : slots_) s.has_state = true;
}

void Gang::await_joins(std::vector<Future<void>>& joins, const std::vector<uint64_t>& members,
                       std::chrono::milliseconds timeout) {
  std::exception_ptr first;
  std::string ranks;
  for (size_t r = 0; r < joins.size(); ++r) {
    try {
      get_or_stop(joins[r], timeout, cfg_.stop_requested, "the trainers to join their group");
    } catch (const StopRequested&) {
      throw;
    } catch (...) {
      if (!first) first = std::current_exception();
      const auto info = slots_[r].trainer.info();
      ranks += "; rank " + std::to_string(r) + " (actor " + std::to_string(info.id) + ", pid " +
               std::to_string(info.pid) + ", worker at " + info.address +
               "): " + core::exception_text(std::current_exception());
    }
  }
  if (!first) {
    failed_members_.clear();
    return;
  }
  const bool again = failed_members_ == members;
  failed_members_ = members;
  if (!again) std::rethrow_exception(first);
  // The trainers answered (their joins failed rather than died) and are the
  // ones the last try had: retrying only repeats a rendezvous that cannot
  // succeed, each time for its whole timeout.
  throw GiveUp{"collective group '" + group_name_ + "' failed to form twice in a row (generations " +
               std::to_string(generation_ - 1) + " and " + std::to_string(generation_) + ") with the same " +
               std::to_string(members.size()) + " live trainer(s), each rendezvous bounded by " +
               std::to_string(collective::GroupSpec{}.rendezvous_timeout.count()) +
               " ms; the trainers' hosts may not reach each other (a firewall, a route, or an address "
               "they advertise that is not reachable between them)" +
               ranks};
}

void Gang::load_everywhere(const TrainState& state, std::chrono::milliseconds timeout) {
  for (auto& s : slots_) s.has_state = false;  // until every load has ended
  auto loads = call_all(&TrainerActor::load_state, state);
  get_all(loads, timeout, cfg_.stop_requested, "the trainers to load the state");
  for (auto& s : slots_) s.has_state = true;
  step_ = state.step;
  cursor_ = sampler_.resize(state.cursor, world());
  if (sampler_.epoch_done(cursor_)) cursor_ = sampler_.begin_epoch(cursor_.epoch + 1, world());
}

TrainState Gang::state(std::chrono::milliseconds timeout) {
  auto state = slots_[0].trainer.call(&TrainerActor::state).get(timeout);
  state.world_size = world();
  state.cursor = cursor_;
  return state;
}

namespace {

// "rank 1 (actor 7, pid 4242): ", or "the loader of rank 1 (...): ", for
// the call of `calls` that failed with `e` (the first `loaders` are the
// loaders' feeds, the rest the trainers' calls, rank by rank); "" when
// none did. An actor's death says its actor and pid, not its rank.
std::string who_failed(const std::exception_ptr& e, const std::vector<std::shared_ptr<core::FutureStateBase>>& calls,
                       size_t loaders, const std::vector<Slot>& slots) {
  for (size_t i = 0; i < calls.size(); ++i) {
    if (!calls[i]->ready() || calls[i]->error() != e) continue;
    const size_t r = i < loaders ? i : i - loaders;
    if (r >= slots.size()) return "";
    const auto info = i < loaders ? slots[r].loader.info() : slots[r].trainer.info();
    // A dead actor's info has no pid any more: its cause names the one it had.
    return std::string(i < loaders ? "the loader of rank " : "rank ") + std::to_string(r) + " (actor " +
           std::to_string(info.id) + (info.pid ? ", pid " + std::to_string(info.pid) : std::string()) + "): ";
  }
  return "";
}

}  // namespace

std::vector<Future<int64_t>> Gang::start_feeds(int64_t batches, std::chrono::milliseconds timeout,
                                               std::vector<StatePtr>& round) {
  // A fresh stream per call: the loader closes it after `batches` batches
  // (fewer at the epoch's end).
  auto refs = call_all(&TrainerActor::open_stream, int64_t{4});
  if (auto e = wait_all_or_first_failure(refs, timeout)) {
    for (auto& f : refs) inflight_.push_back(f.state());
    throw StepFailed("opening the batch streams: " + who_failed(e, inflight_, 0, slots_) + core::exception_text(e));
  }
  std::vector<Future<int64_t>> feeds;
  for (int64_t r = 0; r < world(); ++r) {
    feeds.push_back(slots_[r].loader.call(&actors::DataLoaderActor::feed, refs[r].get(), cursor_,
                                          static_cast<int32_t>(r), batches));
    round.push_back(feeds.back().state());
  }
  return feeds;
}

namespace {

// After a round ran past its timeout: the trainers that had not answered
// (a stalled process, say), named so that an operator can find it.
std::string silent_trainers(const std::exception_ptr& e, const std::vector<Future<TrainReport>>& fs,
                            const std::vector<Slot>& slots) {
  try {
    std::rethrow_exception(e);
  } catch (const Timeout&) {
  } catch (...) {
    return "";  // a failure of its own names itself
  }
  std::string names;
  for (size_t r = 0; r < fs.size() && r < slots.size(); ++r) {
    if (fs[r].ready()) continue;
    const auto info = slots[r].trainer.info();
    names += (names.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " (actor " +
             std::to_string(info.id) + ", pid " + std::to_string(info.pid) + ")";
  }
  return names.empty() ? "" : " from " + names;
}

template <class E>
bool is_a(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
  }
  return false;
}

// The failure behind the others, among the round's calls that have
// ended: a rank whose step (or whose loader's data set) raised aborts its
// peers, and their errors can reach the driver first. A ConfigError that
// is there already wins; one that comes later is found once the round has
// settled (FailureRecovery::stop_round).
//
// When the first error is a trainer's collective aborted under it, or a
// loader's stream broken (not its own death), the trainer behind it
// (whose step raised, whose process died) is the cause to name, and the
// driver hears of it a moment later: the trainers' calls are waited for
// briefly, and the first of them that failed with the user's error, else
// with its death, else with an error of its own (not an abort), is
// named. A peer that never answers (stopped) costs this wait.
std::exception_ptr root_cause(const std::vector<std::shared_ptr<core::FutureStateBase>>& round,
                              std::exception_ptr first, size_t loaders) {
  if (is_a<ConfigError>(first)) return first;
  for (const auto& st : round)
    if (auto e = st->ready() ? st->error() : nullptr; e && is_a<ConfigError>(e)) return e;
  const size_t first_trainer = std::min(loaders, round.size());
  const bool from_loader = std::any_of(round.begin(), round.begin() + static_cast<std::ptrdiff_t>(first_trainer),
                                       [&](const auto& st) { return st->ready() && st->error() == first; });
  const bool stream_broke = from_loader && !is_a<ActorDied>(first);
  if (!stream_broke && !is_a<Aborted>(first)) return first;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::exception_ptr died, own;
  for (size_t i = first_trainer; i < round.size(); ++i) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (!round[i]->ready() && left.count() > 0) round[i]->wait_for(left);
    auto e = round[i]->ready() ? round[i]->error() : nullptr;
    if (!e || e == first) continue;
    if (is_a<ConfigError>(e)) return e;
    if (!died && is_a<ActorDied>(e)) died = e;
    if (!own && !is_a<Aborted>(e)) own = e;
  }
  return died ? died : own ? own : first;
}

}  // namespace

std::vector<TrainReport> Gang::train_round(const TrainRequest& request, int64_t feed_steps,
                                           std::chrono::milliseconds timeout) {
  inflight_.clear();
  std::vector<StatePtr> round;
  std::vector<Future<int64_t>> feeds;
  if (request.from_stream) feeds = start_feeds(feed_steps * cfg_.trainer.accumulation, timeout, round);
  auto fs = call_all(&TrainerActor::train, request);
  for (auto& f : fs) round.push_back(f.state());
  if (auto e = wait_all_or_first_failure(round, timeout)) {
    e = root_cause(round, e, feeds.size());
    inflight_ = std::move(round);
    // The user's error (a step or a data set that raised) as itself:
    // TrainJob fails at once with it instead of retrying.
    try {
      std::rethrow_exception(e);
    } catch (const ConfigError&) {
      throw;
    } catch (...) {
    }
    throw StepFailed(who_failed(e, inflight_, feeds.size(), slots_) + core::exception_text(e) +
                     silent_trainers(e, fs, slots_));
  }
  std::vector<TrainReport> reps;
  for (auto& f : fs) reps.push_back(f.get());
  for (auto& f : feeds) f.get();
  return reps;
}

}  // namespace troupe::trainer
