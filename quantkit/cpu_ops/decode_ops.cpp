// Fused glue of one decode step on the CPU. A 135M-parameter model runs ~1,500 small PyTorch
// operators per token; each costs a few microseconds of dispatch, more than its arithmetic. These
// loops replace the longest runs of them (see quantkit/cpu_ops/__init__.py for the PyTorch spec of
// each function, which the tests compare against).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

using torch::Tensor;

// RMSNorm of float32 rows, scaled by a float32 weight, rounded to bf16.
Tensor rms_norm_bf16(Tensor x, Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [T, H]");
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty({rows, width}, x.options().dtype(torch::kBFloat16));
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  auto* dst = out.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * width;
    float sum = 0.f;
    for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
    const float inv = 1.f / std::sqrt(sum / width + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) dst[r * width + i] = at::BFloat16(row[i] * inv * w[i]);
  }
  return out;
}

// RoPE on the q and k heads of a fused qkv projection (bf16 [T, (Hq + 2 Hkv) d]) in float32,
// rotated k and raw v written into the bf16 caches [Hkv, capacity, d] at positions start..;
// returns the rotated queries, float32 [Hq, T, d]. rotate_half(x)·sin == roll(x, d/2)·signed_sin.
Tensor rope_and_store(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor key_cache, Tensor value_cache,
                      int64_t start, int64_t q_heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dtype() == torch::kBFloat16 && qkv.is_contiguous(), "qkv: contiguous bf16");
  TORCH_CHECK(key_cache.dtype() == torch::kBFloat16 && value_cache.dtype() == torch::kBFloat16, "bf16 caches");
  const int64_t tokens = qkv.size(0), dim = cos.size(1), half = dim / 2, capacity = key_cache.size(1);
  TORCH_CHECK(start + tokens <= capacity, "cache too small");
  auto queries = torch::empty({q_heads, tokens, dim}, cos.options());
  const auto* src = qkv.data_ptr<at::BFloat16>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  float* q_out = queries.data_ptr<float>();
  auto* k_out = key_cache.data_ptr<at::BFloat16>();
  auto* v_out = value_cache.data_ptr<at::BFloat16>();
  const int64_t row_width = (q_heads + 2 * kv_heads) * dim;
  std::vector<float> rotated(dim);
  for (int64_t t = 0; t < tokens; ++t) {
    const auto* row = src + t * row_width;
    const float* ct = c + t * dim;
    const float* st = s + t * dim;
    for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
      const auto* x = row + h * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float rolled = static_cast<float>(x[i < half ? i + half : i - half]);
        rotated[i] = static_cast<float>(x[i]) * ct[i] + rolled * st[i];
      }
      if (h < q_heads) {
        std::copy(rotated.begin(), rotated.end(), q_out + (h * tokens + t) * dim);
      } else {
        auto* dst = k_out + ((h - q_heads) * capacity + start + t) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = at::BFloat16(rotated[i]);
      }
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::copy(row + (q_heads + kv_heads + h) * dim, row + (q_heads + kv_heads + h + 1) * dim,
                v_out + (h * capacity + start + t) * dim);
    }
  }
  return queries;
}

