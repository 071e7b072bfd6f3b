// Fused glue of one decode step on the CPU. A 135M-parameter model runs ~1,500 small PyTorch
// operators per token; each costs a few microseconds of dispatch, more than its arithmetic. These
// loops replace the longest runs of them (see kernels/cpu_ops/__init__.py for the PyTorch spec of
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
// 16w..16w+15, bit j set for +1 and bit 16+j for -1. Sums x over each group's + and - channels,
// times the group's scale; ROWS activation rows share each word's masks. float32 [ROWS, N].
// BLOCK output rows at a time, with separate + and - sums, keep 2·BLOCK·ROWS independent add
// chains in flight: one chain per row is latency-bound (4 cycles per masked add) at 1.8x slower.
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
#else
template <int ROWS, int BLOCK>
static void ternary_block(const float* x, const uint32_t* planes, const at::Half* scales, float* out,
                          int64_t n, int64_t n_out, int64_t words, int64_t groups, int64_t group_words) {
  for (int b = 0; b < BLOCK; ++b) {
    const uint32_t* row = planes + (n + b) * words;
    for (int r = 0; r < ROWS; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.f;
        for (int64_t w = g * group_words; w < std::min(words, (g + 1) * group_words); ++w) {
          for (int j = 0; j < 16; ++j) {
            const float xj = x[(r * words + w) * 16 + j];
            acc += ((row[w] >> j) & 1u) ? xj : (((row[w] >> (16 + j)) & 1u) ? -xj : 0.f);
          }
        }
        total += static_cast<float>(scales[(n + b) * groups + g]) * acc;
      }
      out[r * n_out + n + b] = total;
    }
  }
}
#endif

template <int ROWS>
static void ternary_rows(const float* x, const uint32_t* planes, const at::Half* scales, float* out,
                         int64_t n_out, int64_t words, int64_t groups, int64_t group_words) {
  constexpr int BLOCK = ROWS == 1 ? 4 : 2;  // 8 or 2·2·ROWS accumulators of the 32 vector registers
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
