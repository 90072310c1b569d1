// bf16, int4 and int8 weight x bf16 input products for decode-sized inputs, on AVX512-BF16, on AVX-512 without
// it, where vdpbf16ps and vcvtneps2bf16 are spelled in AVX-512F/BW instructions (``dpbf16``, ``to_bf16``; built
// without -mavx512bf16), or on AVX2 + FMA (built without -mavx512f): bf16 in the same arithmetic on two 8-lane
// halves, int4 / int8 codes widened to fp32 and multiplied in one FMA each (the same layouts).
// runtime/cpu_ops.py builds them; runtime/packed_linear.py and quant/gemv.py pack weights.
//
// bf16_gemv: plain bf16 weights. Layout: per block of 16 rows and per pair of columns (k, k+1), 64 bytes: bf16
// 2i + e = w[row i, k + e], so one load is a vector of 16 (k, k+1) pairs and one vdpbf16ps consumes it.
//
// int4_gemv: each weight w = (u - 8) * s + t with u in 0..15 and per-(row, group) bf16 (s, t), as torch's
// int4pack kernel reads them. A nibble u becomes the exact bf16 128 + u by OR-ing it into 0x4300, so one
// vdpbf16ps multiplies 32 weights by 32 inputs with no conversion; per group
//     sum_k w_k x_k = s * sum_k (128 + u_k) x_k + (t - 136 s) * sum_k x_k.
// Lanes are output rows (16 per block), so scales apply as vectors and no horizontal sums are needed.
//
// Layout, per block of 16 rows and per group: s[16] bf16, t[16] bf16, then group_size / 32 chunks of 8 x 32
// bytes. Byte 2i + e of piece p (of chunk c) holds row i's codes at k = 32c + 4p + e (low nibble) and
// 32c + 4p + 2 + e (high nibble), so one zero-extending load gives two vectors of (k, k+1) pairs per lane.
//
// int8_gemv: per-channel symmetric int8 w = (u - 128) * s with u = w + 128 in 0..255 split into nibbles
// u = 16 h + l, each made bf16 as above: sum_k w_k x_k = s * (16 sum (128 + h) x + sum (128 + l) x - 2304 sum x).
// Layout: per block of 16 rows and per pair of columns (k, k+1), 32 bytes: byte 2i + e = u[row i, k + e].
//
// Every output row runs the same instruction sequence whatever the number of rows processed beside it, so a
// row's result is bitwise the same alone as in a batch (speculative verification relies on that).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int kRows = 16;  // output rows per block (one vector of 16 fp32 lanes)

#ifdef __AVX512F__
// One vector: 16 fp32 lanes (VF), or the 512 bits of 32 bf16 / 64 bytes (VI); rows i = lane i.
using VF = __m512;
using VI = __m512i;
constexpr int kMaxRows = 8;   // input rows per tile: a verification of up to 8 tokens unpacks each weight once
constexpr int kMaxRows8 = 6;  // int8's: four accumulators a row, in 32 vector registers
constexpr int kMaxRows4 = kMaxRows;
constexpr bool kFloatX = false;  // the int tiles read x as bf16

