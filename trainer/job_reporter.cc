#include "troupe/trainer/job_reporter.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <sstream>

#include "troupe/runtime/client/actor_keys.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/head/metrics.h"

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/error_kind.h"

namespace troupe::trainer {

const char* to_string(JobEventKind kind) {
  switch (kind) {
    case JobEventKind::kPlaced:
      return "placed";
    case JobEventKind::kResumeFrom:
      return "resume_from";
    case JobEventKind::kStarted:
      return "started";
    case JobEventKind::kStandby:
      return "standby";
    case JobEventKind::kCheckpoint:
      return "checkpoint";
    case JobEventKind::kEpoch:
      return "epoch";
    case JobEventKind::kFinished:
      return "finished";
    case JobEventKind::kInterrupted:
      return "interrupted";
    case JobEventKind::kFailed:
      return "failed";
    case JobEventKind::kFailure:
      return "failure";
    case JobEventKind::kAborted:
      return "aborted";
    case JobEventKind::kReplaced:
      return "replaced";
    case JobEventKind::kHealed:
      return "healed";
    case JobEventKind::kRestored:
      return "restored";
    case JobEventKind::kResized:
      return "resized";
    case JobEventKind::kResumed:
      return "resumed";
    case JobEventKind::kGrew:
      return "grew";
    case JobEventKind::kGrowHealed:
      return "grow_healed";
    case JobEventKind::kGrowFailed:
      return "grow_failed";
    case JobEventKind::kGrowPutOff:
      return "grow_put_off";
    case JobEventKind::kSamplesSkipped:
      return "samples_skipped";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, JobEventKind kind) { return os << to_string(kind); }

namespace {

// "  accuracy 0.972  mae 0.118": the step's own metrics (whatever it
// returned), each name after `prefix`, for the console lines.
std::string metrics_text(const std::map<std::string, double>& metrics, const char* prefix) {
  std::string out;
  char value[32];
  for (const auto& [name, v] : metrics) {
    std::snprintf(value, sizeof value, " %.4g", v);
    out += "  " + std::string(prefix) + name + value;
  }
  return out;
}

// Recovery and growth are shown on the console; the rest is in the
// progress and epoch lines already.
bool shown(JobEventKind kind) {
  switch (kind) {
    case JobEventKind::kFailure:
    case JobEventKind::kAborted:
    case JobEventKind::kReplaced:
    case JobEventKind::kHealed:
    case JobEventKind::kRestored:
    case JobEventKind::kResized:
    case JobEventKind::kResumed:
    case JobEventKind::kGrew:
    case JobEventKind::kGrowHealed:
    case JobEventKind::kGrowFailed:
    case JobEventKind::kGrowPutOff:
    case JobEventKind::kSamplesSkipped:
      return true;
    default:
      return false;
  }
}

}  // namespace

JobReporter::JobReporter(const TrainJobConfig& cfg, std::function<JobPosition()> where)
    : cfg_(cfg), where_(std::move(where)), t0_(std::chrono::steady_clock::now()), tty_(::isatty(1)) {}

// How long the job's end waits for the head to take its last document.
constexpr auto kLastDocumentGrace = std::chrono::seconds(2);

JobReporter::~JobReporter() {
  if (!publisher_.joinable()) return;
  {
    std::lock_guard lock(publish_mu_);
    publisher_stopping_ = true;
    if (!give_up_at_) give_up_at_ = std::chrono::steady_clock::now() + kLastDocumentGrace;
  }
  publish_cv_.notify_all();
  // Bounded by the grace: the publisher gives up a put not answered by then.
  publisher_.join();
}

void JobReporter::await_published() {
  std::unique_lock lock(publish_mu_);
  if (!give_up_at_) give_up_at_ = std::chrono::steady_clock::now() + kLastDocumentGrace;
  publish_cv_.notify_all();
  // Bounded by the grace: the publisher gives up a put not answered by then.
  publish_cv_.wait(lock, [&] { return !to_publish_ && !putting_; });
}

void JobReporter::put_now(const std::string& key, const std::string& doc) {
  if (!put_) return kv_->put(key, doc);
  auto answer = put_(key, doc);
  for (;;) {
    if (answer.wait_for(std::chrono::milliseconds(100))) break;
    std::lock_guard lock(publish_mu_);
    if (give_up_at_ && std::chrono::steady_clock::now() >= *give_up_at_)
      throw Error("the head did not take it within " + std::to_string(kLastDocumentGrace.count()) +
                  " s of the job's end (it is down or stalled)");
  }
  wire::Message m = answer.get();
  if (m.status != wire::Status::OK) std::rethrow_exception(wire::error_from_message(m));
}

void JobReporter::publisher_loop() {
  const std::string key = std::string(head::kJobKeyPrefix) + cfg_.name;
  for (;;) {
    std::string doc;
    {
      std::unique_lock lock(publish_mu_);
      publish_cv_.wait(lock, [&] { return publisher_stopping_ || to_publish_; });
      if (!to_publish_) return;  // stopping, and everything was put
      doc = std::move(*to_publish_);
      to_publish_.reset();
      putting_ = true;
    }
    try {
      put_now(key, doc);
    } catch (const std::exception& e) {
      if (!publish_warned_)
        TROUPE_LOG_WARN("[{}] cannot publish the job's progress to the head: {}", cfg_.name, e.what());
      publish_warned_ = true;
    }
    {
      std::lock_guard lock(publish_mu_);
      putting_ = false;
    }
    publish_cv_.notify_all();
  }
}

void JobReporter::open_metrics() {
  if (cfg_.metrics_path.empty()) return;
  auto parent = std::filesystem::path(cfg_.metrics_path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  errno = 0;
  metrics_ = std::make_unique<std::ofstream>(cfg_.metrics_path, std::ios::app);
  if (!*metrics_) {
    const int e = errno;
    metrics_.reset();
    throw ConfigError("cannot open metrics file " + cfg_.metrics_path + ": " +
                      (e != 0 ? std::strerror(e) : "reason unknown"));
  }
}

double JobReporter::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

void JobReporter::write_metrics(const nlohmann::json& j) {
  if (metrics_) *metrics_ << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n" << std::flush;
}

void JobReporter::publish_to(KvStore* kv, uint64_t client_id, Put put) {
  kv_ = kv;
  put_ = std::move(put);
  // Lives as long as this driver's connection to the head (actor_keys.h).
  const std::string driver_key = client::client_key_prefix(client_id) + "job/" + cfg_.name;
  try {
    kv_->put(driver_key, "1");
  } catch (const std::exception& e) {
    TROUPE_LOG_WARN("[{}] cannot publish the job's progress to the head: {}", cfg_.name, e.what());
    publish_warned_ = true;
  }
  doc_ = {{"name", cfg_.name},
          {"driver_key", driver_key},
          {"state", "running"},
          {"step", 0},
          {"epoch", 0},  // counted from 0, as in the metrics file; shown from 1 of "epochs"
          {"epochs", cfg_.epochs},
          {"loss", 0.0},
          {"samples_per_s", 0.0},
          {"world_size", 0},
          {"recoveries", 0},
          {"history", nlohmann::json::array()},
          {"events", nlohmann::json::array()}};
  if (!publisher_.joinable()) publisher_ = std::thread([this] { publisher_loop(); });
  publish(true);
}

void JobReporter::publish(bool now) {
  if (!kv_) return;
  const auto t = std::chrono::steady_clock::now();
  if (!now && t - published_ < std::chrono::milliseconds(500)) return;
  published_ = t;
  doc_["time"] = this->now();
  std::string doc = doc_.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  {
    std::lock_guard lock(publish_mu_);
    to_publish_ = std::move(doc);  // replaces one the publisher has not taken yet
  }
  publish_cv_.notify_all();
}

void JobReporter::event(JobEventKind kind, const std::string& detail) {
  const JobPosition at = where_();
  JobEvent e{now(), kind, detail, at.step, at.world_size};
  events_.push_back(e);
  if (kv_ && kind != JobEventKind::kCheckpoint && kind != JobEventKind::kEpoch) {
    // The document keeps the latest 100 events; the metrics file has them all.
    auto& list = doc_["events"];
    if (list.size() >= 100) list.erase(list.begin());
    list.push_back({{"t", e.time}, {"kind", to_string(kind)}, {"detail", detail}, {"step", at.step}});
    // Counted as each recovery completes, never taken back: a failure
    // counted at once and taken back when the job gave up made the counter
    // (troupe_job_recoveries_total) go down, and -1 for a job that gave up
    // without any failure (a diverging loss, a ConfigError).
    // A recovery while the job starts ends at "restored" (new trainers
    // start over; no "resumed" follows).
    const bool restarted_at_start = kind == JobEventKind::kRestored &&
                                    std::none_of(events_.begin(), events_.end(),
                                                 [](const JobEvent& ev) { return ev.kind == JobEventKind::kStarted; });
    if (kind == JobEventKind::kResumed || restarted_at_start)
      doc_["recoveries"] = doc_["recoveries"].get<int64_t>() + 1;
    if (kind == JobEventKind::kFinished) doc_["state"] = "finished";
    if (kind == JobEventKind::kInterrupted) doc_["state"] = "interrupted";
    if (kind == JobEventKind::kFailed) doc_["state"] = "failed";
    doc_["world_size"] = at.world_size;
    publish(true);
    // The job's last state is at the head when fit() returns or throws.
    if (kind == JobEventKind::kFinished || kind == JobEventKind::kInterrupted || kind == JobEventKind::kFailed)
      await_published();
  }
  write_metrics({{"kind", "event"},
                 {"job", cfg_.name},
                 {"event", to_string(kind)},
                 {"detail", detail},
                 {"time", e.time},
                 {"step", at.step},
                 {"workers", at.world_size}});
  if (cfg_.verbose && shown(kind)) {
    std::printf("%s[%s] %7.3fs %-8s %s\n", tty_ ? "\r" : "", cfg_.name.c_str(), e.time, to_string(kind),
                detail.c_str());
    std::fflush(stdout);
  }
}

std::string JobReporter::history() const {
  std::ostringstream s;
  for (const auto& e : events_) {
    char t[32];
    std::snprintf(t, sizeof t, "%.3fs", e.time);
    s << "\n  " << t << " " << to_string(e.kind) << ": " << e.detail;
  }
  return s.str();
}

void JobReporter::step(int64_t epoch, int64_t step, double loss_sum, int64_t samples,
                       const std::map<std::string, double>& metrics, double samples_per_second, double data_wait,
                       const StepShare* share) {
  const int64_t world = share ? share->world_size : where_().world_size;
  nlohmann::json j = {{"kind", "step"},
                      {"job", cfg_.name},
                      {"epoch", epoch},
                      {"step", step},
                      {"loss", loss_sum / samples},
                      {"samples", share ? share->samples_trained : samples},
                      {"workers", world},
                      {"world_size", world},
                      {"samples_per_s", samples_per_second},
                      {"data_wait", data_wait},
                      {"time", now()}};
  if (share) {
    // Its loss and metrics are the reporting ranks': say how many.
    j["ranks_reported"] = share->ranks_reported;
    j["samples_reported"] = samples;
  }
  // The step's own metrics under their names; one named as a field of the
  // line ("step", "samples", ...) goes in as "metric_<name>", said once
  // (it was dropped without a word).
  for (const auto& [k, v] : metrics) {
    if (j.emplace(k, v).second) continue;
    std::string renamed = "metric_" + k;
    while (j.contains(renamed) || metrics.count(renamed))
      renamed = "metric_" + renamed;  // never over a metric of its own
    j[renamed] = v;
    if (renamed_metrics_.insert(k).second)
      TROUPE_LOG_WARN(
          "the step's metric '{}' has the name of a field of the metrics file's step lines: written "
          "there as '{}'",
          k, renamed);
  }
  write_metrics(j);
  if (kv_) {
    doc_["step"] = step;
    doc_["epoch"] = epoch;
    doc_["loss"] = loss_sum / samples;
    doc_["samples_per_s"] = samples_per_second;
    doc_["data_wait"] = data_wait;
    doc_["world_size"] = where_().world_size;
    // The chart's points (time, samples/s, world size, step), at most 600:
    // when full, every other one goes, so the whole run stays in view.
    auto& h = doc_["history"];
    if (h.size() >= 600) {
      nlohmann::json half = nlohmann::json::array();
      for (size_t i = 0; i < h.size(); i += 2) half.push_back(std::move(h[i]));
      h = std::move(half);
    }
    h.push_back({now(), samples_per_second, where_().world_size, step});
    publish(false);
  }
}

void JobReporter::progress(int64_t epoch, double loss, const std::map<std::string, double>& metrics,
                           double samples_per_second) {
  if (!cfg_.verbose || !tty_) return;
  const JobPosition at = where_();
  std::printf("\r[%s] epoch %lld/%lld  step %lld  %lld workers  loss %.4f%s  %.0f samples/s   ", cfg_.name.c_str(),
              static_cast<long long>(epoch + 1), static_cast<long long>(cfg_.epochs), static_cast<long long>(at.step),
              static_cast<long long>(at.world_size), loss, metrics_text(metrics, "").c_str(), samples_per_second);
  std::fflush(stdout);
}

void JobReporter::epoch(const EpochMetrics& em) {
  const JobPosition at = where_();
  nlohmann::json record = {{"kind", "epoch"},
                           {"job", cfg_.name},
                           {"epoch", em.epoch},
                           {"step", at.step},
                           {"workers", at.world_size},
                           {"train_loss", em.train_loss},
                           {"samples_per_second", em.samples_per_second},
                           {"data_wait", em.data_wait},
                           {"val_count", em.val_count},
                           {"seconds", em.seconds},
                           {"train_metrics", em.train_metrics}};
  // What was not measured is left out, not written as 0: an accuracy only
  // where the step reports one, validation only where it ran.
  for (const auto& [k, v] : em.summary()) record[k] = v;
  if (em.val_count > 0) record["val_metrics"] = em.val_metrics;
  write_metrics(record);
  if (!cfg_.verbose) return;
  std::string val;
  if (cfg_.evaluate && em.val_count > 0) {  // no samples scored: no val_loss, not a 0 (as in the metrics file)
    char loss[48];
    std::snprintf(loss, sizeof loss, "  val_loss %.4f", em.val_loss);
    val = loss + metrics_text(em.val_metrics, "val_");
  }
  // Worth a word only when the input, not the model, holds steps back.
  char wait[40] = "";
  if (em.data_wait >= 0.05) std::snprintf(wait, sizeof wait, "  waiting for data %.0f%%", 100 * em.data_wait);
  std::printf("%s[%s] epoch %lld/%lld  step %lld  loss %.4f%s%s  %.0f samples/s%s  %.2fs\n", tty_ ? "\r" : "",
              cfg_.name.c_str(), static_cast<long long>(em.epoch + 1), static_cast<long long>(cfg_.epochs),
              static_cast<long long>(at.step), em.train_loss, metrics_text(em.train_metrics, "").c_str(), val.c_str(),
              em.samples_per_second, wait, em.seconds);
  std::fflush(stdout);
}

void JobReporter::started(const TrainerInfo& info, int64_t dataset_size) {
  if (!cfg_.verbose) return;
  const std::string amp = cfg_.trainer.mixed_precision ? ", " + cfg_.trainer.amp_dtype + " autocast" : "";
  std::printf("[%s] %lld trainer(s) (%s, %lld parameters, %s%s), %lld samples\n", cfg_.name.c_str(),
              static_cast<long long>(where_().world_size), info.model.c_str(), static_cast<long long>(info.parameters),
              info.device.c_str(), amp.c_str(), static_cast<long long>(dataset_size));
}

}  // namespace troupe::trainer
