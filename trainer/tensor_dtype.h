// Maps torch dtypes to the collective layer's element types.
#pragma once

#include <string>

#include <torch/types.h>

#include "runtime/collective/group.h"
#include "runtime/core/errors.h"

namespace troupe::trainer {

inline collective::DType to_group_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return collective::DType::kFloat32;
    case torch::kFloat64: return collective::DType::kFloat64;
    case torch::kInt32: return collective::DType::kInt32;
    case torch::kInt64: return collective::DType::kInt64;
    case torch::kBFloat16: return collective::DType::kBFloat16;
    case torch::kFloat16: return collective::DType::kFloat16;
    case torch::kUInt8: return collective::DType::kUInt8;
    default: throw Error(std::string("no collective dtype for torch dtype ") + c10::toString(t));
  }
}

}  // namespace troupe::trainer
