// The Hessian update of the GPTQ family's statistics, H = beta·H + alpha·XᵀX, for bf16 activations X
// [T, K] and a float32 H [K, K] (PyTorch spec: quantkit/stats.py, InputStats.add). PyTorch has no CPU
// matmul of bf16 inputs with a float32 result: its bf16 matmul rounds the output to bf16, and its
// float32 matmul with oneDNN's bf16 flag converts the float32-held operands again on every call, which
// ran at half the bf16 rate. Here:
// - X is packed once per call into 32-bit words of token pairs (a column's values at tokens 2p and
//   2p + 1), the operand layout of bf16 dot products; each product of two bf16 values is exact in
//   float32. Words sit in 16 x 16 blocks of 1 KB, [column block][pair block][16][16]: `pairs` with a
//   block's rows the token pairs (B tiles, and the vector path's rows), `transposed` with its rows the
//   columns (A tiles). Contiguous blocks, not rows strided by K or by the pair count, which at 4 KB
//   multiples all fall in one L1 set;
// - only the blocks on and above the diagonal are multiplied, then mirrored: H is symmetric, so this
//   is half the multiply-adds of a general product;
// - on AMX, 32 x 32 blocks of H are four tiles, A tiles of `transposed` times B tiles of `pairs`; elsewhere
//   with AVX-512 BF16, 8 x 32 blocks in 16 vector accumulators (vdpbf16ps);
// - work is split in 256 x 256 panels of H, summing the tokens in chunks whose packed slices stay in
//   L2. Each element's sum runs in the same order whatever the thread count (no cross-thread
//   reduction), so results are reproducible.
// Uses infllm_ops.cpp's AMX permission and tile configuration (the sources compile as one unit).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

using torch::Tensor;

namespace gram {

constexpr int64_t kPanel = 256;       // H panel side
constexpr int64_t kChunkPairs = 256;  // token pairs per chunk: a chunk's slices of two panels take 2 x 256 KB
constexpr int64_t kBlock = 32;        // H columns per micro-block (and rows, on AMX)

#ifdef __AVX512BF16__
// H[i][j] += alpha · acc for a block of `rows` rows and `width` columns (a multiple of 16), acc row-major
// with stride ld.
static void add_block(float* H, int64_t K, int64_t i0, int64_t j0, int rows, int width, const float* acc,
                      int64_t ld, float alpha) {
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < width; c += 16) {
      float* h = H + (i0 + r) * K + j0 + c;
      _mm512_storeu_ps(h, _mm512_fmadd_ps(_mm512_loadu_ps(acc + r * ld + c), scale, _mm512_loadu_ps(h)));
    }
}

// Word (pair p, column k) of a blocked layout with PB pair blocks.
static inline int64_t at_word(int64_t PB, int64_t p, int64_t k) {
  return ((k / 16) * PB + p / 16) * 256 + (p % 16) * 16 + k % 16;
}

// One panel, vector path: 8 x 32 blocks, a row's word broadcast against two vectors of column words.
static void panel_vector(const uint32_t* pairs, const uint32_t*, int64_t K, int64_t P, int64_t i_start,
                         int64_t i_end, int64_t j_start, int64_t j_end, float* H, float alpha) {
  constexpr int R = 8;
  const int64_t PB = P / 16;
  alignas(64) float out[R * kBlock];
  for (int64_t p0 = 0; p0 < P; p0 += kChunkPairs) {
    const int64_t p1 = std::min(P, p0 + kChunkPairs);
    for (int64_t j0 = j_start; j0 < j_end; j0 += kBlock)
      for (int64_t i0 = i_start; i0 < i_end && i0 < j0 + kBlock; i0 += R) {
        __m512 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t p = p0; p < p1; ++p) {
          const __m512bh b0 = (__m512bh)_mm512_load_si512(pairs + at_word(PB, p, j0));
          const __m512bh b1 = (__m512bh)_mm512_load_si512(pairs + at_word(PB, p, j0 + 16));
          const uint32_t* a = pairs + at_word(PB, p, i0);
          for (int r = 0; r < R; ++r) {
            const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r]));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
          }
        }
        for (int r = 0; r < R; ++r) {
          _mm512_store_ps(out + r * kBlock, acc[r][0]);
          _mm512_store_ps(out + r * kBlock + 16, acc[r][1]);
        }
        add_block(H, K, i0, j0, R, kBlock, out, kBlock, alpha);
      }
  }
}
#endif