// Attention of one query token (float32 [Hq, 1, d]) over the first `length` cached bf16 keys and
// values; returns bf16 [1, Hq * d], o_proj's input. The query heads of a KV group share each key
// and value row as it streams by (the step is bound by reading the cache); KV groups run in parallel.
Tensor decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, int64_t length, double scale) {
  TORCH_CHECK(key_cache.dtype() == torch::kBFloat16 && value_cache.dtype() == torch::kBFloat16, "bf16 caches");
  const int64_t q_heads = query.size(0), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), capacity = key_cache.size(1), group = q_heads / kv_heads;
  auto out = torch::empty({1, q_heads * dim}, query.options().dtype(torch::kBFloat16));
  const float* q = query.data_ptr<float>();
  const auto* keys = key_cache.data_ptr<at::BFloat16>();
  const auto* values = value_cache.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * length), acc(group * dim), row(dim), best(group), total(group);
    for (int64_t kv = begin; kv < end; ++kv) {
      const float* qg = q + kv * group * dim;
      for (int64_t j = 0; j < length; ++j) {
        const auto* k = keys + (kv * capacity + j) * dim;
        for (int64_t i = 0; i < dim; ++i) row[i] = static_cast<float>(k[i]);
        for (int64_t h = 0; h < group; ++h) {
          float dot = 0.f;
          for (int64_t i = 0; i < dim; ++i) dot += qg[h * dim + i] * row[i];
          scores[h * length + j] = dot * scale_f;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float m = -1e30f;  // not -inf: -ffast-math assumes no infinities
        for (int64_t j = 0; j < length; ++j) m = std::max(m, scores[h * length + j]);
        float sum = 0.f;
        for (int64_t j = 0; j < length; ++j) {
          scores[h * length + j] = std::exp(scores[h * length + j] - m);
          sum += scores[h * length + j];
        }
        total[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < length; ++j) {
        const auto* v = values + (kv * capacity + j) * dim;
        for (int64_t i = 0; i < dim; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * length + j];
          for (int64_t i = 0; i < dim; ++i) acc[h * dim + i] += p * row[i];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        for (int64_t i = 0; i < dim; ++i) dst[(kv * group + h) * dim + i] = at::BFloat16(acc[h * dim + i] / total[h]);
      }
    }
  });
  return out;
}

// silu(gate) * up of a fused gate_up projection (bf16 [T, 2I]) -> bf16 [T, I].
Tensor silu_mul(Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kBFloat16 && gate_up.is_contiguous(), "gate_up: contiguous bf16");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  const auto* src = gate_up.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) {
      const float g = static_cast<float>(src[r * 2 * width + i]);
      const float u = static_cast<float>(src[r * 2 * width + width + i]);
      dst[r * width + i] = at::BFloat16(g / (1.f + std::exp(-g)) * u);
    }
  }
  return out;
}

