// scaling: throughput of data-parallel training with 1 and 2 workers on
// synthetic data (MLP 784→512→512→10, per-worker batch 64, one torch thread
// per worker). Each worker count trains for --warmup seconds untimed
// (placement, process start, first steps), then for --seconds timed, in
// rounds of --round-steps steps; samples/s is all workers' samples over the
// wall time of the timed rounds. Writes scaling.csv and, with
// /usr/bin/python3's matplotlib, scaling.png.
//
//   ./scaling [--max-workers 2] [--seconds 5] [--warmup 1] [--size 8192] [--out scaling_out]
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "examples/common/cli_checks.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/train_job.h"

namespace {

struct Args {
  int64_t max_workers = 2;
  int64_t size = 8192;
  double seconds = 5;
  double warmup = 1;
  int64_t round_steps = 10;
  std::string out = "scaling_out";
};

// Thrown from on_step when the timed window is over: fit() passes it on
// as it is and releases the trainers.
struct TimeUp {};

struct Measured {
  double samples_per_second = 0;
  int64_t samples = 0;
  double seconds = 0;
};

Measured measure(troupe::Runtime& rt, const Args& a, int64_t workers) {
  troupe::trainer::TrainJobConfig cfg;
  cfg.name = "scaling-" + std::to_string(workers);
  cfg.scaling.num_workers = workers;
  cfg.trainer.model.name = "mlp";
  cfg.trainer.model.input_dim = 784;
  cfg.trainer.model.hidden = 512;
  cfg.trainer.model.num_classes = 10;
  cfg.trainer.data = troupe::actors::DatasetSpec("synthetic_classification")
                         .set("size", a.size)
                         .set("num_features", 784)
                         .set("num_classes", 10);
  cfg.trainer.batch_size = 64;
  cfg.trainer.threads = 1;
  cfg.epochs = 1'000'000;  // bounded by time: on_step ends the run
  cfg.progress_every_steps = a.round_steps;
  cfg.evaluate = false;
  cfg.verbose = false;
  // Each trainer reads its own in-memory copy, as bench/run
  // train_throughput does: on a small machine loader processes would take
  // the very cores whose scaling is measured.
  cfg.use_loaders = false;
  Measured m;
  double window_start = -1;  // time of the boundary that ended the warm-up
  double first = -1;         // the first boundary: training has started
  cfg.on_step = [&](const troupe::trainer::StepInfo& s) {
    if (first < 0) first = s.time;
    if (window_start < 0) {
      if (s.time - first >= a.warmup) window_start = s.time;
      return;
    }
    m.samples += s.samples;
    m.seconds = s.time - window_start;
    if (m.seconds >= a.seconds) throw TimeUp{};
  };
  try {
    troupe::trainer::TrainJob(rt, cfg).fit();
  } catch (const TimeUp&) {
  }
  if (m.seconds <= 0) throw troupe::Error("the run ended before its timed window");
  m.samples_per_second = m.samples / m.seconds;
  return m;
}

// The folder reaches the script as its argument, never as its source
// text: a name with a quote in it is a name, not Python.
void plot(const std::string& out) {
  static const char* kScript =
      "import csv, os, sys, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
      "out = sys.argv[1]\n"
      "rows = list(csv.DictReader(open(os.path.join(out, 'scaling.csv'))))\n"
      "w = [int(r['workers']) for r in rows]; s = [float(r['samples_per_second']) for r in rows]\n"
      "plt.plot(w, s, 'o-', label='troupe'); plt.plot(w, [s[0]*x for x in w], '--', label='linear')\n"
      "plt.xlabel('workers'); plt.ylabel('samples/s'); plt.xticks(w); plt.legend(); plt.grid(alpha=.3)\n"
      "plt.title('MLP 784-512-512-10, batch 64 per worker')\n"
      "plt.savefig(os.path.join(out, 'scaling.png'), dpi=100)\n";
  int rc = -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/usr/bin/python3", "python3", "-c", kScript, out.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  if (pid > 0) {
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::printf("wrote %s/scaling.csv%s\n", out.c_str(),
              rc == 0 ? (" and " + out + "/scaling.png").c_str() : " (no plot: matplotlib failed)");
}

int run(troupe::Runtime& rt, const Args& a) {
  std::filesystem::create_directories(a.out);
  std::ofstream csv(a.out + "/scaling.csv");
  csv << "workers,samples_per_second,speedup,efficiency,timed_seconds\n";
  double base = 0;
  for (int64_t w = 1; w <= a.max_workers; ++w) {
    const Measured m = measure(rt, a, w);
    if (w == 1) base = m.samples_per_second;
    const double speedup = m.samples_per_second / base;
    std::printf("%lld worker(s): %.0f samples/s over %.1f s (speedup %.2f×)\n", static_cast<long long>(w),
                m.samples_per_second, m.seconds, speedup);
    std::fflush(stdout);
    csv << w << "," << m.samples_per_second << "," << speedup << "," << speedup / w << "," << m.seconds << "\n";
  }
  csv.close();
  plot(a.out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);  // a worker process never returns from here
  Args a;
  std::string address;
  CLI::App app{"scaling: data-parallel training throughput with 1..N workers on synthetic data"};
  app.add_option("--max-workers", a.max_workers, "largest worker count")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--seconds", a.seconds, "timed seconds per worker count")
      ->capture_default_str()
      ->check(troupe::examples::kPositive)
      ->check(troupe::examples::kFinite);
  app.add_option("--warmup", a.warmup, "untimed seconds of training first")
      ->capture_default_str()
      ->check(troupe::examples::kNonNegative)
      ->check(troupe::examples::kFinite);
  app.add_option("--round-steps", a.round_steps, "steps per round (the timing's granularity)")
      ->capture_default_str()
      ->check(troupe::examples::kPositive);
  app.add_option("--size", a.size, "synthetic samples")->capture_default_str()->check(troupe::examples::kPositive);
  app.add_option("--out", a.out, "output directory")->capture_default_str();
  app.add_option("--address", address, "HOST:PORT of a running cluster, or auto (default: an embedded one)");
  TROUPE_EXAMPLE_PARSE(app, argc, argv);
  try {
    troupe::Runtime rt = troupe::init(argc, argv);
    const int code = run(rt, a);
    rt.shutdown();
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaling: %s\n", e.what());
    return 1;
  }
}
