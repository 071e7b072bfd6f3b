// Fused glue of one decode step on the CPU. A 135M-parameter model runs ~1,500 small PyTorch
// operators per token; each costs a few microseconds of dispatch, more than its arithmetic. These
// loops replace the longest runs of them (see kernels/cpu_ops/__init__.py for the PyTorch spec of
// each function, which the tests compare against).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <cmath>
#include <vector>

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
