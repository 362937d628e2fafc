// Comparing trainer states in tests: bitwise equality of the model and
// optimizer tensors (the recovery guarantee of DESIGN §7).
#pragma once

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "troupe/trainer/checkpoint.h"

namespace troupe::test {

inline void expect_bitwise_equal(const trainer::TrainState& a, const trainer::TrainState& b) {
  ASSERT_EQ(a.step, b.step);
  ASSERT_EQ(a.model.size(), b.model.size());
  for (const auto& [name, t] : a.model) {
    ASSERT_TRUE(b.model.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.model.at(name))) << name << " differs";
  }
  ASSERT_EQ(a.optimizer.size(), b.optimizer.size());
  for (const auto& [name, t] : a.optimizer) {
    ASSERT_TRUE(b.optimizer.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.optimizer.at(name))) << "optimizer " << name << " differs";
  }
  ASSERT_EQ(a.step_state.size(), b.step_state.size());
  for (const auto& [name, t] : a.step_state) {
    ASSERT_TRUE(b.step_state.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.step_state.at(name))) << "step state " << name << " differs";
  }
}

}  // namespace troupe::test
