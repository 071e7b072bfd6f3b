// Prefill of an int4 linear on integer dot products, for CPUs without AMX (kernels/linear/int4.py).
// There a bf16 matmul runs at a fraction of the AMX rate (oneDNN held to AVX-512 BF16 multiplies
// 512 x 4096 by 4096 x 4096 at ~37 GMAC/s on this project's Xeon, against ~290 for int8 on VNNI),
// and rebuilding each bf16 weight costs on top. Here the activations are quantized to int8 per row
// and weight group (symmetric, a scale alpha = max|x| / 127), and each group's products of int8
// activations and the weight's 4-bit codes are summed exactly in int32 (VPDPBUSD: unsigned codes times
// signed activations), then scaled in float32:
//   y[m, n] = sum_g alpha[m, g] * (s[g, n] * D[m, n, g] + S[m, g] * (z[g, n] - 8 s[g, n]))
// with w = (q - 8) s + z, D the integer dot product of a group and S the sum of its int8 activations.
// This is what llama.cpp's Q4_0 x Q8_0 dot products do, on groups of 128 instead of 32 activations.
//
// The weight is read from _convert_weight_to_int4pack_for_cpu's bytes (the one copy a module keeps)
// one panel of 64 output rows at a time into a thread-local buffer in the order VPDPBUSD reads: for
// every 4 input columns, each row's 4 codes as one 32-bit word. The panel's rows are stored in the
// order byte interleaving produces them (row_of_lane below); its scales follow the same order, and
// results are written back to their rows at the end of each tile.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

using torch::Tensor;

namespace int4_int8 {

constexpr int64_t kPanel = 64;       // output rows per panel
constexpr int64_t kQuadBytes = 256;  // one panel's codes of 4 input columns

// The panel row whose result lands in 32-bit lane ``lane`` (0..15) of vector ``t`` (0..3) of a quad:
// unpacking bytes then words per 128-bit lane leaves rows 16 L + 4 t + j at lane 4 L + j.
inline int64_t row_of_lane(int64_t t, int64_t lane) { return 16 * (lane / 4) + 4 * t + lane % 4; }

// Code of row r, column c in the packed layout (see _unpack_packed in kernels/linear/int4.py).
inline uint8_t packed_code(const uint8_t* codes, int64_t rows, int64_t columns, int64_t block, int64_t r,
                           int64_t c) {
  const int64_t whole = block ? rows / block * block : 0;
  if (r < whole) {
    const int64_t half = block / 2, within = r % block;
    const uint8_t byte = codes[(r / block * columns + c) * half + within % half];
    return within < half ? byte & 15 : byte >> 4;
  }
  const int64_t i = r - whole;
  const uint8_t byte = codes[whole * columns / 2 + c * ((rows - whole) / 2) + i / 2];
  return i % 2 ? byte >> 4 : byte & 15;
}

// Codes of rows r0..r0+63 into ``panel`` [columns / 4][4 vectors][16 lanes][4 columns]; rows from
// ``rows`` on (a last, partial panel) are zeros.
void unpack_panel(const uint8_t* codes, int64_t rows, int64_t columns, int64_t block, int64_t r0, uint8_t* panel) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (block == 64 && r0 + kPanel <= rows) {  // each column's 64 rows are 32 bytes: low nibbles rows 0-31, high nibbles 32-63
    const uint8_t* base = codes + r0 / 64 * columns * 32;
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t c = 0; c < columns; c += 4) {
      __m512i z[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (c + i) * 32));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low)), hi, 1);
      }
      const __m512i a_lo = _mm512_unpacklo_epi8(z[0], z[1]), a_hi = _mm512_unpackhi_epi8(z[0], z[1]);
      const __m512i b_lo = _mm512_unpacklo_epi8(z[2], z[3]), b_hi = _mm512_unpackhi_epi8(z[2], z[3]);
      auto* dst = reinterpret_cast<__m512i*>(panel + c / 4 * kQuadBytes);
      _mm512_storeu_si512(dst + 0, _mm512_unpacklo_epi16(a_lo, b_lo));
      _mm512_storeu_si512(dst + 1, _mm512_unpackhi_epi16(a_lo, b_lo));
      _mm512_storeu_si512(dst + 2, _mm512_unpacklo_epi16(a_hi, b_hi));
      _mm512_storeu_si512(dst + 3, _mm512_unpackhi_epi16(a_hi, b_hi));
    }
    return;
  }
