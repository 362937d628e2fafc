#include <cstring>

#include "tests/fuzz/targets.h"
#include "troupe/runtime/node/worker_assignment.h"
#include "troupe/runtime/wire/frame.h"
#include "troupe/runtime/wire/protocol.h"
#include "troupe/runtime/wire/rpc.h"

namespace troupe::fuzz {

namespace {

std::string frame_bytes(const wire::Message& m) {
  wire::OutFrame f = wire::encode_frame(m);
  std::string s(reinterpret_cast<const char*>(f.head.data()), f.head.size());
  for (const auto& a : f.attachments) s.append(reinterpret_cast<const char*>(a.data()), a.size());
  return s;
}

std::vector<std::string> frames() {
  wire::Hello h;
  h.role = wire::Role::kNode;
  h.resources = {{"CPU", 2}};
  h.hostname = "host";
  wire::Message hello = wire::make_event_value(wire::Op::kHello, h);
  hello.kind = wire::Kind::REQUEST;
  hello.id = 1;
  wire::Message with_attachment = wire::make_event(wire::Op::kCreateActor, "body");
  with_attachment.attachments.push_back(Buffer::copy("0123456789abcdef", 16));
  wire::Message error = wire::error_response(7, troupe::ConfigError("bad value"));
  return {frame_bytes(hello), frame_bytes(with_attachment), frame_bytes(error),
          frame_bytes(hello) + frame_bytes(error)};
}

template <class T>
std::string tagged(uint8_t tag, const T& v) {
  return std::string(1, char(tag)) + wire::encode_value(v).bytes();
}

std::vector<std::string> codec_values() {
  wire::ActorSpec spec;
  spec.class_name = "Counter";
  spec.resources = {{"CPU", 1}};
  spec.env = {"A=1"};
  wire::ActorInfo info;
  info.class_name = "Counter";
  info.gpu_ids = {0, 1};
  node::WorkerAssignment a{1, 2, 3, {0}, {"CUDA_VISIBLE_DEVICES=0"}, "Counter"};
  return {tagged(0, wire::Hello{}),
          tagged(2, spec),
          tagged(3, info),
          tagged(21, a),
          tagged(23, true),
          tagged(24, std::tuple<int32_t, double, bool>{1, 2.5, false}),
          tagged(29, std::map<std::string, double>{{"CPU", 1}})};
}

}  // namespace

std::vector<std::string> seeds(const std::string& target) {
  if (target == "frame") return frames();
  if (target == "codec") return codec_values();
  if (target == "connection") {
    std::vector<std::string> v;
    for (auto& f : frames()) v.push_back("\x01" + f);
    v.push_back(std::string("\x00", 1) + std::string(wire::kAuthMagic, 8) + std::string(32, 'n'));
    return v;
  }
  if (target == "kv") {
    std::string put_then_add(
        "\x00\x00\x02"
        "41\x01\x00\x05\x00\x00\x00\x00\x00\x00\x00\x02\x00",
        16);
    return {put_then_add};
  }
  return {};
}

}  // namespace troupe::fuzz