inline VF zero() { return _mm512_setzero_ps(); }
inline VF set1(float v) { return _mm512_set1_ps(v); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline float hsum(VF v) { return _mm512_reduce_add_ps(v); }
inline VI load(const void* p) { return _mm512_loadu_si512(p); }
inline VI set1_32(int32_t v) { return _mm512_set1_epi32(v); }

inline VF bf16_to_fp32(const void* p) {  // 16 bf16 -> 16 fp32
  __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#ifdef __AVX512BF16__
inline VF dpbf16(VF acc, VI a, VI b) {  // acc += pairwise products of 32 bf16 each
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline __m256i to_bf16(VF v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
// vdpbf16ps's arithmetic in two FMAs a lane, the odd element of each pair first, then the even one (a bf16 is the
// top half of an fp32, and a product of two is exact in fp32).
inline VF dpbf16(VF acc, VI a, VI b) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, top)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, top)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}

// fp32 -> bf16 rounded to nearest even, as vcvtneps2bf16 (a NaN stays a NaN).
inline __m256i to_bf16(VF v) {
  const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// 32 packed bytes -> 128 + (low nibble), 128 + (high nibble) of each, as two vectors of 32 bf16.
inline void nibbles(const uint8_t* piece, VI& lo, VI& hi) {
  const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece)));
  lo = _mm512_ternarylogic_epi32(u, mask, bias, 0xEA);  // (u & 0xF) | 0x4300
  hi = _mm512_or_si512(_mm512_srli_epi16(u, 4), bias);
}
#else
// AVX2 + FMA: the same vectors as pairs of 8-lane halves (rows 0-7, rows 8-15), so the packed layouts and the bf16
// kernel are one for both ISAs; the int tiles widen codes to fp32 instead (fewer instructions than emulated
// vdpbf16ps). 16 vector registers: fewer input rows share a pass over a block.
struct VF { __m256 a, b; };
struct VI { __m256i a, b; };
constexpr int kMaxRows = 2;
constexpr int kMaxRows8 = 1;
constexpr int kMaxRows4 = 1;
constexpr bool kFloatX = true;  // the int tiles read x in fp32