#endif
  int64_t lane_of_row[kPanel];  // byte offset in a quad of each panel row's first code
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t lane = 0; lane < 16; ++lane) lane_of_row[row_of_lane(t, lane)] = (t * 16 + lane) * 4;
  if ((block == 32 || block == 64) && r0 + kPanel <= rows / block * block) {  // whole blocks, byte by byte
    const int64_t half = block / 2;
    for (int64_t b = 0; b < kPanel; b += block)
      for (int64_t c = 0; c < columns; ++c) {
        const uint8_t* bytes = codes + ((r0 + b) / block * columns + c) * half;
        uint8_t* quad = panel + c / 4 * kQuadBytes + c % 4;
        for (int64_t j = 0; j < half; ++j) {
          quad[lane_of_row[b + j]] = bytes[j] & 15;
          quad[lane_of_row[b + half + j]] = bytes[j] >> 4;
        }
      }
    return;
  }
  for (int64_t c = 0; c < columns; ++c) {
    uint8_t* quad = panel + c / 4 * kQuadBytes + c % 4;
    for (int64_t i = 0; i < kPanel; ++i)
      quad[lane_of_row[i]] = r0 + i < rows ? packed_code(codes, rows, columns, block, r0 + i, c) : 0;
  }
}

// Sums of 4 products of unsigned codes and signed activations, added to 32-bit lanes.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
using IntVec = __m512i;
using FloatVec = __m512;
inline IntVec load_int(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IntVec zero_int() { return _mm512_setzero_si512(); }
inline IntVec broadcast_word(const int8_t* p) { int32_t w; std::memcpy(&w, p, 4); return _mm512_set1_epi32(w); }
inline IntVec dot_add(IntVec acc, IntVec codes, IntVec activations) { return _mm512_dpbusd_epi32(acc, codes, activations); }
inline FloatVec to_float(IntVec v) { return _mm512_cvtepi32_ps(v); }
inline FloatVec load_float(const float* p) { return _mm512_loadu_ps(p); }
inline FloatVec broadcast_float(float v) { return _mm512_set1_ps(v); }
inline FloatVec fmadd(FloatVec a, FloatVec b, FloatVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FloatVec mul(FloatVec a, FloatVec b) { return _mm512_mul_ps(a, b); }
inline void store_float(float* p, FloatVec v) { _mm512_storeu_ps(p, v); }
constexpr int kVectors = 4;      // accumulators per row of a tile: the whole panel
constexpr int kRowsPerTile = 6;  // 6 rows x 4 vectors of accumulators, 4 of codes, 1 broadcast
#elif defined(__AVX2__)
constexpr int kLanes = 8;
using IntVec = __m256i;
using FloatVec = __m256;
inline IntVec load_int(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IntVec zero_int() { return _mm256_setzero_si256(); }
inline IntVec broadcast_word(const int8_t* p) { int32_t w; std::memcpy(&w, p, 4); return _mm256_set1_epi32(w); }
#if defined(__AVXVNNI__)
inline IntVec dot_add(IntVec acc, IntVec codes, IntVec activations) { return _mm256_dpbusd_avx_epi32(acc, codes, activations); }
#else  // pairs of products in int16 (at most 2 x 15 x 127, no saturation), then pairs of those in int32
inline IntVec dot_add(IntVec acc, IntVec codes, IntVec activations) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, activations), _mm256_set1_epi16(1)));
}
#endif
inline FloatVec to_float(IntVec v) { return _mm256_cvtepi32_ps(v); }
inline FloatVec load_float(const float* p) { return _mm256_loadu_ps(p); }
inline FloatVec broadcast_float(float v) { return _mm256_set1_ps(v); }
inline FloatVec fmadd(FloatVec a, FloatVec b, FloatVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FloatVec mul(FloatVec a, FloatVec b) { return _mm256_mul_ps(a, b); }
inline void store_float(float* p, FloatVec v) { _mm256_storeu_ps(p, v); }
constexpr int kVectors = 4;      // half a panel at a time: 16 registers hold 2 rows x 4 accumulators,
constexpr int kRowsPerTile = 2;  // 4 vectors of codes, a broadcast and the int16 ones
#endif

struct Activations {  // int8 [M, K], and per row and group: alpha and the sum of the int8 values
  const int8_t* values;
  const float* alpha;
  const int32_t* sums;
  int64_t columns, groups, group_size;
};

#ifdef __AVX2__  // either vector branch above
constexpr int kSlice = kVectors * kLanes;  // panel lanes a tile's accumulators cover

// ``rows`` (<= kRowsPerTile) activation rows from ``m0`` times the panel, into tile [rows][64] float32
// (lanes in the panel's order). ``scale`` and ``shift`` [groups][64]: s and z - 8 s in the same order.
template <int Rows>
void tile(const Activations& x, int64_t m0, const uint8_t* panel, const float* scale, const float* shift,
          float* out) {
  std::fill(out, out + Rows * kPanel, 0.f);
  const int64_t quads = x.group_size / 4;
  for (int64_t first = 0; first < kPanel; first += kSlice)
    for (int64_t g = 0; g < x.groups; ++g) {
      IntVec acc[Rows][kVectors];
      for (int r = 0; r < Rows; ++r)
        for (int v = 0; v < kVectors; ++v) acc[r][v] = zero_int();
      const uint8_t* quad = panel + g * quads * kQuadBytes + first * 4;
      const int8_t* a = x.values + m0 * x.columns + g * x.group_size;
      for (int64_t q = 0; q < quads; ++q, quad += kQuadBytes, a += 4) {
        IntVec w[kVectors];
        for (int v = 0; v < kVectors; ++v) w[v] = load_int(quad + v * kLanes * 4);
        for (int r = 0; r < Rows; ++r) {
          const IntVec b = broadcast_word(a + r * x.columns);
          for (int v = 0; v < kVectors; ++v) acc[r][v] = dot_add(acc[r][v], w[v], b);
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const int64_t at = (m0 + r) * x.groups + g;
        const FloatVec alpha = broadcast_float(x.alpha[at]);
        const FloatVec offset = broadcast_float(x.alpha[at] * static_cast<float>(x.sums[at]));
        for (int v = 0; v < kVectors; ++v) {
          const int64_t lane = first + v * kLanes;
          float* o = out + r * kPanel + lane;
          const FloatVec partial = fmadd(load_float(shift + g * kPanel + lane), offset, load_float(o));
          store_float(o, fmadd(to_float(acc[r][v]), mul(load_float(scale + g * kPanel + lane), alpha), partial));
        }
      }
    }
}
#else  // no vector extension: the same sums in plain loops
constexpr int kRowsPerTile = 1;
template <int Rows>
void tile(const Activations& x, int64_t m0, const uint8_t* panel, const float* scale, const float* shift,
          float* out) {
  for (int r = 0; r < Rows; ++r) {
    float* o = out + r * kPanel;
    std::fill(o, o + kPanel, 0.f);
    for (int64_t g = 0; g < x.groups; ++g) {
      const int64_t at = (m0 + r) * x.groups + g;
      const int8_t* a = x.values + (m0 + r) * x.columns + g * x.group_size;
      const uint8_t* quads = panel + g * x.group_size / 4 * kQuadBytes;
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        int32_t dot = 0;
        for (int64_t c = 0; c < x.group_size; ++c) dot += quads[c / 4 * kQuadBytes + lane * 4 + c % 4] * a[c];
        o[lane] += x.alpha[at] * (scale[g * kPanel + lane] * dot + x.sums[at] * shift[g * kPanel + lane]);
      }
    }
  }
}
#endif

template <int Rows>
void tile_rows(int rows, const Activations& x, int64_t m0, const uint8_t* panel, const float* scale,
               const float* shift, float* out) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return tile_rows<Rows - 1>(rows, x, m0, panel, scale, shift, out);
  }
  tile<Rows>(x, m0, panel, scale, shift, out);
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