// Ternary weights as bit planes (quantkit/formats/ternary.py): word w of a row holds input channels
// 16w..16w+15, bit j set for +1 and bit 16+j for -1. Sums x times each group's trits, times the
// group's scale; ROWS activation rows share each word's decoded weights. float32 [ROWS, N]. BLOCK
// output rows at a time keep 2·BLOCK·ROWS (AVX-512) or BLOCK·ROWS (AVX2) independent add chains in
// flight. The path is picked at compile time (-march=native):
// - AVX-512: two masked adds per 16 weights (into a + sum and a - sum), the masks are the word's halves.
//   One chain per row is latency-bound (4 cycles per masked add) at 1.8x slower.
// - AVX2 + FMA (most desktops): per 8 weights srlv, and, madd_epi16, cvt turn the word into ±1.0/0
//   floats (below), then one FMA per activation row into a per-group sum. On a 2-core AVX2 EPYC
//   (one thread, 4096x4096 g32, one row, kernel alone, same runs): 1.6-2.0 ms, where compare-equal
//   lane masks anded into separate + and - sums took 1.2-1.9x as long, a 256-entry table of lane
//   masks 1.3-1.7x, and the branchy scalar loop this replaced 84 ms. bench_linear (2 threads,
//   MiniCPM4.1-8B shapes, one row): 0.5-2.4x a bf16 GEMV (was 0.05-0.09x), int4's 1.0-3.3x.
// - portable (ARM NEON, x86 without AVX2): branchless loops over the 16 lanes of a word that -O3
//   vectorizes: a 256-entry table of {0, 1} floats per byte gives the trit as table[+ byte] -
//   table[- byte], times the scale, accumulated per lane. 7.0 ms in the measurement above when
//   built with -mno-avx2 (12 ms with the trit from bit tests instead of the table).
#ifdef __AVX512F__
template <int ROWS, int BLOCK>
static void ternary_block(const float* x, const uint32_t* planes, const at::Half* scales, float* out,
                          int64_t n, int64_t n_out, int64_t words, int64_t groups, int64_t group_words) {
  __m512 total[BLOCK][ROWS];
  for (int b = 0; b < BLOCK; ++b)
    for (int r = 0; r < ROWS; ++r) total[b][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 plus_sum[BLOCK][ROWS], minus_sum[BLOCK][ROWS];
    for (int b = 0; b < BLOCK; ++b)
      for (int r = 0; r < ROWS; ++r) plus_sum[b][r] = minus_sum[b][r] = _mm512_setzero_ps();
    for (int64_t w = g * group_words; w < std::min(words, (g + 1) * group_words); ++w) {
      __m512 xv[ROWS];
      for (int r = 0; r < ROWS; ++r) xv[r] = _mm512_loadu_ps(x + (r * words + w) * 16);
      for (int b = 0; b < BLOCK; ++b) {
        const uint32_t bits = planes[(n + b) * words + w];
        const __mmask16 plus = static_cast<__mmask16>(bits), minus = static_cast<__mmask16>(bits >> 16);
        for (int r = 0; r < ROWS; ++r) {
          plus_sum[b][r] = _mm512_mask_add_ps(plus_sum[b][r], plus, plus_sum[b][r], xv[r]);
          minus_sum[b][r] = _mm512_mask_add_ps(minus_sum[b][r], minus, minus_sum[b][r], xv[r]);
        }
      }
    }
    for (int b = 0; b < BLOCK; ++b) {
      const __m512 scale = _mm512_set1_ps(static_cast<float>(scales[(n + b) * groups + g]));
      for (int r = 0; r < ROWS; ++r)
        total[b][r] = _mm512_fmadd_ps(scale, _mm512_sub_ps(plus_sum[b][r], minus_sum[b][r]), total[b][r]);
    }
  }
  for (int b = 0; b < BLOCK; ++b)
    for (int r = 0; r < ROWS; ++r) out[r * n_out + n + b] = _mm512_reduce_add_ps(total[b][r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float ternary_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The trits of 8 lanes of a word (broadcast to every lane) as floats +1, -1 or 0: shifting lane i
// right by its channel j brings bits j and 16+j to bits 0 and 16, an int16 pair (+, -) that
// madd_epi16 with (1, -1) turns into the int32 difference.
static inline __m256 ternary_trits(__m256i word, __m256i channels) {
  const __m256i pair = _mm256_and_si256(_mm256_srlv_epi32(word, channels), _mm256_set1_epi32(0x00010001));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pair, _mm256_set1_epi32(static_cast<int>(0xFFFF0001u))));
}

template <int ROWS, int BLOCK>
static void ternary_block(const float* x, const uint32_t* planes, const at::Half* scales, float* out,
                          int64_t n, int64_t n_out, int64_t words, int64_t groups, int64_t group_words) {
  const __m256i low = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), high = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  __m256 total[BLOCK][ROWS];
  for (int b = 0; b < BLOCK; ++b)
    for (int r = 0; r < ROWS; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 sum[BLOCK][ROWS];
    for (int b = 0; b < BLOCK; ++b)
      for (int r = 0; r < ROWS; ++r) sum[b][r] = _mm256_setzero_ps();
    for (int64_t w = g * group_words; w < std::min(words, (g + 1) * group_words); ++w) {
      for (int b = 0; b < BLOCK; ++b) {
        const __m256i word = _mm256_set1_epi32(static_cast<int>(planes[(n + b) * words + w]));
        const __m256 trits_low = ternary_trits(word, low), trits_high = ternary_trits(word, high);
        for (int r = 0; r < ROWS; ++r) {
          const float* xw = x + (r * words + w) * 16;
          sum[b][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xw), trits_low, sum[b][r]);
          sum[b][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xw + 8), trits_high, sum[b][r]);
        }
      }
    }
    for (int b = 0; b < BLOCK; ++b) {
      const __m256 scale = _mm256_set1_ps(static_cast<float>(scales[(n + b) * groups + g]));
      for (int r = 0; r < ROWS; ++r) total[b][r] = _mm256_fmadd_ps(scale, sum[b][r], total[b][r]);
    }
  }
  for (int b = 0; b < BLOCK; ++b)
    for (int r = 0; r < ROWS; ++r) out[r * n_out + n + b] = ternary_hsum(total[b][r]);
}
#else
struct TernaryBitTable { float lanes[256][8]; };  // lanes[byte][j]: bit j of byte, 1.f or 0.f
static constexpr TernaryBitTable ternary_bit_table() {
  TernaryBitTable table{};
  for (int byte = 0; byte < 256; ++byte)
    for (int j = 0; j < 8; ++j) table.lanes[byte][j] = static_cast<float>((byte >> j) & 1);
  return table;
}
static constexpr TernaryBitTable kTernaryBits = ternary_bit_table();

