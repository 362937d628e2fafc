// Before `troupe train` starts a cluster: the driver builds the model, the
// step and the data sets itself and runs the step once on the first samples
// of --data (and evaluates once on --val-data), so that a TorchScript file of
// the wrong signature, a step that returns no `loss`, or a batch key the
// module does not expect fails at once with a one-line ConfigError naming the
// file and the keys, not after workers were spawned. `config` is as
// to_job_config (train_options.h) makes it, which refused data sets too
// small for one step, or an empty --val-data.
#pragma once

#include "troupe/trainer/trainer_actor.h"

namespace troupe::launcher {

void preflight(const trainer::TrainerConfig& config);

}  // namespace troupe::launcher