// y = x W^T for x bf16 or float32 [M, columns], W int4 in the packed layout (groups of ``group_size`` columns, scale_offset bf16 [columns / group_size, rows, 2] as the packed kernel
// reads it); y [M, rows] in x's dtype.
Tensor int4_int8_matmul(Tensor x, Tensor packed, Tensor scale_offset, int64_t rows, int64_t columns,
                        int64_t group_size, int64_t block) {
  using namespace int4_int8;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == columns && x.is_contiguous() &&
                  (x.dtype() == torch::kBFloat16 || x.dtype() == torch::kFloat32),
              "x: contiguous bf16 or float32 [M, columns]");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 2 == rows * columns,
              "packed: contiguous uint8 holding rows x columns nibbles");
  TORCH_CHECK(group_size % 4 == 0 && columns % group_size == 0, "group_size: a multiple of 4 dividing columns");
  TORCH_CHECK(scale_offset.dtype() == torch::kBFloat16 && scale_offset.is_contiguous() &&
                  scale_offset.dim() == 3 && scale_offset.size(0) * group_size == columns &&
                  scale_offset.size(1) == rows && scale_offset.size(2) == 2,
              "scale_offset: contiguous bf16 [columns / group_size, rows, 2]");
  const int64_t m = x.size(0), groups = columns / group_size;

  // int8 activations, per row and group
  std::vector<int8_t> values(m * columns);
  std::vector<float> alpha(m * groups);
  std::vector<int32_t> sums(m * groups);
  const Tensor xf = x.dtype() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  const float* src = xf.data_ptr<float>();
  at::parallel_for(0, m * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = src + i / groups * columns + i % groups * group_size;
      int8_t* q = values.data() + i / groups * columns + i % groups * group_size;
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
  const bool bf16 = x.dtype() == torch::kBFloat16;
  at::parallel_for(0, (rows + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> panel(columns / 4 * kQuadBytes);
    std::vector<float> scale(groups * kPanel), shift(groups * kPanel), results(kRowsPerTile * kPanel);
    std::vector<int64_t> row(kPanel);  // panel row of each result lane
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t lane = 0; lane < 16; ++lane) row[t * 16 + lane] = row_of_lane(t, lane);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r0 = p * kPanel, panel_rows = std::min(kPanel, rows - r0);
      unpack_panel(codes, rows, columns, block, r0, panel.data());
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < kPanel; ++i) {
          if (row[i] >= panel_rows) {
            scale[g * kPanel + i] = shift[g * kPanel + i] = 0.f;
            continue;
          }
          const uint16_t* pair = pairs + (g * rows + r0 + row[i]) * 2;
          const uint32_t s_bits = static_cast<uint32_t>(pair[0]) << 16, z_bits = static_cast<uint32_t>(pair[1]) << 16;
          float s, z;
          std::memcpy(&s, &s_bits, 4);
          std::memcpy(&z, &z_bits, 4);
          scale[g * kPanel + i] = s;
          shift[g * kPanel + i] = z - 8.f * s;
        }
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerTile) {
        const int tile_rows_here = static_cast<int>(std::min<int64_t>(kRowsPerTile, m - m0));
        tile_rows<kRowsPerTile>(tile_rows_here, act, m0, panel.data(), scale.data(), shift.data(), results.data());
        for (int r = 0; r < tile_rows_here; ++r) {
          const float* result = results.data() + r * kPanel;
          if (bf16) {
            auto* y = out.data_ptr<at::BFloat16>() + (m0 + r) * rows + r0;
            for (int64_t i = 0; i < kPanel; ++i)
              if (row[i] < panel_rows) y[row[i]] = at::BFloat16(result[i]);
          } else {
            float* y = out.data_ptr<float>() + (m0 + r) * rows + r0;
            for (int64_t i = 0; i < kPanel; ++i)
              if (row[i] < panel_rows) y[row[i]] = result[i];
          }
        }
      }
    }
  });
  return out;
}