inline VF zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline VF fma(VF x, VF y, VF c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
inline VF add(VF x, VF y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline VF mul(VF x, VF y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline float hsum(VF v) {
  __m256 s = _mm256_add_ps(v.a, v.b);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
inline VI load(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
inline VI set1_32(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }

inline __m256 widen(__m128i h) {  // 8 bf16 -> 8 fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline VF bf16_to_fp32(const void* p) {
  const __m128i* h = static_cast<const __m128i*>(p);
  return {widen(_mm_loadu_si128(h)), widen(_mm_loadu_si128(h + 1))};
}

inline __m256 dp_half(__m256 acc, __m256i a, __m256i b) {  // as the AVX-512 dpbf16 below, on 8 lanes
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, top)),
                        _mm256_castsi256_ps(_mm256_and_si256(b, top)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
}

// vdpbf16ps's arithmetic, the odd element of each pair first, then the even one.
inline VF dpbf16(VF acc, VI x, VI y) { return {dp_half(acc.a, x.a, y.a), dp_half(acc.b, x.b, y.b)}; }

inline __m256i round_half(__m256 v) {  // fp32 -> bf16 (rounded to nearest even, a NaN stays a NaN) in 32-bit lanes
  const __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

inline __m256i to_bf16(VF v) {  // 16 lanes -> 16 bf16 in row order
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(round_half(v.a), round_half(v.b)), 0xD8);
}

#endif

inline VI pair(const at::BFloat16* x) {  // (x[k], x[k+1]) in every lane
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return set1_32(v);
}

inline void store(at::BFloat16* y, VF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), to_bf16(v));
}

struct Args {
  const at::BFloat16* x;  // [M, K]
  const float* xf;        // [M, K] x in fp32 (AVX2's int tiles only)
  const float* sumx;      // [M, groups]: each row's input summed per group, in one fixed order
  const uint8_t* w;       // packed weight
  const at::BFloat16* scales;  // int8: [N]
  at::BFloat16* y;        // [M, N]
  int64_t K, N, groups, group_size, block_bytes;
};

#ifdef __AVX512F__
// int4: rows [m0, m0 + R) of x times block b of the packed weight.
template <int R>
void tile4(const Args& a, int64_t m0, int64_t b) {
  const int64_t chunks = a.group_size / 32, group_bytes = 64 + chunks * 256;
  const at::BFloat16* x = a.x + m0 * a.K;
  const uint8_t* block = a.w + b * a.block_bytes;
  VF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* head = block + g * group_bytes;
    VF t0[R], t1[R];
    for (int r = 0; r < R; ++r) t0[r] = t1[r] = zero();
    for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const int64_t k = g * a.group_size + c * 32 + 4 * p;
        VI lo, hi;
        nibbles(head + 64 + (c * 8 + p) * 32, lo, hi);
        for (int r = 0; r < R; ++r) {
          t0[r] = dpbf16(t0[r], lo, pair(x + r * a.K + k));
          t1[r] = dpbf16(t1[r], hi, pair(x + r * a.K + k + 2));
        }
      }
    }
    VF s = bf16_to_fp32(head), t = bf16_to_fp32(head + 32);
    VF offset = fma(set1(-136.0f), s, t);
    for (int r = 0; r < R; ++r) {
      acc[r] = fma(add(t0[r], t1[r]), s, acc[r]);
      acc[r] = fma(offset, set1(a.sumx[(m0 + r) * a.groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(a.y + (m0 + r) * a.N + b * kRows, acc[r]);
}
#else
// int4 on AVX2, as int8's tile: codes widened to exact fp32, one FMA each, eight accumulators (half, code of the
// lane's 16 bits); per group sum_k w_k x_k = s * sum_k u_k x_k + (t - 8 s) * sum x. One row a pass.
template <int R>
void tile4(const Args& a, int64_t m0, int64_t b) {
  static_assert(R == 1, "one row a pass: the accumulators fill the 16 registers");
  const int64_t chunks = a.group_size / 32, group_bytes = 64 + chunks * 256;
  const float* x = a.xf + m0 * a.K;
  const uint8_t* block = a.w + b * a.block_bytes;
  const __m256i nibble = _mm256_set1_epi32(0xF);
  VF acc = zero();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* head = block + g * group_bytes;
    __m256 t[2][4];
    for (auto& half : t)
      for (auto& v : half) v = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 4
      for (int p = 0; p < 8; ++p) {
        // lane i's 16 bits: codes at k (bits 0-3), k + 2, k + 1, k + 3 (bytes 2i and 2i + 1 of the piece)
        const float* xk = x + g * a.group_size + c * 32 + 4 * p;
        const __m256 x0 = _mm256_broadcast_ss(xk), x2 = _mm256_broadcast_ss(xk + 2);
        const __m256 x1 = _mm256_broadcast_ss(xk + 1), x3 = _mm256_broadcast_ss(xk + 3);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 64 + (c * 8 + p) * 32 + 16 * h)));
          t[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)), x0, t[h][0]);
          t[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), nibble)), x2, t[h][1]);
          t[h][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), nibble)), x1, t[h][2]);
          t[h][3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12)), x3, t[h][3]);
        }
      }
    }
    VF sum;
    sum.a = _mm256_add_ps(_mm256_add_ps(t[0][0], t[0][1]), _mm256_add_ps(t[0][2], t[0][3]));
    sum.b = _mm256_add_ps(_mm256_add_ps(t[1][0], t[1][1]), _mm256_add_ps(t[1][2], t[1][3]));
    VF s = bf16_to_fp32(head), offset = fma(set1(-8.0f), s, bf16_to_fp32(head + 32));
    acc = fma(sum, s, acc);
    acc = fma(offset, set1(a.sumx[m0 * a.groups + g]), acc);
  }
  store(a.y + m0 * a.N + b * kRows, acc);
}
#endif

