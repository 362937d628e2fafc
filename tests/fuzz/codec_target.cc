#include <array>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>

#include "tests/fuzz/targets.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/node/worker_assignment.h"
#include "troupe/runtime/wire/codec.h"
#include "troupe/runtime/wire/protocol.h"

namespace troupe::fuzz {

namespace {

// What a decoded value encodes to must decode to the same encoding: no
// value is read differently from how it was written.
template <class T>
void round_trip(const T& v) {
  wire::Encoder first = wire::encode_value(v);
  T again = wire::decode_value<T>(first.bytes().data(), first.bytes().size(), &first.attachments());
  wire::Encoder second = wire::encode_value(again);
  if (first.bytes() != second.bytes()) std::abort();
}

// `Check` false for types whose encoding follows an unspecified order (an
// unordered_map iterates differently once rebuilt).
template <class T, bool Check = true>
void decode_as(const uint8_t* data, size_t size, const std::vector<Buffer>& attachments) {
  T v;
  try {
    v = wire::decode_value<T>(data, size, &attachments);
  } catch (const troupe::Error&) {
    return;
  }
  if constexpr (Check) round_trip(v);
}

using Decode = void (*)(const uint8_t*, size_t, const std::vector<Buffer>&);

// Every body the control plane decodes, then the built-in argument types.
constexpr Decode kTypes[] = {
    decode_as<wire::Hello>,
    decode_as<wire::HelloReply>,
    decode_as<wire::ActorSpec>,
    decode_as<wire::ActorInfo>,
    decode_as<wire::ActorReady>,
    decode_as<wire::ActorInitFailed>,
    decode_as<wire::SpawnWorker>,
    decode_as<wire::KillWorker>,
    decode_as<wire::WorkerExited>,
    decode_as<wire::KillActor>,
    decode_as<wire::PlacementGroupSpec>,
    decode_as<wire::PlacementGroupInfo>,
    decode_as<wire::WaitPlacementGroup>,
    decode_as<wire::KvEntry>,
    decode_as<wire::KvWait>,
    decode_as<wire::KvAdd>,
    decode_as<std::vector<wire::NodeInfo>>,
    decode_as<wire::NodeHeartbeat>,
    decode_as<wire::NodeFenced>,
    decode_as<wire::StatusRequest>,
    decode_as<wire::ControlRequest>,
    decode_as<node::WorkerAssignment>,
    decode_as<std::optional<std::string>>,
    decode_as<bool>,
    decode_as<std::tuple<int32_t, double, bool>>,
    decode_as<std::string>,
    decode_as<Buffer>,
    decode_as<std::vector<float>>,
    decode_as<std::vector<std::string>>,
    decode_as<std::map<std::string, double>>,
    decode_as<std::unordered_map<std::string, int64_t>, false>,
    decode_as<std::set<int64_t>>,
    decode_as<std::pair<std::string, std::vector<int32_t>>>,
    decode_as<std::array<uint16_t, 3>>,
    decode_as<std::vector<std::optional<Buffer>>>,
};

}  // namespace

int codec_target(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const std::vector<Buffer> attachments = {Buffer::copy("attached", 8), Buffer::copy("", 0)};
  kTypes[data[0] % std::size(kTypes)](data + 1, size - 1, attachments);
  return 0;
}

}  // namespace troupe::fuzz
