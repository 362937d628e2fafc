// The cluster token and the HMAC-SHA256 challenge–response that every
// connection runs before its first frame. Each side sends a random nonce and
// proves knowledge of the token by the HMAC of both nonces; the token itself
// never crosses the wire.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace troupe::wire {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;
// The handshake's first bytes: "TRPAUTH" and the wire version, one
// character. Bump kWireVersion whenever a message's fields change
// (protocol.h), so that processes of two troupe versions refuse each
// other at the handshake, naming both versions, instead of failing later
// on a message one of them cannot decode. 2: WorkerExited carries the
// worker's last counters.
inline constexpr char kWireVersion = '2';
inline constexpr char kAuthMagic[8] = {'T', 'R', 'P', 'A', 'U', 'T', 'H', kWireVersion};
// "" when `magic` (8 bytes) is this version's; else why the peer is refused:
// another troupe version (naming both), or no troupe process at all.
std::string check_magic(const uint8_t* magic);

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

Nonce random_nonce();
// A new random token (hex, 64 characters).
std::string random_token();
// HMAC(token, "troupe" || role || mine || theirs): `role` is 'S' for the
// accepting side and 'C' for the connecting side, so a proof cannot be
// reflected back.
Proof make_proof(const std::string& token, char role, const Nonce& mine, const Nonce& theirs);
// Constant-time comparison.
bool proofs_equal(const Proof& a, const Proof& b);

}  // namespace troupe::wire
