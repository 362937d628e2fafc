// Host-side element kernels shared by the host backends: the reduction
// functions handed to gloo, averaging, and the 16-bit float conversions
// used to reduce bfloat16/float16 in float32. Internal to the collective
// layer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "troupe/runtime/collective/group.h"

namespace troupe::collective::detail {

// c = reduce(a, b) elementwise over n elements; c may alias a or b.
using ReduceFn = void (*)(void* c, const void* a, const void* b, size_t n);

// The elementwise function for op on dtype; kAvg maps to the sum (the
// division happens once, after the reduction). 16-bit floats have none:
// callers widen them to float32 first. Throws troupe::ConfigError for those.
ReduceFn reduce_function(DType dtype, ReduceOp op);

// data[i] /= divisor, for kAvg.
void divide_in_place(void* data, size_t count, DType dtype, int divisor);

// True for kBFloat16 and kFloat16, which are reduced in float32.
inline bool is_half(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

// 16-bit floats <-> float32; narrow rounds to nearest even.
void widen_to_float(const void* in, float* out, size_t count, DType dtype);
void narrow_from_float(const float* in, void* out, size_t count, DType dtype);

// Scalar conversions, exposed for tests.
float bf16_to_float(uint16_t v);
uint16_t float_to_bf16(float f);
float fp16_to_float(uint16_t v);
uint16_t float_to_fp16(float f);

}  // namespace troupe::collective::detail
