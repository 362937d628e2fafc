// scaling: throughput of data-parallel training with 1 and 2 workers on
// synthetic data (MLP 784→512→512→10, per-worker batch 64, one torch thread
// per worker). Writes scaling.csv and, with /usr/bin/python3's matplotlib,
// scaling.png.
//
//   ./scaling [--max-workers 2] [--size 8192] [--out scaling_out]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/train_job.h"

int main(int argc, char** argv) {
  troupe::Runtime rt = troupe::init(argc, argv);
  int64_t max_workers = 2, size = 8192;
  std::string out = "scaling_out";
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--max-workers"))
      max_workers = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--size"))
      size = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--out"))
      out = argv[++i];
  }
  std::filesystem::create_directories(out);
  std::ofstream csv(out + "/scaling.csv");
  csv << "workers,samples_per_second,speedup,efficiency\n";
  double base = 0;
  for (int64_t w = 1; w <= max_workers; ++w) {
    troupe::trainer::TrainJobConfig cfg;
    cfg.name = "scaling-" + std::to_string(w);
    cfg.scaling.num_workers = w;
    cfg.trainer.model.name = "mlp";
    cfg.trainer.model.input_dim = 784;
    cfg.trainer.model.hidden = 512;
    cfg.trainer.model.num_classes = 10;
    cfg.trainer.data = troupe::actors::DatasetSpec("synthetic_classification")
                           .set("size", size)
                           .set("num_features", 784)
                           .set("num_classes", 10);
    cfg.trainer.batch_size = 64;
    cfg.trainer.threads = 1;
    cfg.epochs = 1;
    cfg.evaluate = false;
    auto r = troupe::trainer::TrainJob(rt, cfg).fit();
    double sps = r.history.back().samples_per_second;
    if (w == 1) base = sps;
    std::printf("%lld worker(s): %.0f samples/s (speedup %.2f×)\n", static_cast<long long>(w), sps, sps / base);
    csv << w << "," << sps << "," << sps / base << "," << sps / base / w << "\n";
  }
  csv.close();
  std::string plot =
      "/usr/bin/python3 - <<'PY'\n"
      "import csv, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
      "rows = list(csv.DictReader(open('" +
      out +
      "/scaling.csv')))\n"
      "w = [int(r['workers']) for r in rows]; s = [float(r['samples_per_second']) for r in rows]\n"
      "plt.plot(w, s, 'o-', label='troupe'); plt.plot(w, [s[0]*x for x in w], '--', label='linear')\n"
      "plt.xlabel('workers'); plt.ylabel('samples/s'); plt.xticks(w); plt.legend(); plt.grid(alpha=.3)\n"
      "plt.title('MLP 784-512-512-10, batch 64 per worker'); plt.savefig('" +
      out +
      "/scaling.png', dpi=100)\n"
      "PY";
  int rc = std::system(plot.c_str());
  std::printf("wrote %s/scaling.csv%s\n", out.c_str(),
              rc == 0 ? (" and " + out + "/scaling.png").c_str() : " (no plot: matplotlib failed)");
  rt.shutdown();
  return 0;
}
