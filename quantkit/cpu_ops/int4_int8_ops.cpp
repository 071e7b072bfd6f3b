// A 4-bit or 8-bit linear's product on integer dot products: every decode step, speculative verification
// and, on CPUs without AMX, prefill of the int4 linears (kernels/linear/int4.py), and the int8 LM head's
// decode (kernels/linear/int8.py). The activations are quantized to int8 per row and weight group
// (symmetric: alpha = max|x| / 127, rounded to nearest even) and each group's products with the
// weight's unsigned codes are summed exactly in int32 (VPDPBUSD: unsigned codes times signed
// activations, 64 per instruction), then scaled in float32:
//   y[m, n] = sum_g alpha[m, g] * (s[g, n] * D[m, n, g] + S[m, g] * (z[g, n] - mid s[g, n]))
// with w = (q - mid) s + z (mid = 8 for 4-bit codes, 128 for 8-bit ones), D the integer dot product of
// a group and S the sum of its int8 activations, as llama.cpp's Q4_0 x Q8_0 dot products do (there on
// blocks of 32).
//
// The codes are stored in the order the instruction reads them (int4_layout and int8_layout in
// kernels/linear/): panels of 64 output rows; in a panel, for every 8 input columns, 256 bytes (4-bit)
// where byte 4 r + c holds row r's code of column c in its low nibble and of column c + 4 in its high
// nibble, or 512 bytes (8-bit): the first 256 hold column c's code at byte 4 r + c, the next 256 column
// c + 4's. One 64-byte load, an AND and a shift (or two loads) give two vectors of 16 rows x 4 codes,
// each row's 4 codes one 32-bit lane, so a decode step does ~3 vector operations per 64 codes beside
// the dot products and reads its bytes near the memory's speed (PyTorch's packed int4 and int8 kernels,
// which these replaced, convert every code to float).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

using torch::Tensor;

