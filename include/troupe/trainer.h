// Training with troupe: TrainJob (the driver side: placement, epochs,
// recovery, elasticity, checkpoints), TrainerActor, and the data-loading
// actors and data sets they use. Link troupe::trainer.
#pragma once

#include "troupe/troupe.h"
#include "troupe/actors/data_loader_actor.h"
#include "troupe/actors/dataset.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/train_job.h"
#include "troupe/trainer/trainer_actor.h"
