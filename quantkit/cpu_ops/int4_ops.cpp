// An int4 linear's bf16 weight rebuilt from its codes: what each prefill chunk of a model too large to
// keep its dequantized weights pays per linear where prefill multiplies bf16 on AMX
// (kernels/linear/int4.py). The codes are in int4_int8_ops.cpp's layout (panels of 64 rows, 256 bytes
// per 8 columns, byte 4 r + c: row r's codes of columns c and c + 4); the loop writes the transposed
// weight W^T [columns, padded rows], 16 rows of one column per store, so every store is contiguous.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

// 16 floats as bf16 bits, rounded to nearest even like int4_bf16_bits.
static inline __m256i int4_bf16_x16(__m512 w) {
  __m512i bits = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
#endif

// float -> bf16 bits, rounding to nearest even as c10::BFloat16 does (the values here are finite).
static inline uint16_t int4_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// W = (q - 8) * s + z per group of input columns; scale_offset: bf16 [G, padded rows, 2]. (q - 8) * s is
// exact in float32, so the fma rounds once, as PyTorch's multiply then add does. Written into ``out``
// (bf16, padded rows x columns elements, viewed as [columns, padded rows]), which the caller may reuse:
// a fresh 268 MB buffer (an 8B gate_up) costs more in page faults than the loop itself.
Tensor int4_dequantize_t(Tensor packed, Tensor scale_offset, int64_t columns, int64_t group_size, Tensor out) {
  TORCH_CHECK(scale_offset.dtype() == torch::kBFloat16 && scale_offset.is_contiguous() && scale_offset.dim() == 3 &&
                  scale_offset.size(1) % 64 == 0 && scale_offset.size(2) == 2 &&
                  scale_offset.size(0) * group_size == columns && group_size % 8 == 0,
              "scale_offset: contiguous bf16 [columns / group_size, rows padded to 64, 2], group_size a multiple of 8");
  const int64_t rows = scale_offset.size(1);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 2 == rows * columns,
              "packed: contiguous uint8 holding the padded rows x columns codes");
  TORCH_CHECK(out.dtype() == torch::kBFloat16 && out.is_contiguous() && out.numel() == rows * columns,
              "out: contiguous bf16 of padded rows x columns elements");
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const auto* pairs = reinterpret_cast<const uint16_t*>(scale_offset.data_ptr<at::BFloat16>());
  auto* weights = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows / 64, 1, [&](int64_t begin, int64_t end) {
    float scale[64], offset[64];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r0 = p * 64;
      for (int64_t g = 0; g < columns / group_size; ++g) {
        const uint16_t* pair = pairs + (g * rows + r0) * 2;
        for (int64_t r = 0; r < 64; ++r) {  // this group's scale and offset of the panel's rows, as float32
          const uint32_t s = static_cast<uint32_t>(pair[2 * r]) << 16, z = static_cast<uint32_t>(pair[2 * r + 1]) << 16;
          std::memcpy(&scale[r], &s, sizeof(float));
          std::memcpy(&offset[r], &z, sizeof(float));
        }
        for (int64_t c8 = g * group_size; c8 < (g + 1) * group_size; c8 += 8) {
          const uint8_t* bytes = codes + r0 * columns / 2 + c8 * 32;  // this panel's 8 columns: 256 bytes
#if defined(__AVX512F__) && defined(__AVX512BW__)
          for (int64_t t = 0; t < 4; ++t) {  // rows 16 t .. 16 t + 15: one 32-bit word of 8 codes each
            const __m512i words = _mm512_loadu_si512(bytes + 64 * t);
            const __m512 s = _mm512_loadu_ps(scale + 16 * t), z = _mm512_loadu_ps(offset + 16 * t);
            for (int64_t c = 0; c < 8; ++c) {  // column c8 + c: byte c % 4, low nibble for c < 4
              const __m512i q = _mm512_and_si512(_mm512_srli_epi32(words, 8 * (c % 4) + 4 * (c / 4)),
                                                 _mm512_set1_epi32(15));
              const __m512 w = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(8.f)), s, z);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + (c8 + c) * rows + r0 + 16 * t),
                                  int4_bf16_x16(w));
            }
          }
#else
          for (int64_t c = 0; c < 8; ++c)
            for (int64_t r = 0; r < 64; ++r) {
              const uint8_t byte = bytes[4 * r + c % 4];
              const int q = c < 4 ? byte & 15 : byte >> 4;
              weights[(c8 + c) * rows + r0 + r] = int4_bf16_bits(std::fma(static_cast<float>(q) - 8.f, scale[r], offset[r]));
            }
#endif
        }
      }
    }
  });
  return out.view({columns, rows});
}