template <int ROWS, int BLOCK>
static void ternary_block(const float* x, const uint32_t* planes, const at::Half* scales, float* out,
                          int64_t n, int64_t n_out, int64_t words, int64_t groups, int64_t group_words) {
  for (int b = 0; b < BLOCK; ++b) {
    const uint32_t* row = planes + (n + b) * words;
    float total[ROWS][16] = {};  // per-lane sums, summed across lanes at the end
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = static_cast<float>(scales[(n + b) * groups + g]);
      for (int64_t w = g * group_words; w < std::min(words, (g + 1) * group_words); ++w) {
        const uint32_t bits = row[w];
        const float* plus_low = kTernaryBits.lanes[bits & 0xFF];
        const float* plus_high = kTernaryBits.lanes[(bits >> 8) & 0xFF];
        const float* minus_low = kTernaryBits.lanes[(bits >> 16) & 0xFF];
        const float* minus_high = kTernaryBits.lanes[bits >> 24];
        float weight[16];
        for (int j = 0; j < 8; ++j) weight[j] = scale * (plus_low[j] - minus_low[j]);
        for (int j = 0; j < 8; ++j) weight[8 + j] = scale * (plus_high[j] - minus_high[j]);
        for (int r = 0; r < ROWS; ++r) {
          const float* xw = x + (r * words + w) * 16;
          for (int j = 0; j < 16; ++j) total[r][j] += weight[j] * xw[j];
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += total[r][j];
      out[r * n_out + n + b] = sum;
    }
  }
}
#endif

template <int ROWS>
static void ternary_rows(const float* x, const uint32_t* planes, const at::Half* scales, float* out,
                         int64_t n_out, int64_t words, int64_t groups, int64_t group_words) {
  constexpr int BLOCK = ROWS == 1 ? 4 : 2;
  at::parallel_for(0, (n_out + BLOCK - 1) / BLOCK, 8, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block * BLOCK;
      if (n + BLOCK <= n_out) {
        ternary_block<ROWS, BLOCK>(x, planes, scales, out, n, n_out, words, groups, group_words);
      } else {
        for (int64_t tail = n; tail < n_out; ++tail)
          ternary_block<ROWS, 1>(x, planes, scales, out, tail, n_out, words, groups, group_words);
      }
    }
  });
}

Tensor ternary_gemv(Tensor x, Tensor planes, Tensor scales, int64_t group_size) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [M, K]");
  TORCH_CHECK(planes.dtype() == torch::kInt32 && planes.is_contiguous() && planes.dim() == 2,
              "planes: contiguous int32 [N, K/16]");
  TORCH_CHECK(scales.dtype() == torch::kFloat16 && scales.is_contiguous() && scales.size(0) == planes.size(0),
              "scales: contiguous float16 [N, G]");
  const int64_t rows = x.size(0), n_out = planes.size(0), words = planes.size(1), groups = scales.size(1);
  TORCH_CHECK(x.size(1) == words * 16, "x has ", x.size(1), " columns, the planes hold ", words * 16);
  const int64_t group_words = group_size == -1 ? words : group_size / 16;
  TORCH_CHECK(group_words > 0 && (words + group_words - 1) / group_words == groups, "scales do not match the groups");
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xs = x.data_ptr<float>();
  const auto* p = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  const auto* s = scales.data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  switch (rows) {
    case 1: ternary_rows<1>(xs, p, s, o, n_out, words, groups, group_words); break;
    case 2: ternary_rows<2>(xs, p, s, o, n_out, words, groups, group_words); break;
    case 3: ternary_rows<3>(xs, p, s, o, n_out, words, groups, group_words); break;
    case 4: ternary_rows<4>(xs, p, s, o, n_out, words, groups, group_words); break;
    default: TORCH_CHECK(false, "ternary_gemv takes 1 to 4 rows, got ", rows);
  }
  return out;
}