namespace int4_int8 {

constexpr int64_t kPanel = 64;         // output rows per panel
constexpr int64_t kHalfStep = 256;     // one panel's 4 columns of 8-bit codes
constexpr uint32_t kHighHalf = 0xFFFF0000u;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
using IntVec = __m512i;
using FloatVec = __m512;
inline IntVec load_int(const void* p) { return _mm512_loadu_si512(p); }
inline IntVec zero_int() { return _mm512_setzero_si512(); }
inline IntVec low_nibbles(IntVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline IntVec high_nibbles(IntVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline IntVec broadcast_word(const int8_t* p) { int32_t w; std::memcpy(&w, p, 4); return _mm512_set1_epi32(w); }
#define INT4_INT8_DPBUSD 1  // dot_add below: one instruction per 64 products
inline IntVec dpbusd(IntVec acc, IntVec codes, IntVec a) { return _mm512_dpbusd_epi32(acc, codes, a); }
inline FloatVec low_bf16(IntVec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline FloatVec high_bf16(IntVec v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(kHighHalf)))); }
inline FloatVec to_float(IntVec v) { return _mm512_cvtepi32_ps(v); }
inline FloatVec load_float(const float* p) { return _mm512_loadu_ps(p); }
inline FloatVec broadcast_float(float v) { return _mm512_set1_ps(v); }
inline FloatVec fmadd(FloatVec a, FloatVec b, FloatVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FloatVec mul(FloatVec a, FloatVec b) { return _mm512_mul_ps(a, b); }
inline void store_float(float* p, FloatVec v) { _mm512_storeu_ps(p, v); }
constexpr int kRowsPerTile = 4;  // 4 rows x 4 accumulators, 8 broadcasts, 3 for the codes
constexpr bool kPartialTilesByRow = false;  // a tile of any rows covers the whole panel
template <int Rows>
constexpr int kVectors = 4;      // accumulators per row of a tile of Rows rows
template <int Rows>
constexpr int kSteps = 1;        // 8-column steps per call of dot_add
#elif defined(__AVX2__)
constexpr int kLanes = 8;
using IntVec = __m256i;
using FloatVec = __m256;
inline IntVec load_int(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline IntVec zero_int() { return _mm256_setzero_si256(); }
inline IntVec low_nibbles(IntVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline IntVec high_nibbles(IntVec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline IntVec broadcast_word(const int8_t* p) { int32_t w; std::memcpy(&w, p, 4); return _mm256_set1_epi32(w); }
#if defined(__AVXVNNI__)
#define INT4_INT8_DPBUSD 1
inline IntVec dpbusd(IntVec acc, IntVec codes, IntVec a) { return _mm256_dpbusd_avx_epi32(acc, codes, a); }
constexpr int kRowsPerTile = 2;  // half a panel at a time: 2 rows x 4 accumulators, 4 broadcasts, 3 for the codes
constexpr bool kPartialTilesByRow = false;
template <int Rows>
constexpr int kVectors = Rows == 1 ? 8 : 4;  // one row: the whole panel in one pass (see tile)
template <int Rows>
constexpr int kSteps = 1;
#else
// 8-bit codes: D sums (q - 128) a (below), which the shift's mid accounts for
template <int Bits>
constexpr int kDotBias = Bits == 8 ? 128 : 0;
template <int Bits, int Steps>
inline IntVec dot_add(IntVec acc, const IntVec* low, const IntVec* high, const int8_t* a) {
  if constexpr (Bits == 4) {
    // pairs of products in int16 (each at most 2 x 15 x 127), the 2 Steps pairs of a lane added in
    // int16 (at most 8 x 3,810 for four steps: no saturation), then pairs of those in int32: 9
    // instructions per 128 products and row at two steps, 17 per 256 at four, against 5 per 64 one
    // step at a time
    static_assert(Steps <= 4, "8 pair sums of at most 3,810 fill an int16");
    IntVec pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low[0], broadcast_word(a)),
                                    _mm256_maddubs_epi16(high[0], broadcast_word(a + 4)));
    for (int s = 1; s < Steps; ++s)
      pairs = _mm256_add_epi16(_mm256_add_epi16(pairs, _mm256_maddubs_epi16(low[s], broadcast_word(a + 8 * s))),
                               _mm256_maddubs_epi16(high[s], broadcast_word(a + 8 * s + 4)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  } else {
    // a pair of 8-bit codes (up to 255) times activations (up to 127) overflows int16, so each code q
    // becomes w = q - 128 (a sign-bit flip) and the product is |w| times a with w's sign, at most
    // 2 x 128 x 127 a pair, widened to int32 at once, as llama.cpp's AVX2 Q8_0 dot products do
    const IntVec flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    for (int s = 0; s < Steps; ++s)
      for (int half = 0; half < 2; ++half) {
        const IntVec w = _mm256_xor_si256(half ? high[s] : low[s], flip);
        const IntVec signed_a = _mm256_sign_epi8(broadcast_word(a + 8 * s + 4 * half), w);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), signed_a), ones));
      }
    return acc;
  }
}
// Tiles of 8 rows x 1 accumulator: each split code vector serves 8 rows (the splitting, 3 instructions
// per code vector, is 0.75 per 128 products and row) and each broadcast is used once, so none holds
// one of the 16 registers. Paired in one process against 4-row tiles of two steps (gate_up [32768,
// 4096], 2 threads): 8-12 % faster at 512 rows, bit-identical. A decode step's one row covers the whole
// panel in one pass (see tile), two steps at a time (four spill registers: 1.2-1.6x slower, paired runs).
// An x of fewer rows than a tile (a speculative verification's 2-7) runs as that many decode rows, one after
// another over each group's codes, which the first row brings into L1: a narrower tile's slices would read
// the codes from memory in a strided stream (see tile), which at 2-7 rows costs more than splitting the codes
// again for every row. Built for AVX2, 2 threads, an AMD EPYC, paired in one process against the tiles of
// 2-7 rows this replaced (4 / Rows accumulators and four steps per widening up to 4 rows): MiniCPM4.1-8B's
// gate_up and down_proj (W4 g128) 1.5-1.7x as fast at 2 rows, 1.5-1.6x at 4, 1.2-1.35x at 5, 1.1x at 7;
// its int8 LM head 2.4x, 1.95x, 1.35x and 1.0x. A partial tile after whole ones (a 13-row tree's last 5)
// finds the codes in L1 and stays a tile: one row at a time it ran 0.93-0.97x as fast. AVX-512 VNNI's tiles
// cover the whole panel at any row count, and there one row at a time ran 0.6-1.0x as fast.
constexpr int kRowsPerTile = 8;
constexpr bool kPartialTilesByRow = true;
template <int Rows>
constexpr int kVectors = Rows == 1 ? 8 : 1;
template <int Rows>
constexpr int kSteps = 2;
#endif
inline FloatVec low_bf16(IntVec v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline FloatVec high_bf16(IntVec v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(kHighHalf)))); }
inline FloatVec to_float(IntVec v) { return _mm256_cvtepi32_ps(v); }
inline FloatVec load_float(const float* p) { return _mm256_loadu_ps(p); }
inline FloatVec broadcast_float(float v) { return _mm256_set1_ps(v); }
inline FloatVec fmadd(FloatVec a, FloatVec b, FloatVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FloatVec mul(FloatVec a, FloatVec b) { return _mm256_mul_ps(a, b); }
inline void store_float(float* p, FloatVec v) { _mm256_storeu_ps(p, v); }
#endif

#ifdef INT4_INT8_DPBUSD
template <int Bits>
constexpr int kDotBias = 0;  // D sums q a
// acc + the dot products of each 32-bit lane's 4 codes of low[s] with a row's activations of columns
// 8 s .. 8 s + 3 (``a`` the row's first column) and of high[s] with those of 8 s + 4 .. 8 s + 7
template <int Bits, int Steps>
inline IntVec dot_add(IntVec acc, const IntVec* low, const IntVec* high, const int8_t* a) {
  for (int s = 0; s < Steps; ++s)
    acc = dpbusd(dpbusd(acc, low[s], broadcast_word(a + 8 * s)), high[s], broadcast_word(a + 8 * s + 4));
  return acc;
}
#endif

// int8 [M, K], and per row and group: alpha and the sum of the int8 values. The values are stored tile by
// tile (kRowsPerTile rows, fewer in the last), each tile group-major, [groups][its rows][group_size], so that
// the 1 KB a tile multiplies by a group (8 rows at 128 columns) is contiguous: read from rows K bytes
// apart, they shared L1 with the codes badly; paired in one process (512 rows, 2 threads, AMD EPYC), this
// layout took 0.90-0.96x the time on MiniCPM4.1-8B's shapes with the AVX2 build and 0.96-0.98x with the
// AVX-512 VNNI one, decode and 4-row verification within noise.
inline int64_t tile_group_offset(int64_t m0, int64_t rows, int64_t g, int64_t columns, int64_t group_size) {
  return m0 * columns + g * rows * group_size;
}
struct Activations {
  const int8_t* values;
  const float* alpha;
  const int32_t* sums;
  int64_t columns, groups, group_size;
  // group g of the tile of ``rows`` rows from m0: its rows one after another, group_size apart
  const int8_t* tile_group(int64_t m0, int64_t rows, int64_t g) const {
    return values + tile_group_offset(m0, rows, g, columns, group_size);
  }
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// The layout of Bits-bit codes: the bytes of a panel's 8-column step, and the code every weight is
// centred on (w = (q - mid) s + z).
template <int Bits>
struct Codes {
  static_assert(Bits == 4 || Bits == 8, "4-bit or 8-bit codes");
  static constexpr int64_t kStepBytes = kPanel * Bits;
  static constexpr float kMid = 1 << (Bits - 1);
  // row ``lane``'s code of column c (< 8) of a step
  static uint8_t code(const uint8_t* step, int64_t lane, int64_t c) {
    if constexpr (Bits == 4) {
      const uint8_t byte = step[lane * 4 + c % 4];
      return c < 4 ? byte & 15 : byte >> 4;
    } else {
      return step[c / 4 * kHalfStep + lane * 4 + c % 4];
    }
  }
#ifdef __AVX2__
  // the codes of columns 0..3 (low) and 4..7 (high) of kLanes rows from ``at`` (a step plus 4 bytes a row)
  static void split(const uint8_t* at, IntVec& low, IntVec& high) {
    if constexpr (Bits == 4) {
      const IntVec bytes = load_int(at);
      low = low_nibbles(bytes);
      high = high_nibbles(bytes);
    } else {
      low = load_int(at);
      high = load_int(at + kHalfStep);
    }
  }
#endif
};

// Group g's scale s and shift z - (mid - bias) s of rows r0..r0+63 (bias: what the dot products take
// off each code), from the bf16 pairs [groups][rows][2] (each pair one 32-bit word: s in the low half,
// z in the high one).
template <int Bits>
void group_scales(const uint16_t* pairs, int64_t rows, int64_t r0, int64_t g, float* scale, float* shift) {
  const uint16_t* base = pairs + (g * rows + r0) * 2;
#ifdef __AVX2__
  constexpr float kCentre = Codes<Bits>::kMid - kDotBias<Bits>;
  for (int64_t i = 0; i < kPanel; i += kLanes) {
    const IntVec words = load_int(base + 2 * i);
    const FloatVec s = low_bf16(words);
    store_float(scale + i, s);
    store_float(shift + i, fmadd(broadcast_float(-kCentre), s, high_bf16(words)));
  }
#else
  for (int64_t i = 0; i < kPanel; ++i) {
    scale[i] = bf16_to_float(base[2 * i]);
    shift[i] = std::fma(-Codes<Bits>::kMid, scale[i], bf16_to_float(base[2 * i + 1]));
  }
#endif
}

#ifdef __AVX2__
// Steps 8-column steps of ``Rows`` activation rows (``a``: the first row's first column, the next rows
// ``row_stride`` bytes on) times the codes ``step`` of a slice, added to ``acc``.
template <int Bits, int Rows, int Steps>
inline void multiply_steps(IntVec (&acc)[Rows][kVectors<Rows>], const uint8_t* step, const int8_t* a,
                           int64_t row_stride) {
  for (int v = 0; v < kVectors<Rows>; ++v) {
    IntVec low[Steps], high[Steps];
    for (int s = 0; s < Steps; ++s) Codes<Bits>::split(step + s * Codes<Bits>::kStepBytes + v * kLanes * 4, low[s], high[s]);
    for (int r = 0; r < Rows; ++r) acc[r][v] = dot_add<Bits, Steps>(acc[r][v], low, high, a + r * row_stride);
  }
}

// ``Rows`` (<= kRowsPerTile) activation rows times group g of a panel (``codes``: the group's bytes in the
// panel), added to ``out`` [Rows][64] float32; ``a``: the first row's int8 values of the group (the next
// rows' follow, group_size apart), ``row`` its index in x; ``scale`` and ``shift`` [64]: the group's.
template <int Bits, int Rows>
void tile(const Activations& x, const int8_t* a, int64_t row, int64_t g, const uint8_t* codes, const float* scale,
          const float* shift, float* out) {
  constexpr int kSlice = kVectors<Rows> * kLanes;  // panel rows the accumulators cover
  // A slice narrower than the panel reads part of every step's cache lines on each pass over the group,
  // a strided stream the hardware prefetchers follow badly: a decode row's slice is the whole panel on
  // every instruction set, so that it streams its codes in order. Paired in one process (4 layers of
  // MiniCPM4.1-8B's int4 linears and its int8 LM head, one row, 2 threads, AMD EPYC), the AVX2 build
  // went from 0.68x and 0.44x the AVX-512 VNNI build's speed with 32-row slices to 0.93-1.0x and
  // 0.8-1.1x.
  static_assert(Rows > 1 || kSlice == kPanel, "a decode row reads its panel in one pass");
  constexpr int64_t kStepBytes = Codes<Bits>::kStepBytes;
  for (int64_t first = 0; first < kPanel; first += kSlice) {
    IntVec acc[Rows][kVectors<Rows>];
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < kVectors<Rows>; ++v) acc[r][v] = zero_int();
    const uint8_t* slice = codes + first * 4;
    const int64_t steps = x.group_size / 8;
    int64_t q = 0;
    for (; q + kSteps<Rows> <= steps; q += kSteps<Rows>)
      multiply_steps<Bits, Rows, kSteps<Rows>>(acc, slice + q * kStepBytes, a + 8 * q, x.group_size);
    for (; q < steps; ++q) multiply_steps<Bits, Rows, 1>(acc, slice + q * kStepBytes, a + 8 * q, x.group_size);
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (row + r) * x.groups + g;
      const FloatVec alpha = broadcast_float(x.alpha[at]);
      const FloatVec offset = broadcast_float(x.alpha[at] * static_cast<float>(x.sums[at]));
      for (int v = 0; v < kVectors<Rows>; ++v) {
        const int64_t lane = first + v * kLanes;
        float* o = out + r * kPanel + lane;
        const FloatVec partial = fmadd(load_float(shift + lane), offset, load_float(o));
        store_float(o, fmadd(to_float(acc[r][v]), mul(load_float(scale + lane), alpha), partial));
      }
    }
  }
}
#else  // no vector extension: the same sums in plain loops
constexpr int kRowsPerTile = 1;
constexpr bool kPartialTilesByRow = false;
template <int Bits, int Rows>
void tile(const Activations& x, const int8_t* first, int64_t row, int64_t g, const uint8_t* codes, const float* scale,
          const float* shift, float* out) {
  for (int r = 0; r < Rows; ++r) {
    const int64_t at = (row + r) * x.groups + g;
    const int8_t* a = first + r * x.group_size;
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      int32_t dot = 0;
      for (int64_t c = 0; c < x.group_size; ++c)
        dot += Codes<Bits>::code(codes + c / 8 * Codes<Bits>::kStepBytes, lane, c % 8) * a[c];
      const float partial = std::fma(shift[lane], x.alpha[at] * static_cast<float>(x.sums[at]), out[r * kPanel + lane]);
      out[r * kPanel + lane] = std::fma(static_cast<float>(dot), scale[lane] * x.alpha[at], partial);
    }
  }
}
#endif

