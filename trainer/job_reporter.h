// JobReporter: everything a TrainJob tells the outside world. It owns the
// job's clock (seconds since fit() began), the list of JobEvents, the
// metrics file (JSON lines: one per step, per epoch and per event, written
// with nlohmann-json), the console output (a live progress line on a
// terminal, a line per epoch, and the recovery events), and the job's
// progress document in the cluster's KV store (troupe.jobs/<name>: what the
// head's /metrics and dashboard show). Internal to TrainJob.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "troupe/runtime/core/future.h"
#include "troupe/runtime/wire/protocol.h"
#include "troupe/trainer/train_job.h"

namespace troupe::trainer {

// Where training stands when something is reported.
struct JobPosition {
  int64_t step = 0;
  int64_t world_size = 0;
};

class JobReporter {
 public:
  // `where` is asked for the step and world size of every event.
  JobReporter(const TrainJobConfig& cfg, std::function<JobPosition()> where);
  // Hands the last document to the head before it goes (see publish_to).
  ~JobReporter();
  JobReporter(const JobReporter&) = delete;
  JobReporter& operator=(const JobReporter&) = delete;

  // Opens TrainJobConfig::metrics_path for appending (ConfigError if it
  // cannot); without it nothing is written.
  void open_metrics();
  // Publishes the progress document to `kv` from now on (at most twice a
  // second, and at every failure, recovery and the end). Never fails the
  // job: a head that cannot take it is warned about once. `client_id` is
  // the driver's (Core::client_id): the document names a key under the
  // driver's client prefix, which the head erases when the driver is gone,
  // so that a job whose driver died is shown "lost", not "running".
  // Documents go from a thread of the reporter's own, the latest first:
  // the training loop never waits for the head (one that is down or
  // stalled held every step up until it was back or declared lost).
  // `put` sends one KV put to the head without waiting (the head channel's
  // request): the publisher waits for its answer, but gives it up a short
  // grace after the job ends, so a head that is down cannot hold up the
  // end (a Ctrl-C took 30 s, the head's reconnect window).
  using Put = std::function<Future<wire::Message>(const std::string& key, const std::string& value)>;
  void publish_to(KvStore* kv, uint64_t client_id, Put put);
  // Seconds since the reporter was made (the job's clock).
  double now() const;

  void event(JobEventKind kind, const std::string& detail);
  const std::vector<JobEvent>& events() const { return events_; }
  // Every event so far, one per line, for JobFailed's message.
  std::string history() const;

  // A step some of whose ranks cannot report it: one completed inside a
  // round that then failed, healed past, whose dead ranks' sums are gone.
  struct StepShare {
    int64_t world_size = 0;       // the ranks that trained it
    int64_t ranks_reported = 0;   // the ranks whose sums step() was given
    int64_t samples_trained = 0;  // by all of them
  };
  // One optimizer step's sums over all ranks (over `share->ranks_reported`
  // of them, when given: the line then says so, and its loss and metrics
  // are those ranks' while its samples are all that were trained).
  // `metrics` are the step's reduced metrics; `samples_per_second` the rate
  // of the train() round the step was part of, `data_wait` the share of
  // that round spent waiting for batches (StepInfo::data_wait).
  void step(int64_t epoch, int64_t step, double loss_sum, int64_t samples, const std::map<std::string, double>& metrics,
            double samples_per_second, double data_wait, const StepShare* share = nullptr);
  // The live line of a running epoch (terminal only).
  void progress(int64_t epoch, double loss, const std::map<std::string, double>& metrics, double samples_per_second);
  void epoch(const EpochMetrics& em);
  void started(const TrainerInfo& info, int64_t dataset_size);

 private:
  void write_metrics(const nlohmann::json& j);
  void publish(bool now);

  // The publisher thread: puts the latest document handed over, then
  // waits for the next; on stopping, puts what is left first.
  void publisher_loop();
  // Waits until every document handed over has been put (or failed, or
  // was given up a grace after this call).
  void await_published();
  // One put from the publisher thread (put_, else kv_->put).
  void put_now(const std::string& key, const std::string& doc);

  // The progress document's state (publish_to). doc_ is the loop's; the
  // publisher thread owns kv_ and publish_warned_ once started.
  KvStore* kv_ = nullptr;
  nlohmann::json doc_;
  std::chrono::steady_clock::time_point published_{};
  bool publish_warned_ = false;
  std::mutex publish_mu_;
  std::condition_variable publish_cv_;
  std::optional<std::string> to_publish_;  // the latest document not yet put
  bool publisher_stopping_ = false;
  bool putting_ = false;  // the publisher is inside a put
  Put put_;
  // Once the job has ended (its last state handed over, or the reporter
  // going), a put not answered by then is given up.
  std::optional<std::chrono::steady_clock::time_point> give_up_at_;
  std::thread publisher_;

  const TrainJobConfig& cfg_;
  std::function<JobPosition()> where_;
  std::chrono::steady_clock::time_point t0_;
  bool tty_ = false;
  std::unique_ptr<std::ofstream> metrics_;
  std::vector<JobEvent> events_;
  std::set<std::string> renamed_metrics_;  // step metrics named as a field of the line (said once each)
};

}  // namespace troupe::trainer
