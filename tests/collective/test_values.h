// Typed test data for collective tests: the value every rank contributes at
// each index, and its expected reduction, computed in the element type's own
// arithmetic (integers wrap like the backend's), with tolerances for floats.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "troupe/runtime/collective/group.h"
#include "troupe/runtime/collective/reduce.h"
#include "troupe/runtime/core/check.h"

namespace troupe::collective::testing {

// Small integers: exact in every type, products stay below 2^11 for four
// ranks, so float16 and bfloat16 represent them exactly.
inline double contribution(int rank, size_t i) { return (rank + 1) + static_cast<double>(i % 3); }

inline void store(void* buf, size_t i, DType d, double v) {
  switch (d) {
    case DType::kFloat32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DType::kInt32:
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(static_cast<int64_t>(v));
      break;
    case DType::kInt64:
      static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v);
      break;
    case DType::kUInt8:
      static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(static_cast<int64_t>(v));
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(buf)[i] = detail::float_to_bf16(static_cast<float>(v));
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(buf)[i] = detail::float_to_fp16(static_cast<float>(v));
      break;
  }
}

inline double load(const void* buf, size_t i, DType d) {
  switch (d) {
    case DType::kFloat32:
      return static_cast<const float*>(buf)[i];
    case DType::kFloat64:
      return static_cast<const double*>(buf)[i];
    case DType::kInt32:
      return static_cast<const int32_t*>(buf)[i];
    case DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DType::kUInt8:
      return static_cast<const uint8_t*>(buf)[i];
    case DType::kBFloat16:
      return detail::bf16_to_float(static_cast<const uint16_t*>(buf)[i]);
    case DType::kFloat16:
      return detail::fp16_to_float(static_cast<const uint16_t*>(buf)[i]);
  }
  return NAN;
}

inline bool is_integer(DType d) { return d == DType::kInt32 || d == DType::kInt64 || d == DType::kUInt8; }

// The reduction over ranks 0..n-1 of contribution(r, i), as the dtype would
// hold it.
inline double expected_reduction(ReduceOp op, DType d, int n, size_t i) {
  if (is_integer(d)) {
    int64_t acc = static_cast<int64_t>(contribution(0, i));
    for (int r = 1; r < n; ++r) {
      int64_t v = static_cast<int64_t>(contribution(r, i));
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg:
          acc += v;
          break;
        case ReduceOp::kProduct:
          acc *= v;
          break;
        case ReduceOp::kMin:
          acc = std::min(acc, v);
          break;
        case ReduceOp::kMax:
          acc = std::max(acc, v);
          break;
      }
    }
    if (d == DType::kUInt8) acc = static_cast<uint8_t>(acc);  // wraps like the backend
    if (op == ReduceOp::kAvg) acc /= n;
    return static_cast<double>(acc);
  }
  double acc = contribution(0, i);
  for (int r = 1; r < n; ++r) {
    double v = contribution(r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kProduct:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  if (op == ReduceOp::kAvg) acc /= n;
  return acc;
}

inline bool close_enough(double got, double want, DType d) {
  if (is_integer(d)) return got == want;
  double tol = detail::is_half(d) ? 1e-2 : (d == DType::kFloat32 ? 1e-6 : 1e-12);
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

inline std::vector<char> make_buffer(size_t count, DType d) { return std::vector<char>(count * element_size(d) + 1); }

}  // namespace troupe::collective::testing
