// troupe.util.collective's C++ half: a member of a collective group
// (collective::join_group, so the runtime aborts it when another member
// dies) and its operations on memory the Python side names by address,
// element count and dtype. Every operation waits for its Work with the GIL
// released; the caller keeps the arrays alive until it returns.
#include "python_shim/src/py_collective.h"

#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "python_shim/src/py_client.h"
#include "troupe/config.h"
#include "troupe/runtime/collective/actor_group.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::py {
namespace {

namespace pyb = pybind11;
using collective::DType;
using collective::ReduceOp;
using Ms = std::chrono::milliseconds;

DType dtype_of(const std::string& name) {
  static const std::pair<const char*, DType> kTypes[] = {
      {"float32", DType::kFloat32},   {"float64", DType::kFloat64}, {"int32", DType::kInt32}, {"int64", DType::kInt64},
      {"bfloat16", DType::kBFloat16}, {"float16", DType::kFloat16}, {"uint8", DType::kUInt8}};
  for (const auto& [n, t] : kTypes)
    if (name == n) return t;
  throw ConfigError("collective: dtype " + name +
                    " is not one a group moves (float32, float64, int32, int64, bfloat16, float16, uint8)");
}

ReduceOp op_of(const std::string& name) {
  if (name == "SUM") return ReduceOp::kSum;
  if (name == "PRODUCT") return ReduceOp::kProduct;
  if (name == "MIN") return ReduceOp::kMin;
  if (name == "MAX") return ReduceOp::kMax;
  if (name == "AVG") return ReduceOp::kAvg;
  throw ConfigError("collective: reduce op " + name + " is not SUM, PRODUCT, MIN, MAX or AVG");
}

void* at(uintptr_t address) { return reinterpret_cast<void*>(address); }

// One member's group. close() (or the object's end) leaves the group;
// an operation after it is a ConfigError naming the group.
class PyGroup {
 public:
  explicit PyGroup(std::unique_ptr<collective::Group> group) : group_(std::move(group)) {}

  int rank() const { return live().rank(); }
  int world_size() const { return live().world_size(); }
  void close() { group_.reset(); }
  void abort(const std::string& reason) { live().abort(reason); }

  void allreduce(uintptr_t data, size_t count, const std::string& dtype, const std::string& op) {
    live().allreduce(at(data), count, dtype_of(dtype), {.op = op_of(op)})->wait();
  }
  void broadcast(uintptr_t data, size_t count, const std::string& dtype, int root) {
    check_rank(root, "source", true);
    live().broadcast(at(data), count, dtype_of(dtype), root)->wait();
  }
  void allgather(uintptr_t in, uintptr_t out, size_t count, const std::string& dtype) {
    live().allgather(at(in), at(out), count, dtype_of(dtype))->wait();
  }
  void reduce_scatter(uintptr_t in, uintptr_t out, size_t count, const std::string& dtype, const std::string& op) {
    live().reduce_scatter(at(in), at(out), count, dtype_of(dtype), {.op = op_of(op)})->wait();
  }
  void barrier() { live().barrier()->wait(); }
  void send(uintptr_t data, size_t count, const std::string& dtype, int peer, uint32_t tag) {
    check_rank(peer, "destination");
    live().send(at(data), count, dtype_of(dtype), peer, {.tag = tag})->wait();
  }
  void recv(uintptr_t data, size_t count, const std::string& dtype, int peer, uint32_t tag) {
    check_rank(peer, "source");
    live().recv(at(data), count, dtype_of(dtype), peer, {.tag = tag})->wait();
  }

 private:
  collective::Group& live() const {
    if (!group_) throw ConfigError("collective: this member has left its group (destroy_collective_group)");
    return *group_;
  }
  // A peer's rank: one of the group's, and not this member's own unless
  // `self_too` (a broadcast's source).
  void check_rank(int r, const char* what, bool self_too = false) const {
    const auto& g = live();
    if (r < 0 || r >= g.world_size() || (r == g.rank() && !self_too))
      throw ConfigError("collective group '" + g.name() + "': " + what + " rank " + std::to_string(r) + " is not " +
                        (self_too ? "one of its ranks 0.." : "another member of ranks 0..") +
                        std::to_string(g.world_size() - 1) + " (this member is rank " + std::to_string(g.rank()) + ")");
  }

  std::unique_ptr<collective::Group> group_;
};

}  // namespace

void bind_collective(pybind11::module_& m) {
  using NoGil = pyb::call_guard<pyb::gil_scoped_release>;
  m.attr("HAS_NCCL") = static_cast<bool>(TROUPE_WITH_NCCL);
  pyb::class_<PyGroup>(m, "CollectiveGroup")
      .def_property_readonly("rank", &PyGroup::rank)
      .def_property_readonly("world_size", &PyGroup::world_size)
      .def("close", &PyGroup::close, NoGil())
      .def("abort", &PyGroup::abort, NoGil())
      .def("allreduce", &PyGroup::allreduce, NoGil())
      .def("broadcast", &PyGroup::broadcast, NoGil())
      .def("allgather", &PyGroup::allgather, NoGil())
      .def("reduce_scatter", &PyGroup::reduce_scatter, NoGil())
      .def("barrier", &PyGroup::barrier, NoGil())
      .def("send", &PyGroup::send, NoGil())
      .def("recv", &PyGroup::recv, NoGil());
  m.def(
      "join_group",
      [](PyClient& client, const std::string& name, int64_t generation, int rank, int world_size,
         std::vector<uint64_t> members, const std::string& backend, int64_t rendezvous_ms, int64_t op_ms) {
        if (backend != "gloo" && backend != "nccl")
          throw ConfigError("collective: backend " + backend + " is neither gloo nor nccl");
        collective::GroupSpec spec{
            .name = name,
            .generation = generation,
            .rank = rank,
            .world_size = world_size,
            .members = std::move(members),
            .backend = backend == "nccl" ? collective::Backend::kNccl : collective::Backend::kGloo,
            .rendezvous_timeout = Ms(rendezvous_ms),
            .op_timeout = Ms(op_ms),
            // Ray's send/recv block until done, so a member's receives are
            // rarely outstanding together: the check's in-order completion
            // (GlooGroupOptions::check_point_to_point) costs them nothing.
            .check_point_to_point = true};
        return std::make_unique<PyGroup>(collective::join_group(client.runtime(), spec));
      },
      NoGil());
}

}  // namespace troupe::py