#ifdef INFLLM_AMX
// One panel on AMX: tiles 0-3 the 2 x 2 float32 16 x 16 quarters of a 32 x 32 block, 4-5 blocks of
// `transposed` (16 H rows x 16 token pairs), 6-7 blocks of `pairs` (16 token pairs x 16 H columns).
static void panel_amx(const uint32_t* pairs, const uint32_t* transposed, int64_t K, int64_t P, int64_t i_start,
                      int64_t i_end, int64_t j_start, int64_t j_end, float* H, float alpha) {
  const int64_t PB = P / 16;
  alignas(64) float out[4][256];
  for (int64_t p0 = 0; p0 < P; p0 += kChunkPairs) {
    const int64_t p1 = std::min(P, p0 + kChunkPairs);
    for (int64_t j0 = j_start; j0 < j_end; j0 += kBlock)
      for (int64_t i0 = i_start; i0 < i_end && i0 < j0 + kBlock; i0 += kBlock) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p = p0; p < p1; p += 16) {
          _tile_loadd(4, transposed + at_word(PB, p, i0), 64);
          _tile_loadd(5, transposed + at_word(PB, p, i0 + 16), 64);
          _tile_loadd(6, pairs + at_word(PB, p, j0), 64);
          _tile_loadd(7, pairs + at_word(PB, p, j0 + 16), 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, out[0], 64);
        _tile_stored(1, out[1], 64);
        _tile_stored(2, out[2], 64);
        _tile_stored(3, out[3], 64);
        for (int t = 0; t < 4; ++t) add_block(H, K, i0 + 16 * (t / 2), j0 + 16 * (t % 2), 16, 16, out[t], 16, alpha);
      }
  }
}
#endif

}  // namespace gram

// hessian (float32 [K, K], contiguous) = beta · hessian + alpha · rowsᵀ rows, rows bf16 [T, K], on AMX
// tiles where the CPU has them and `tiles` allows, else on AVX-512 BF16 vectors. Returns false, leaving
// hessian untouched, where this build has no AVX-512 BF16 or K is not a multiple of 32: the caller then
// takes PyTorch's product.
bool bf16_gram_accumulate(Tensor hessian, Tensor rows, double beta, double alpha, bool tiles) {
#ifndef __AVX512BF16__
  return false;
#else
  using namespace gram;
  TORCH_CHECK(rows.dtype() == torch::kBFloat16 && rows.dim() == 2, "rows: bf16 [T, K]");
  const int64_t T = rows.size(0), K = rows.size(1);
  TORCH_CHECK(hessian.dtype() == torch::kFloat32 && hessian.is_contiguous() && hessian.size(0) == K &&
              hessian.size(1) == K, "hessian: contiguous float32 [K, K] for rows of K = ", K);
  if (K % kBlock) return false;
  const Tensor x = rows.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t P = (T + 31) / 32 * 16, PB = P / 16;  // token pairs, padded with zero words to whole blocks
#ifdef INFLLM_AMX
  const bool amx = tiles && infllm::amx_permitted();
#else
  const bool amx = false;
#endif
  auto* pairs = static_cast<uint32_t*>(std::aligned_alloc(64, P * K * 4));
  auto* transposed = amx ? static_cast<uint32_t*>(std::aligned_alloc(64, P * K * 4)) : nullptr;
  const std::unique_ptr<uint32_t, decltype(&std::free)> own_pairs(pairs, &std::free), own_transposed(transposed, &std::free);
  TORCH_CHECK(pairs != nullptr && (transposed != nullptr || !amx), "out of memory packing ", T, " x ", K, " rows");
  at::parallel_for(0, K / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kb = begin; kb < end; ++kb)
      for (int64_t p = 0; p < P; ++p) {
        uint32_t* dst = pairs + at_word(PB, p, 16 * kb);
        const uint16_t* first = src + 2 * p * K + 16 * kb;
        for (int c = 0; c < 16; ++c)
          dst[c] = (2 * p < T ? first[c] : 0u) | (2 * p + 1 < T ? static_cast<uint32_t>(first[K + c]) << 16 : 0u);
      }
  });
  if (amx) {
    at::parallel_for(0, K / 16 * PB, 16, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(pairs + block * 256 + 16 * i);
        infllm::transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(transposed + block * 256 + 16 * i, r[i]);
      }
    });
  }
  float* H = hessian.data_ptr<float>();
  const float beta_f = static_cast<float>(beta), alpha_f = static_cast<float>(alpha);
  if (beta_f != 1.f) {
    at::parallel_for(0, K, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t j = i; j < K; ++j) H[i * K + j] *= beta_f;
    });
  }
  const int64_t panels = (K + kPanel - 1) / kPanel;
  std::vector<std::pair<int64_t, int64_t>> work;  // (row panel, column panel), on and above the diagonal
  for (int64_t a = 0; a < panels; ++a)
    for (int64_t b = a; b < panels; ++b) work.emplace_back(a, b);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
#ifdef INFLLM_AMX
    const infllm::TileScope tile_state(amx);
#endif
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i_start = work[w].first * kPanel, i_end = std::min(K, i_start + kPanel);
      const int64_t j_start = work[w].second * kPanel, j_end = std::min(K, j_start + kPanel);
#ifdef INFLLM_AMX
      if (amx) {
        panel_amx(pairs, transposed, K, P, i_start, i_end, j_start, j_end, H, alpha_f);
        continue;
      }
#endif
      panel_vector(pairs, transposed, K, P, i_start, i_end, j_start, j_end, H, alpha_f);
    }
  });
  // below the diagonal: a copy of what is above, in 64 x 64 tiles
  at::parallel_for(0, (K + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bi = begin; bi < end; ++bi)
      for (int64_t bj = 0; bj <= bi; ++bj)
        for (int64_t i = bi * 64; i < std::min(K, bi * 64 + 64); ++i)
          for (int64_t j = bj * 64; j < std::min(i, bj * 64 + 64); ++j) H[i * K + j] = H[j * K + i];
  });
  return true;
#endif
}
