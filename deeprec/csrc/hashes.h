// The string hashes behind deeprec's feature ops, header-only (included by feature_ops.cpp).
//
//   siphash_pandas(s, len)        SipHash-2-4, key "0123456789123456", then the splitmix64
//                                 finalizer: pandas.util.hash_array(categorize=False)
//   siphash_lanes(words, n, ...)  the same for 8 strings at once, in vector lanes
//   farm_fingerprint64(s, len)    FarmHash Fingerprint64 (farmhashna::Hash64; Geoff Pike,
//                                 Google, MIT): TensorFlow's to_hash_bucket_fast
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace deeprec {
namespace hashes {

inline uint64_t load64(const uint8_t* p) {  // little-endian on every platform torch supports
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// rotl on vector lanes is always inlined into its target_clones callers, so GCC's note that a
// 512-bit vector return changes the ABI does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
template <typename T>  // uint64_t, or a vector of uint64_t lanes
__attribute__((always_inline)) inline T rotl(T x, int b) { return (x << b) | (x >> (64 - b)); }
inline uint64_t rotr(uint64_t x, int b) { return b == 0 ? x : (x >> b) | (x << (64 - b)); }

// ---- SipHash-2-4 (Aumasson & Bernstein) + splitmix64 finalizer ------------------------
constexpr uint64_t kSipK0 = 0x3736353433323130ULL;  // "01234567" little-endian
constexpr uint64_t kSipK1 = 0x3635343332313938ULL;  // "89123456"

#define SIPROUND                                                   \
  do {                                                             \
    v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);      \
    v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;                         \
    v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;                         \
    v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);      \
  } while (0)

// Word j of a string's SipHash message: its 8-byte blocks, then the tail word (the last
// len % 8 bytes with the length in the top byte).
inline uint64_t message_word(const uint8_t* s, size_t len, size_t j) {
  const size_t blocks = len / 8;
  if (j < blocks) return load64(s + 8 * j);
  uint64_t b = static_cast<uint64_t>(len) << 56;  // j == blocks: the tail word
  const uint8_t* tail = s + 8 * blocks;
  for (size_t i = 0; i < len % 8; ++i) b |= static_cast<uint64_t>(tail[i]) << (8 * i);
  return b;
}

uint64_t siphash24(const uint8_t* in, size_t len) {
  uint64_t v0 = 0x736f6d6570736575ULL ^ kSipK0, v1 = 0x646f72616e646f6dULL ^ kSipK1;
  uint64_t v2 = 0x6c7967656e657261ULL ^ kSipK0, v3 = 0x7465646279746573ULL ^ kSipK1;
  for (size_t j = 0; j <= len / 8; ++j) {
    const uint64_t m = message_word(in, len, j);
    v3 ^= m;
    SIPROUND; SIPROUND;
    v0 ^= m;
  }
  v2 ^= 0xff;
  SIPROUND; SIPROUND; SIPROUND; SIPROUND;
  return v0 ^ v1 ^ v2 ^ v3;
}

inline uint64_t splitmix64_finalize(uint64_t x) {
  x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27; x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t siphash_pandas(const uint8_t* s, size_t len) { return splitmix64_finalize(siphash24(s, len)); }

// SipHash of kLanes strings at once, as one vector of lanes (GCC vector extensions): each
// lane runs its own message words (8-byte blocks, then the length/tail word) in lockstep,
// a lane with none left keeping its state. target_clones compiles it for AVX-512 (one
// register of 8 lanes, vprolq rotates), AVX2 (two registers) and baseline x86-64, and
// picks the widest the CPU has when the library loads. Same values as siphash_pandas.
constexpr int kLanes = 8;
typedef uint64_t Lanes __attribute__((vector_size(8 * kLanes)));

// words[j] holds lane l's j-th message word; lane l has nwords[l] of them. The words were
// written by a separate pass over many groups, so these vector loads do not stall on
// store forwarding from scalar stores just made.
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void siphash_lanes(const uint64_t (*words)[kLanes], const uint64_t* nwords, size_t max_words, uint64_t* out) {
  const Lanes k0 = Lanes{} + kSipK0, k1 = Lanes{} + kSipK1;
  Lanes v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
  Lanes v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
  Lanes count;
  std::memcpy(&count, nwords, sizeof(count));
  bool uniform = true;
  for (int l = 1; l < kLanes; ++l) uniform = uniform && nwords[l] == nwords[0];
  for (size_t j = 0; j < max_words; ++j) {
    Lanes m;
    std::memcpy(&m, words[j], sizeof(m));
    const Lanes w0 = v0, w1 = v1, w2 = v2, w3 = v3;
    v3 ^= m;
    SIPROUND;
    SIPROUND;
    v0 ^= m;
    if (!uniform) {  // lanes whose words are used up keep their state
      const Lanes on = (Lanes)((Lanes{} + j) < count);
      v0 = (v0 & on) | (w0 & ~on); v1 = (v1 & on) | (w1 & ~on);
      v2 = (v2 & on) | (w2 & ~on); v3 = (v3 & on) | (w3 & ~on);
    }
  }
  v2 ^= 0xff;
  SIPROUND; SIPROUND; SIPROUND; SIPROUND;
  Lanes h = v0 ^ v1 ^ v2 ^ v3;
  h ^= h >> 30; h *= 0xbf58476d1ce4e5b9ULL;  // splitmix64_finalize
  h ^= h >> 27; h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  std::memcpy(out, &h, sizeof(h));
}
#undef SIPROUND

// ---- FarmHash Fingerprint64 (Geoff Pike, Google; MIT) -----------------------------------
constexpr uint64_t kF0 = 0xc3a5c85c97cb3127ULL, kF1 = 0xb492b66fbe98f273ULL, kF2 = 0x9ae16a3b2f90404fULL;
inline uint64_t shift_mix(uint64_t v) { return v ^ (v >> 47); }
inline uint64_t hash_len16(uint64_t u, uint64_t v, uint64_t mul) {
  uint64_t a = shift_mix((u ^ v) * mul);
  uint64_t b = shift_mix((v ^ a) * mul);
  return b * mul;
}
struct Pair { uint64_t first, second; };
inline Pair weak_hash32(const uint8_t* s, uint64_t a, uint64_t b) {
  uint64_t w = load64(s), x = load64(s + 8), y = load64(s + 16), z = load64(s + 24);
  a += w;
  b = rotr(b + a + z, 21);
  uint64_t c = a;
  a += x + y;
  b += rotr(a, 44);
  return {a + z, b + c};
}

uint64_t farm_len0to16(const uint8_t* s, size_t len) {
  if (len >= 8) {
    uint64_t mul = kF2 + len * 2, a = load64(s) + kF2, b = load64(s + len - 8);
    return hash_len16(rotr(b, 37) * mul + a, (rotr(a, 25) + b) * mul, mul);
  }
  if (len >= 4) {
    uint64_t mul = kF2 + len * 2;
    return hash_len16(len + (static_cast<uint64_t>(load32(s)) << 3), load32(s + len - 4), mul);
  }
  if (len > 0) {
    uint32_t y = static_cast<uint32_t>(s[0]) + (static_cast<uint32_t>(s[len >> 1]) << 8);
    uint32_t z = static_cast<uint32_t>(len) + (static_cast<uint32_t>(s[len - 1]) << 2);
    return shift_mix(y * kF2 ^ z * kF0) * kF2;
  }
  return kF2;
}

uint64_t farm_len17to32(const uint8_t* s, size_t len) {
  uint64_t mul = kF2 + len * 2, a = load64(s) * kF1, b = load64(s + 8);
  uint64_t c = load64(s + len - 8) * mul, d = load64(s + len - 16) * kF2;
  return hash_len16(rotr(a + b, 43) + rotr(c, 30) + d, a + rotr(b + kF2, 18) + c, mul);
}

uint64_t farm_len33to64(const uint8_t* s, size_t len) {
  uint64_t mul = kF2 + len * 2, a = load64(s) * kF2, b = load64(s + 8);
  uint64_t c = load64(s + len - 8) * mul, d = load64(s + len - 16) * kF2;
  uint64_t y = rotr(a + b, 43) + rotr(c, 30) + d;
  uint64_t z = hash_len16(y, a + rotr(b + kF2, 18) + c, mul);
  uint64_t e = load64(s + 16) * mul, f = load64(s + 24);
  uint64_t g = (y + load64(s + len - 32)) * mul, h = (z + load64(s + len - 24)) * mul;
  return hash_len16(rotr(e + f, 43) + rotr(g, 30) + h, e + rotr(f + a, 18) + g, mul);
}

uint64_t farm_fingerprint64(const uint8_t* s, size_t len) {
  if (len <= 16) return farm_len0to16(s, len);
  if (len <= 32) return farm_len17to32(s, len);
  if (len <= 64) return farm_len33to64(s, len);
  const uint64_t seed = 81;
  uint64_t x = seed, y = seed * kF1 + 113, z = shift_mix(y * kF2 + 113) * kF2;
  Pair v{0, 0}, w{0, 0};
  x = x * kF2 + load64(s);
  const uint8_t* end = s + ((len - 1) / 64) * 64;
  const uint8_t* last64 = end + ((len - 1) & 63) - 63;
  do {
    x = rotr(x + y + v.first + load64(s + 8), 37) * kF1;
    y = rotr(y + v.second + load64(s + 48), 42) * kF1;
    x ^= w.second;
    y += v.first + load64(s + 40);
    z = rotr(z + w.first, 33) * kF1;
    v = weak_hash32(s, v.second * kF1, x + w.first);
    w = weak_hash32(s + 32, z + w.second, y + load64(s + 16));
    std::swap(z, x);
    s += 64;
  } while (s != end);
  uint64_t mul = kF1 + ((z & 0xff) << 1);
  s = last64;
  w.first += ((len - 1) & 63);
  v.first += w.first;
  w.first += v.first;
  x = rotr(x + y + v.first + load64(s + 8), 37) * mul;
  y = rotr(y + v.second + load64(s + 48), 42) * mul;
  x ^= w.second * 9;
  y += v.first * 9 + load64(s + 40);
  z = rotr(z + w.first, 33) * mul;
  v = weak_hash32(s, v.second * mul, x + w.first);
  w = weak_hash32(s + 32, z + w.second, y + load64(s + 16));
  std::swap(z, x);
  return hash_len16(hash_len16(v.first, w.first, mul) + shift_mix(y) * kF0 + z,
                    hash_len16(v.second, w.second, mul) + x, mul);
}

}  // namespace hashes
}  // namespace deeprec