#ifdef __AVX512F__
// int8: the same over per-channel int8 weights (one group: the whole row). Four accumulators per row (column pairs
// k = 0, 4, 8, ... and k = 2, 6, 10, ..., low and high nibbles): with two, one row waited on vdpbf16ps's latency
// (one row took 1.07-1.22x as long on the default model's shapes, AMD EPYC Genoa); so at most six rows share a pass.
template <int R>
void tile8(const Args& a, int64_t m0, int64_t b) {
  const at::BFloat16* x = a.x + m0 * a.K;
  const uint8_t* block = a.w + b * a.block_bytes;
  VF low0[R], high0[R], low1[R], high1[R];
  for (int r = 0; r < R; ++r) low0[r] = high0[r] = low1[r] = high1[r] = zero();
#pragma GCC unroll 2
  for (int64_t k = 0; k < a.K; k += 4) {
    VI lo0, hi0, lo1, hi1;
    nibbles(block + k * kRows, lo0, hi0);
    nibbles(block + (k + 2) * kRows, lo1, hi1);
    for (int r = 0; r < R; ++r) {
      const VI x0 = pair(x + r * a.K + k), x1 = pair(x + r * a.K + k + 2);
      low0[r] = dpbf16(low0[r], lo0, x0);
      high0[r] = dpbf16(high0[r], hi0, x0);
      low1[r] = dpbf16(low1[r], lo1, x1);
      high1[r] = dpbf16(high1[r], hi1, x1);
    }
  }
  VF s = bf16_to_fp32(a.scales + b * kRows);
  for (int r = 0; r < R; ++r) {
    const VF high = add(high0[r], high1[r]), low = add(low0[r], low1[r]);
    VF v = fma(high, set1(16.0f), low);
    v = fma(set1(-2304.0f), set1(a.sumx[m0 + r]), v);
    store(a.y + (m0 + r) * a.N + b * kRows, mul(v, s));
  }
}
#else
// int8 on AVX2: a code u = w + 128 widens to an exact fp32 and meets its input in one FMA, fewer instructions than
// its two nibbles in emulated vdpbf16ps; sum_k w_k x_k = s * (sum_k u_k x_k - 128 sum x). One row a pass: eight
// accumulators (half, k mod 4), so no FMA waits on the one before it.

template <int R>
void tile8(const Args& a, int64_t m0, int64_t b) {
  static_assert(R == 1, "one row a pass: the accumulators fill the 16 registers");
  const float* x = a.xf + m0 * a.K;
  const uint8_t* block = a.w + b * a.block_bytes;
  const __m256i byte = _mm256_set1_epi32(0xFF);
  __m256 acc[2][4];
  for (auto& half : acc)
    for (auto& v : half) v = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < a.K; k += 4) {
    for (int j = 0; j < 2; ++j) {  // the column pair (k + 2j, k + 2j + 1): 32 bytes, byte 2i + e = u[row i, k + 2j + e]
      const __m256 x0 = _mm256_broadcast_ss(x + k + 2 * j), x1 = _mm256_broadcast_ss(x + k + 2 * j + 1);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (k + 2 * j) * kRows + 16 * h)));
        acc[h][2 * j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, byte)), x0, acc[h][2 * j]);
        acc[h][2 * j + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 8)), x1, acc[h][2 * j + 1]);
      }
    }
  }
  const __m256 offset = _mm256_set1_ps(-128.0f * a.sumx[m0]);
  VF v;
  v.a = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0][0], acc[0][1]), _mm256_add_ps(acc[0][2], acc[0][3])), offset);
  v.b = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[1][0], acc[1][1]), _mm256_add_ps(acc[1][2], acc[1][3])), offset);
  store(a.y + m0 * a.N + b * kRows, mul(v, bf16_to_fp32(a.scales + b * kRows)));
}
#endif

// bf16: two accumulators per row (pairs k = 0, 4, 8, ... and k = 2, 6, 10, ...), whatever R is.
template <int R>
void tile16(const Args& a, int64_t m0, int64_t b) {
  const at::BFloat16* x = a.x + m0 * a.K;
  const uint8_t* block = a.w + b * a.block_bytes;
  VF even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = zero();
#pragma GCC unroll 4
  for (int64_t k = 0; k < a.K; k += 4) {
    const VI w0 = load(block + k * 32);
    const VI w1 = load(block + k * 32 + 64);
    for (int r = 0; r < R; ++r) {
      even[r] = dpbf16(even[r], w0, pair(x + r * a.K + k));
      odd[r] = dpbf16(odd[r], w1, pair(x + r * a.K + k + 2));
    }
  }
  for (int r = 0; r < R; ++r) store(a.y + (m0 + r) * a.N + b * kRows, add(even[r], odd[r]));
}

