#include "troupe/runtime/collective/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "troupe/runtime/core/errors.h"

namespace troupe::collective {

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat16:
      return 2;
    case DType::kUInt8:
      return 1;
  }
  throw ConfigError("unknown collective dtype");
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProduct:
      return "product";
  }
  return "unknown";
}

namespace detail {
namespace {

// Plain loops over restrict-free pointers: c may alias a, which is how gloo
// calls them, and GCC still vectorises these at -O2 with a runtime alias
// check.
template <class T>
void sum_fn(void* c, const void* a, const void* b, size_t n) {
  auto* pc = static_cast<T*>(c);
  auto* pa = static_cast<const T*>(a);
  auto* pb = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) pc[i] = pa[i] + pb[i];
}
template <class T>
void product_fn(void* c, const void* a, const void* b, size_t n) {
  auto* pc = static_cast<T*>(c);
  auto* pa = static_cast<const T*>(a);
  auto* pb = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) pc[i] = pa[i] * pb[i];
}
template <class T>
void min_fn(void* c, const void* a, const void* b, size_t n) {
  auto* pc = static_cast<T*>(c);
  auto* pa = static_cast<const T*>(a);
  auto* pb = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) pc[i] = std::min(pa[i], pb[i]);
}
template <class T>
void max_fn(void* c, const void* a, const void* b, size_t n) {
  auto* pc = static_cast<T*>(c);
  auto* pa = static_cast<const T*>(a);
  auto* pb = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) pc[i] = std::max(pa[i], pb[i]);
}

template <class T>
ReduceFn typed_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &sum_fn<T>;
    case ReduceOp::kProduct:
      return &product_fn<T>;
    case ReduceOp::kMin:
      return &min_fn<T>;
    case ReduceOp::kMax:
      return &max_fn<T>;
  }
  throw ConfigError("unknown reduce op");
}

// Integers divide as int64_t: the world size cast to uint8_t was 0 at 256
// ranks (a division by zero that ended the process) and 44 at 300.
template <class T>
void divide(void* data, size_t n, int divisor) {
  auto* p = static_cast<T*>(data);
  if constexpr (std::is_integral_v<T>) {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<int64_t>(p[i]) / divisor);
  } else {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
  }
}

}  // namespace

ReduceFn reduce_function(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32:
      return typed_function<float>(op);
    case DType::kFloat64:
      return typed_function<double>(op);
    case DType::kInt32:
      return typed_function<int32_t>(op);
    case DType::kInt64:
      return typed_function<int64_t>(op);
    case DType::kUInt8:
      return typed_function<uint8_t>(op);
    case DType::kBFloat16:
    case DType::kFloat16:
      break;
  }
  throw ConfigError(std::string("no direct reduction for ") + to_string(dtype) + "; widen to float32 first");
}

void divide_in_place(void* data, size_t count, DType dtype, int divisor) {
  switch (dtype) {
    case DType::kFloat32:
      return divide<float>(data, count, divisor);
    case DType::kFloat64:
      return divide<double>(data, count, divisor);
    case DType::kInt32:
      return divide<int32_t>(data, count, divisor);
    case DType::kInt64:
      return divide<int64_t>(data, count, divisor);
    case DType::kUInt8:
      return divide<uint8_t>(data, count, divisor);
    case DType::kBFloat16:
    case DType::kFloat16:
      break;
  }
  throw ConfigError(std::string("divide_in_place: unsupported dtype ") + to_string(dtype));
}

float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // keep NaN a quiet NaN
  }
  // Round to nearest, ties to even, on the 16 dropped bits.
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// _Float16 (GCC >= 12, Clang) does IEEE binary16 conversions with correct
// rounding; the bit pattern is what travels.
float fp16_to_float(uint16_t v) {
  _Float16 h;
  std::memcpy(&h, &v, sizeof h);
  return static_cast<float>(h);
}

uint16_t float_to_fp16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t v;
  std::memcpy(&v, &h, sizeof v);
  return v;
}

void widen_to_float(const void* in, float* out, size_t count, DType dtype) {
  auto* p = static_cast<const uint16_t*>(in);
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = bf16_to_float(p[i]);
  } else if (dtype == DType::kFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = fp16_to_float(p[i]);
  } else {
    throw ConfigError(std::string("widen_to_float: not a 16-bit float: ") + to_string(dtype));
  }
}

void narrow_from_float(const float* in, void* out, size_t count, DType dtype) {
  auto* p = static_cast<uint16_t*>(out);
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < count; ++i) p[i] = float_to_bf16(in[i]);
  } else if (dtype == DType::kFloat16) {
    for (size_t i = 0; i < count; ++i) p[i] = float_to_fp16(in[i]);
  } else {
    throw ConfigError(std::string("narrow_from_float: not a 16-bit float: ") + to_string(dtype));
  }
}

}  // namespace detail
}  // namespace troupe::collective
