#include "troupe/runtime/wire/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "troupe/runtime/core/errors.h"

namespace troupe::wire {

Nonce random_nonce() {
  Nonce n;
  if (RAND_bytes(n.data(), n.size()) != 1) throw Error("RAND_bytes failed");
  return n;
}

std::string check_magic(const uint8_t* magic) {
  if (std::memcmp(magic, kAuthMagic, 8) == 0) return "";
  if (std::memcmp(magic, kAuthMagic, 7) == 0) {
    const char theirs = static_cast<char>(magic[7]);
    const bool printable = theirs >= '!' && theirs <= '~';
    return std::string("peer speaks troupe wire version ") +
           (printable ? std::string(1, theirs) : "byte " + std::to_string(magic[7])) + ", this process version " +
           kWireVersion + ": every process of a cluster must run the same troupe version";
  }
  return "peer did not speak the troupe protocol";
}

std::string random_token() {
  Nonce n = random_nonce();
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : n) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

Proof make_proof(const std::string& token, char role, const Nonce& mine, const Nonce& theirs) {
  std::string data = "troupe";
  data += role;
  data.append(reinterpret_cast<const char*>(mine.data()), mine.size());
  data.append(reinterpret_cast<const char*>(theirs.data()), theirs.size());
  Proof p;
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
            reinterpret_cast<const unsigned char*>(data.data()), data.size(), p.data(), &len) ||
      len != p.size())
    throw Error("HMAC failed");
  return p;
}

bool proofs_equal(const Proof& a, const Proof& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace troupe::wire