using TileFn = void (*)(const Args&, int64_t, int64_t);

template <template <int> class Tile, int... R>
TileFn for_rows(int64_t rows, std::integer_sequence<int, R...>) {
  TileFn fns[] = {Tile<R + 1>::run...};
  return fns[std::min<int64_t>(rows, sizeof...(R)) - 1];
}

template <int R> struct Int4 { static void run(const Args& a, int64_t m, int64_t b) { tile4<R>(a, m, b); } };
template <int R> struct Bf16 { static void run(const Args& a, int64_t m, int64_t b) { tile16<R>(a, m, b); } };
template <int R> struct Int8 { static void run(const Args& a, int64_t m, int64_t b) { tile8<R>(a, m, b); } };

// Every block of 16 output rows for every input row, up to MaxRows input rows per pass over a block's weights.
// (On AMD EPYC Genoa one block at a time streamed faster than two or four interleaved.)
template <template <int> class Tile, int MaxRows = kMaxRows>
at::Tensor run(const at::Tensor& x_in, const at::Tensor& packed, const at::BFloat16* scales, int64_t group_size,
               int64_t out_features, int64_t block_bytes, bool group_sums = true) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "gemv: x must be 2-D bf16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "gemv: packed must be contiguous uint8");
  TORCH_CHECK(out_features % kRows == 0, "gemv: N % 16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = out_features / kRows;
  TORCH_CHECK(K % group_size == 0 && packed.numel() == blocks * block_bytes, "gemv: packed size mismatch");
  at::Tensor y = at::empty({M, out_features}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  std::vector<float> sumx(group_sums ? M * (K / group_size) : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(sumx.size()); ++i) {
    VF s = zero();
    for (int64_t k = 0; k < group_size; k += 16) s = add(s, bf16_to_fp32(xp + i * group_size + k));
    sumx[i] = hsum(s);
  }
  std::vector<float> xf(kFloatX && group_sums ? M * K : 0);  // AVX2's int tiles read x in fp32
  for (int64_t i = 0; i < static_cast<int64_t>(xf.size()); ++i) xf[i] = static_cast<float>(xp[i]);
  const Args a{xp, xf.data(), sumx.data(), packed.data_ptr<uint8_t>(), scales, y.data_ptr<at::BFloat16>(),
               K, out_features, K / group_size, group_size, block_bytes};
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t m = 0; m < M; m += MaxRows)
        for_rows<Tile>(M - m, std::make_integer_sequence<int, MaxRows>())(a, m, b);
  });
  return y;
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.size(1) % 4 == 0, "bf16_gemv: K % 4");
  return run<Bf16>(x, packed.view(at::kByte), nullptr, x.size(1), out_features, kRows * x.size(1) * 2, false);
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, int64_t out_features) {
  TORCH_CHECK(group_size % 32 == 0, "int4_gemv: group_size % 32");
  const int64_t groups = x.size(1) / group_size, block_bytes = groups * (64 + group_size * 8);
  return run<Int4, kMaxRows4>(x, packed, nullptr, group_size, out_features, block_bytes);
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "int8_gemv: scales must be bf16");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "int8_gemv: K % 32");
  return run<Int8, kMaxRows8>(x, packed, scales.data_ptr<at::BFloat16>(), K, scales.numel(), kRows * K);
}

}  // namespace

TORCH_LIBRARY(quantspec, m) {
  m.def("bf16_gemv(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor packed, int group_size, int out_features) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec, CPU, m) {
  m.impl("bf16_gemv", &bf16_gemv);
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8_gemv", &int8_gemv);
}
