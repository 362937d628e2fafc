#include "troupe/runtime/head/metrics.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "troupe/runtime/client/task.h"
#include "troupe/runtime/core/utf8.h"

namespace troupe::head {

namespace {

using nlohmann::json;
using Labels = std::vector<std::pair<std::string, std::string>>;

// A label value with \, " and newlines escaped as the format requires.
// Bytes that are not UTF-8 become U+FFFD: the format is UTF-8 text.
std::string escape(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : core::to_valid_utf8(v)) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

double as_number(const json& j) { return j.is_number() ? j.get<double>() : j.is_boolean() ? j.get<bool>() : 0.0; }

// One metric family: HELP and TYPE once, then its samples.
class Family {
 public:
  Family(std::ostringstream& out, const std::string& name, const std::string& type, const std::string& help)
      : out_(out), name_(name) {
    out_ << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  }
  void sample(const Labels& labels, double value) {
    out_ << name_;
    if (!labels.empty()) {
      out_ << "{";
      for (size_t i = 0; i < labels.size(); ++i)
        out_ << (i ? "," : "") << labels[i].first << "=\"" << escape(labels[i].second) << "\"";
      out_ << "}";
    }
    out_ << " " << number(value) << "\n";
  }

 private:
  std::ostringstream& out_;
  std::string name_;
};

void node_metrics(std::ostringstream& out, const json& nodes) {
  Family alive(out, "troupe_nodes", "gauge", "Node agents the head knows, by liveness.");
  double up = 0, down = 0;
  for (const auto& n : nodes) (n.value("alive", false) ? up : down) += 1;
  alive.sample({{"state", "alive"}}, up);
  alive.sample({{"state", "dead"}}, down);
  // CPU and GPU always: with no live node the cluster's capacity is 0,
  // not absent (an alert on it must see the drop).
  std::map<std::string, double> total = {{"CPU", 0}, {"GPU", 0}}, used;
  Family node_total(out, "troupe_node_resource_capacity", "gauge", "Resources of each live node.");
  for (const auto& n : nodes) {
    if (!n.value("alive", false)) continue;
    const json res = n.value("total", json::object());  // a copy: items() must not outlive it
    for (const auto& [r, v] : res.items()) {
      node_total.sample({{"node", std::to_string(n.value("id", 0))}, {"resource", r}}, as_number(v));
      total[r] += as_number(v);
    }
  }
  Family node_used(out, "troupe_node_resource_used", "gauge", "Resources held by actors and bundles, per node.");
  for (const auto& n : nodes) {
    if (!n.value("alive", false)) continue;
    const json res = n.value("used", json::object());
    for (const auto& [r, v] : res.items()) {
      node_used.sample({{"node", std::to_string(n.value("id", 0))}, {"resource", r}}, as_number(v));
      used[r] += as_number(v);
    }
  }
  Family cluster_total(out, "troupe_cluster_resource_capacity", "gauge", "Resources of all live nodes.");
  for (const auto& [r, v] : total) cluster_total.sample({{"resource", r}}, v);
  Family cluster_used(
      out, "troupe_cluster_resource_used", "gauge",
      "Resources in use over all live nodes; above the capacity while tasks that wait in get() lend their CPUs "
      "to the tasks they wait for (nested tasks).");
  for (const auto& [r, v] : total) cluster_used.sample({{"resource", r}}, used.count(r) ? used[r] : 0.0);
}

void actor_metrics(std::ostringstream& out, const json& snapshot) {
  // The hidden executors of tasks apart: the state API lists no actor of
  // theirs, and counting them made troupe_actors disagree with it.
  std::map<std::string, double> by_state = {{"PENDING", 0}, {"ALIVE", 0}, {"RESTARTING", 0}, {"DEAD", 0}};
  std::map<std::string, double> executors = by_state;
  for (const auto& a : snapshot.value("actors", json::array())) {
    if (!a.is_object()) continue;
    const bool executor = a.value("class", "") == client::kTaskExecutorClass;
    (executor ? executors : by_state)[a.value("state", "UNKNOWN")] += 1;
  }
  Family actors(out, "troupe_actors", "gauge",
                "Actors by state (DEAD ones as many as the head keeps), tasks' executors left out.");
  for (const auto& [s, n] : by_state) actors.sample({{"state", s}}, n);
  Family ex(out, "troupe_task_executors", "gauge",
            "The hidden actors that run tasks, by state (DEAD ones as many as the head keeps).");
  for (const auto& [s, n] : executors) ex.sample({{"state", s}}, n);
  Family r(out, "troupe_actor_restarts_total", "counter",
           "Restarts of every actor, the DEAD ones the head no longer keeps included.");
  r.sample({}, as_number(snapshot.value("actor_restarts_total", json(0))));
  std::map<std::string, double> groups = {{"PENDING", 0}, {"CREATED", 0}, {"REMOVED", 0}};
  for (const auto& g : snapshot.value("placement_groups", json::array())) groups[g.value("state", "UNKNOWN")] += 1;
  Family pg(out, "troupe_placement_groups", "gauge", "Placement groups by state.");
  for (const auto& [s, n] : groups) pg.sample({{"state", s}}, n);
  Family kv(out, "troupe_kv_keys", "gauge", "Keys in the cluster's KV store.");
  kv.sample({}, as_number(snapshot.value("kv_keys", json(0))));
}

void worker_metrics(std::ostringstream& out, const json& w) {
  Family calls(out, "troupe_actor_calls_total", "counter",
               "Actor calls (tasks included) served by every worker: what they report each second, and a "
               "reaped worker's last count from its node agent.");
  calls.sample({}, as_number(w.value("calls_total", json(0))));
  Family rate(out, "troupe_actor_calls_per_second", "gauge", "Actor calls served per second over the last seconds.");
  rate.sample({}, as_number(w.value("calls_per_second", json(0))));
  Family bytes(out, "troupe_stream_received_bytes_total", "counter", "Stream item bytes every worker received.");
  bytes.sample({}, as_number(w.value("stream_bytes_total", json(0))));
  Family brate(out, "troupe_stream_bytes_per_second", "gauge", "Stream bytes received per second, recently.");
  brate.sample({}, as_number(w.value("stream_bytes_per_second", json(0))));
}

void head_metrics(std::ostringstream& out, const json& head) {
  Family up(out, "troupe_head_uptime_seconds", "gauge", "Seconds since the head started.");
  up.sample({}, as_number(head.value("uptime_s", json(0))));
  Family msgs(out, "troupe_head_messages_total", "counter",
              "Messages the head handled, by operation (actor calls do not pass through the head).");
  const json messages = head.value("messages", json::object());
  for (const auto& [op, n] : messages.items()) msgs.sample({{"op", op}}, as_number(n));
  Family written(out, "troupe_head_state_db_written", "gauge",
                 "1 while the head writes its tables through to its state db; 0 without one, or once a write "
                 "failed (a restarted head would start empty).");
  const json db = head.value("state_db", json::object());
  written.sample({}, db.value("written", false) ? 1 : 0);
}

// A job's field as a sample: a job publishes its document in the KV
// store, where any client may write, so a field may be missing or of
// another type (0). A null was a number JSON cannot carry (a diverged
// job's NaN loss): NaN, never 0.
double job_field(const json& job, const char* key) {
  auto it = job.find(key);
  if (it == job.end()) return 0;
  return it->is_null() ? std::numeric_limits<double>::quiet_NaN() : as_number(*it);
}

void job_metrics(std::ostringstream& out, const json& all) {
  // Only documents with a name: a malformed one is left out rather than
  // failing the whole scrape.
  std::vector<json> jobs;
  std::set<std::string> names;
  for (const auto& j : all)
    if (j.is_object() && j.contains("name") && j["name"].is_string() &&
        names.insert(j["name"].get<std::string>()).second)
      jobs.push_back(j);
  struct Field {
    const char* metric;
    const char* key;
    const char* type;
    const char* help;
  };
  static const Field kFields[] = {
      {"troupe_job_step", "step", "gauge", "Optimizer steps a TrainJob has done."},
      {"troupe_job_epoch", "epoch", "gauge",
       "The epoch a TrainJob is in, counted from 0 (troupe status and the console show it from 1)."},
      {"troupe_job_samples_per_second", "samples_per_s", "gauge", "A TrainJob's training throughput."},
      {"troupe_job_data_wait", "data_wait", "gauge",
       "Share of a TrainJob's latest train() round its trainers spent waiting for batches (0-1)."},
      {"troupe_job_loss", "loss", "gauge", "A TrainJob's latest step loss."},
      {"troupe_job_world_size", "world_size", "gauge", "Trainers a TrainJob runs with."},
      {"troupe_job_recoveries_total", "recoveries", "counter", "Failures a TrainJob recovered from."},
  };
  for (const auto& f : kFields) {
    Family fam(out, f.metric, f.type, f.help);
    for (const auto& j : jobs) fam.sample({{"job_name", j["name"].get<std::string>()}}, job_field(j, f.key));
  }
  Family running(out, "troupe_job_running", "gauge", "1 while a TrainJob runs, 0 once it finished or failed.");
  for (const auto& j : jobs)
    running.sample({{"job_name", j["name"].get<std::string>()}}, j.value("state", json()) == "running");
}

}  // namespace

std::string prometheus_text(const nlohmann::json& snapshot) {
  std::ostringstream out;
  node_metrics(out, snapshot.value("nodes", json::array()));
  actor_metrics(out, snapshot);
  head_metrics(out, snapshot.value("head", json::object()));
  worker_metrics(out, snapshot.value("workers", json::object()));
  job_metrics(out, snapshot.value("jobs", json::array()));
  return out.str();
}

}  // namespace troupe::head
