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
inline constexpr char kAuthMagic[8] = {'T', 'R', 'P', 'A', 'U', 'T', 'H', '1'};

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
