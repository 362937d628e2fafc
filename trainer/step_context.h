// StepContext: where a call of a train step stands in the job (what a
// curriculum or a rank-dependent choice reads). Set by the trainer on the
// step (TrainStep::context()) and on the model (Model::set_context: a
// TorchScript module's `set_context(context: Dict[str, int])`).
#pragma once

#include <cstdint>

namespace troupe::trainer {

// A heal, a resume or a resize gives a step the same context the
// uninterrupted run would have given it.
struct StepContext {
  // Optimizer steps taken before this one: 0 in the job's first step. In
  // evaluation, the steps taken before it.
  int64_t step = 0;
  // The epoch the batch is from (0-based).
  int64_t epoch = 0;
  // This forward's place among the step's accumulated micro-batches
  // (0 .. accumulation - 1); 0 in evaluation.
  int64_t micro_step = 0;
  int64_t accumulation = 1;
  // This trainer's rank and the group's size now (they change with a
  // resize; a step that must train alike at any size reads neither).
  int64_t rank = 0;
  int64_t world_size = 1;
  // false in evaluation.
  bool training = true;
};

}  // namespace troupe::trainer
