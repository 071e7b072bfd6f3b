// An int4 linear's bf16 weight rebuilt from the packed kernel's codes: what each prefill chunk of a
// model too large to keep its dequantized weights pays per linear (kernels/linear/int4.py). PyTorch's
// elementwise operators take ~0.5 s for an 8B gate_up on one thread; this loop writes the transposed
// weight W^T [Kp, N] column by column of W, where the packed layout holds each column's codes for a
// block of rows together, so every store is contiguous and the arithmetic vectorizes over rows.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

// 16 weights (q - 8) * s + z as bf16 bits, rounded to nearest even like int4_bf16_bits.
static inline __m256i int4_bf16_x16(__m256i q16, const float* s, const float* z) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(q16));
  const __m512 w = _mm512_fmadd_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.f)), _mm512_loadu_ps(s), _mm512_loadu_ps(z));
  __m512i bits = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// One column of a 64-row block: 32 bytes, low nibbles rows 0-31, high nibbles rows 32-63.
static inline void int4_block64(const uint8_t* bytes, const float* s, const float* z, uint16_t* dst) {
  const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  const __m512i halves[2] = {_mm512_and_si512(codes, _mm512_set1_epi16(15)), _mm512_srli_epi16(codes, 4)};
  for (int h = 0; h < 2; ++h) {
    const int r = 32 * h;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r),
                        int4_bf16_x16(_mm512_castsi512_si256(halves[h]), s + r, z + r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r + 16),
                        int4_bf16_x16(_mm512_extracti64x4_epi64(halves[h], 1), s + r + 16, z + r + 16));
  }
}
#endif

// float -> bf16 bits, rounding to nearest even as c10::BFloat16 does (the values here are finite).
static inline uint16_t int4_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// W = (q - 8) * s + z per group of input channels, q read from _convert_weight_to_int4pack_for_cpu's
// bytes: whole blocks of ``block`` rows are bytes [columns, block / 2] (low nibbles the block's first
// half of rows, high nibbles the second), the remaining rows bytes [columns, rows / 2] pairing rows 2i
// (low) and 2i + 1 (high); see _unpack_packed in kernels/linear/int4.py. scale_offset: bf16 [G, N, 2].
// (q - 8) * s is exact in float32, so the fma rounds once, as PyTorch's multiply then add does.
// Written into ``out`` (bf16, rows x columns elements, viewed as [columns, rows]), which the caller may reuse:
// a fresh 268 MB buffer (an 8B gate_up) costs more in page faults than the loop itself.
Tensor int4_dequantize_t(Tensor packed, Tensor scale_offset, int64_t rows, int64_t columns, int64_t group_size,
                         int64_t block, Tensor out) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 2 == rows * columns,
              "packed: contiguous uint8 holding rows x columns nibbles");
  TORCH_CHECK(scale_offset.dtype() == torch::kBFloat16 && scale_offset.is_contiguous() && scale_offset.dim() == 3 &&
                  scale_offset.size(1) == rows && scale_offset.size(2) == 2 &&
                  scale_offset.size(0) * group_size == columns,
              "scale_offset: contiguous bf16 [columns / group_size, rows, 2]");
  TORCH_CHECK(block == 0 || block % 2 == 0, "block must be even");
  const int64_t whole = block ? rows / block * block : 0, tail = rows - whole, half = block / 2;
  TORCH_CHECK(tail % 2 == 0, "the rows after the whole blocks must pair up");
  TORCH_CHECK(out.dtype() == torch::kBFloat16 && out.is_contiguous() && out.numel() == rows * columns,
              "out: contiguous bf16 of rows x columns elements");
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const auto* pairs = reinterpret_cast<const uint16_t*>(scale_offset.data_ptr<at::BFloat16>());
  auto* weights = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // Rows in tiles whose scales and offsets stay in L1 while the tile's columns are written.
  const int64_t tile = block ? std::max<int64_t>(block, 1024 / block * block) : rows;
  at::parallel_for(0, columns, group_size, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(rows), offset(rows);
    for (int64_t first = begin; first < end;) {
      const int64_t group = first / group_size, last = std::min(end, (group + 1) * group_size);
      const uint16_t* pair = pairs + group * rows * 2;
      for (int64_t r = 0; r < rows; ++r) {  // this group's scale and offset of every row, as float32
        const uint32_t s = static_cast<uint32_t>(pair[2 * r]) << 16, z = static_cast<uint32_t>(pair[2 * r + 1]) << 16;
        std::memcpy(&scale[r], &s, sizeof(float));
        std::memcpy(&offset[r], &z, sizeof(float));
      }
      for (int64_t t0 = 0; t0 < whole; t0 += tile) {
        const int64_t t1 = std::min(whole, t0 + tile);
        for (int64_t c = first; c < last; ++c) {
          for (int64_t r0 = t0; r0 < t1; r0 += block) {
            const uint8_t* bytes = codes + (r0 / block * columns + c) * half;
            const float* s = scale.data() + r0;
            const float* z = offset.data() + r0;
            uint16_t* dst = weights + c * rows + r0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (block == 64) {
              int4_block64(bytes, s, z, dst);
              continue;
            }
#endif
            for (int64_t j = 0; j < half; ++j) {
              dst[j] = int4_bf16_bits(std::fma(static_cast<float>(bytes[j] & 15) - 8.f, s[j], z[j]));
              dst[half + j] = int4_bf16_bits(std::fma(static_cast<float>(bytes[j] >> 4) - 8.f, s[half + j], z[half + j]));
            }
          }
        }
      }
      for (int64_t c = first; c < last; ++c) {  // the rows after the whole blocks, paired
        const uint8_t* bytes = codes + whole * columns / 2 + c * (tail / 2);
        uint16_t* column = weights + c * rows;
        for (int64_t i = 0; i < tail / 2; ++i) {
          const int64_t r = whole + 2 * i;
          column[r] = int4_bf16_bits(std::fma(static_cast<float>(bytes[i] & 15) - 8.f, scale[r], offset[r]));
          column[r + 1] = int4_bf16_bits(std::fma(static_cast<float>(bytes[i] >> 4) - 8.f, scale[r + 1], offset[r + 1]));
        }
      }
      first = last;
    }
  });
  return out.view({columns, rows});
}