// The tile of ``rows`` (<= Rows) rows from m0 times group g of a panel: one tile of its size, or, where
// kPartialTilesByRow and it is all of x, its rows one at a time.
template <int Bits, int Rows>
void tile_rows(int rows, const Activations& x, int64_t m0, int64_t g, const uint8_t* codes, const float* scale,
               const float* shift, float* out) {
  const int8_t* a = x.tile_group(m0, rows, g);
  if constexpr (Rows > 1) {
    if (rows < Rows) {
      if (kPartialTilesByRow && m0 == 0) {
        for (int r = 0; r < rows; ++r)
          tile<Bits, 1>(x, a + r * x.group_size, r, g, codes, scale, shift, out + r * kPanel);
        return;
      }
      return tile_rows<Bits, Rows - 1>(rows, x, m0, g, codes, scale, shift, out);
    }
  }
  tile<Bits, Rows>(x, a, m0, g, codes, scale, shift, out);
}

// y = x W^T for x bf16 or float32 [M, columns]; W's Bits-bit codes in the layout above for ``padded``
// rows (a multiple of 64, of which the first ``rows`` are W's), groups of ``group_size`` columns (a
// multiple of 8), scale_offset bf16 [columns / group_size, padded, 2]; y [M, rows] in x's dtype.
template <int Bits>
Tensor codes_matmul(const char* name, Tensor x, Tensor packed, Tensor scale_offset, int64_t rows, int64_t columns,
                    int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == columns && x.is_contiguous() &&
                  (x.dtype() == torch::kBFloat16 || x.dtype() == torch::kFloat32),
              name, ": x must be contiguous bf16 or float32 [M, columns]");
  TORCH_CHECK(group_size % 8 == 0 && columns % group_size == 0,
              name, ": group_size must be a multiple of 8 dividing columns");
  TORCH_CHECK(scale_offset.dtype() == torch::kBFloat16 && scale_offset.is_contiguous() &&
                  scale_offset.dim() == 3 && scale_offset.size(0) * group_size == columns &&
                  scale_offset.size(1) % kPanel == 0 && scale_offset.size(1) >= rows && scale_offset.size(2) == 2,
              name, ": scale_offset must be contiguous bf16 [columns / group_size, rows padded to 64, 2]");
  const int64_t padded = scale_offset.size(1);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 8 == padded * columns * Bits,
              name, ": packed must be contiguous uint8 holding the padded rows x columns codes");
  const int64_t m = x.size(0), groups = columns / group_size;

  // int8 activations, per row and group
  std::vector<int8_t> values(m * columns);
  std::vector<float> alpha(m * groups);
  std::vector<int32_t> sums(m * groups);
  // read in x's own dtype rather than from a float32 copy (an allocation and an operator call per linear):
  // MiniCPM4.1-8B's decode step, paired in one process, took 0.97x (AVX2 build) and 0.99x (AVX-512) the
  // time it took with the copy
  const bool bf16 = x.dtype() == torch::kBFloat16;
  const float* src_float = bf16 ? nullptr : x.data_ptr<float>();
  const auto* src_bf16 = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> group(group_size);
    float* v = group.data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / groups, g = i % groups, m0 = row / kRowsPerTile * kRowsPerTile;
      const int64_t first = row * columns + g * group_size;
      int8_t* q = values.data() + tile_group_offset(m0, std::min<int64_t>(kRowsPerTile, m - m0), g, columns, group_size) +
                  (row - m0) * group_size;
      if (bf16) {
        for (int64_t c = 0; c < group_size; ++c) v[c] = bf16_to_float(src_bf16[first + c]);
      } else {
        std::copy(src_float + first, src_float + first + group_size, v);
      }
      float top = 0.f;
      for (int64_t c = 0; c < group_size; ++c) top = std::max(top, std::fabs(v[c]));
      // in double, so that -ffast-math's reciprocals cannot move a value across a rounding tie: this
      // is 127 / top correctly rounded to float, as the reference computes it
      const float inverse = top > 0.f ? static_cast<float>(127.0 / top) : 0.f;
      int32_t sum = 0;
      for (int64_t c = 0; c < group_size; ++c) {
        q[c] = static_cast<int8_t>(std::nearbyint(v[c] * inverse));
        sum += q[c];
      }
      alpha[i] = static_cast<float>(top / 127.0);
      sums[i] = sum;
    }
  });
  const Activations act{values.data(), alpha.data(), sums.data(), columns, groups, group_size};

  Tensor out = torch::empty({m, rows}, x.options());
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const auto* pairs = reinterpret_cast<const uint16_t*>(scale_offset.data_ptr<at::BFloat16>());
  // A panel of 64 output rows at a time (its codes: 128 KB for 4096 columns at 4 bits, held in L2), and in
  // it kRowsPerTile rows of x at a time through every group (their int8 values stream in order, as do the
  // codes): the float32 sums of a tile's rows in a small buffer. The earlier order, every
  // row of x per group, re-read all of x per group from L2 or beyond; paired in one process on 512 rows
  // (2 threads, AMD EPYC, AVX2 build), this order took 0.76-0.99x its time on MiniCPM4.1-8B's shapes, the
  // most on down_proj's 16,384 columns, and 0.97-0.99x on the AVX-512 VNNI build.
  at::parallel_for(0, padded / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(kPanel), shift(kPanel), tile_sums(kRowsPerTile * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r0 = p * kPanel, panel_rows = std::min(kPanel, rows - r0);
      if (panel_rows <= 0) continue;
      const uint8_t* panel = codes + r0 * columns * Bits / 8;
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerTile) {
        const int tile_rows_here = static_cast<int>(std::min<int64_t>(kRowsPerTile, m - m0));
        std::fill(tile_sums.begin(), tile_sums.end(), 0.f);
        for (int64_t g = 0; g < groups; ++g) {
          // a group's 64 scales and shifts cost less to rebuild per tile than a buffer of all of them
          // costs a decode step, which reads every group once
          group_scales<Bits>(pairs, padded, r0, g, scale.data(), shift.data());
          tile_rows<Bits, kRowsPerTile>(tile_rows_here, act, m0, g, panel + g * group_size / 8 * Codes<Bits>::kStepBytes,
                                        scale.data(), shift.data(), tile_sums.data());
        }
        for (int r = 0; r < tile_rows_here; ++r) {
          const float* result = tile_sums.data() + r * kPanel;
          if (bf16) {
            auto* y = out.data_ptr<at::BFloat16>() + (m0 + r) * rows + r0;
            for (int64_t i = 0; i < panel_rows; ++i) y[i] = at::BFloat16(result[i]);
          } else {
            std::copy(result, result + panel_rows, out.data_ptr<float>() + (m0 + r) * rows + r0);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace int4_int8

// The instruction set the sums run on, for reports and for the runtime's choice of prefill.
std::string int4_int8_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512_vnni";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// y = x W^T, W = (q - 8) s + z with 4-bit codes q in int4_layout's order (codes_matmul above)
Tensor int4_int8_matmul(Tensor x, Tensor packed, Tensor scale_offset, int64_t rows, int64_t columns,
                        int64_t group_size) {
  return int4_int8::codes_matmul<4>("int4_int8_matmul", x, packed, scale_offset, rows, columns, group_size);
}

// y = x W^T, W = (q - 128) s + z with 8-bit codes q in int8_layout's order (codes_matmul above)
Tensor int8_int8_matmul(Tensor x, Tensor packed, Tensor scale_offset, int64_t rows, int64_t columns,
                        int64_t group_size) {
  return int4_int8::codes_matmul<8>("int8_int8_matmul", x, packed, scale_offset, rows, columns, group_size);
}
