#include <zlib.h>

#include <cstring>

#include "tests/fuzz/targets.h"
#include "troupe/runtime/node/worker_assignment.h"
#include "troupe/runtime/wire/frame.h"
#include "troupe/runtime/wire/protocol.h"
#include "troupe/runtime/wire/rpc.h"
#include "troupe/trainer/checkpoint_manifest.h"

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

// A version 1.0 .npy image of `n` float32 zeros, its header padded to 64
// bytes as NumPy pads it.
std::string npy_image(const std::string& shape, size_t n) {
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + dict.size() + 1) % 64 != 0) dict += ' ';
  dict += '\n';
  std::string img = "\x93NUMPY\x01";
  img += '\0';
  img += char(dict.size() & 0xff);
  img += char(dict.size() >> 8);
  return img + dict + std::string(n * 4, '\0');
}

void put16(std::string& s, uint16_t v) { s.append(reinterpret_cast<const char*>(&v), 2); }
void put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }

// A zip archive of (name, image) members as np.savez (stored) or
// np.savez_compressed (deflated) writes one.
std::string zip_archive(const std::vector<std::pair<std::string, std::string>>& members, bool compress) {
  std::string out, dir;
  for (const auto& [name, image] : members) {
    std::string data = image;
    if (compress) {
      z_stream z{};
      deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
      data.resize(deflateBound(&z, image.size()));
      z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(image.data()));
      z.avail_in = static_cast<uInt>(image.size());
      z.next_out = reinterpret_cast<Bytef*>(data.data());
      z.avail_out = static_cast<uInt>(data.size());
      deflate(&z, Z_FINISH);
      data.resize(z.total_out);
      deflateEnd(&z);
    }
    const uint32_t crc = crc32(0, reinterpret_cast<const Bytef*>(image.data()), static_cast<uInt>(image.size()));
    const uint32_t offset = static_cast<uint32_t>(out.size());
    const uint16_t method = compress ? 8 : 0;
    put32(out, 0x04034b50), put16(out, 20), put16(out, 0), put16(out, method), put32(out, 0), put32(out, crc);
    put32(out, uint32_t(data.size())), put32(out, uint32_t(image.size())), put16(out, uint16_t(name.size()));
    put16(out, 0), out += name, out += data;
    put32(dir, 0x02014b50), put16(dir, 20), put16(dir, 20), put16(dir, 0), put16(dir, method), put32(dir, 0);
    put32(dir, crc), put32(dir, uint32_t(data.size())), put32(dir, uint32_t(image.size()));
    put16(dir, uint16_t(name.size())), put16(dir, 0), put16(dir, 0), put16(dir, 0), put16(dir, 0), put32(dir, 0);
    put32(dir, offset), dir += name;
  }
  const uint32_t dir_offset = static_cast<uint32_t>(out.size());
  out += dir;
  put32(out, 0x06054b50), put16(out, 0), put16(out, 0), put16(out, uint16_t(members.size()));
  put16(out, uint16_t(members.size())), put32(out, uint32_t(dir.size())), put32(out, dir_offset), put16(out, 0);
  return out;
}

std::vector<std::string> npy_files() {
  const std::string a = npy_image("(3, 4)", 12), b = npy_image("(5,)", 5);
  const std::vector<std::pair<std::string, std::string>> members = {{"input.npy", a}, {"target.npy", b}};
  return {std::string(1, '\0') + a, std::string(1, '\0') + npy_image("()", 1), "\x01" + zip_archive(members, false),
          "\x01" + zip_archive(members, true)};
}

std::string manifest() {
  trainer::CheckpointManifest m;
  m.step = 120;
  m.epoch = 3;
  m.world_size = 2;
  m.cursor = {3, 2, 64, 16};
  m.metrics = {{"loss", 0.25}, {"accuracy", 0.9}};
  m.epoch_sums = {{"epoch", 3}, {"loss_sum", 12.5}, {"samples", 64}};
  m.files["model.pt"] = {std::string(64, 'a'), 1024};
  m.files["rng.pt"] = {std::string(64, '0'), 8};
  return trainer::manifest_text(m);
}

}  // namespace

std::vector<std::string> seeds(const std::string& target) {
  if (target == "npy") return npy_files();
  if (target == "manifest") return {manifest()};
  if (target == "frame") return frames();
  if (target == "codec") return codec_values();
  if (target == "connection") {
    std::vector<std::string> v;
    for (auto& f : frames()) v.push_back("\x01" + f);
    v.push_back(std::string("\x00", 1) + std::string(wire::kAuthMagic, 8) + std::string(32, 'n'));
    return v;
  }
  if (target == "http")
    return {"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t",
            "POST /login HTTP/1.1\r\nContent-Length: 11\r\nCookie: a=1; troupe_token=t", "token=a%2Db+c&x"};
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
