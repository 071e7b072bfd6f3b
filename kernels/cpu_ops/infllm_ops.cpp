// InfLLM v2's two stages for one decode step, reading the bf16 caches in place (their PyTorch
// specification is kernels/infllm/cpu.py: stage1_scores and block_sparse_attention, T = 1).
//
// A decode step at 64K keys scores ~4,096 compressed keys and attends ~6,144 selected keys per KV
// head. PyTorch needs float32 copies of the compressed keys for its matmul and gathered copies of
// the selected blocks for SDPA, which together cost as much as the attention itself; here both
// stages read the bf16 rows where they lie. Keys are scored 16 at a time, one key per vector lane:
// a 16 x 16 transpose of their 32-bit dim pairs, amortised over the query heads of the KV group,
// replaces a horizontal sum per (head, key). Values accumulate with the dims in the lanes.
// Softmax is online per block; KV heads and ranges of blocks run in parallel and merge at the end.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <climits>
#include <cmath>
#include <functional>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

using torch::Tensor;

namespace infllm {

using Bf16 = at::BFloat16;
constexpr float kMinusHuge = -1e30f;  // not -inf: -ffast-math assumes no infinities
constexpr int64_t kMaxDim = 256;

// One KV group's query heads, float32 rows [heads, dim]; scores are q · k · scale.
struct Queries {
  const float* values;
  int64_t heads, dim;
  float scale;
};

#ifdef __AVX512F__
// exp(x) for x <= 0 to ~2e-7 relative: 2^n · 2^f, a degree-6 Taylor polynomial of 2^f on [-1/2, 1/2].
static inline __m512 exp_ps(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // f·ln2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first(int64_t count) { return static_cast<__mmask16>((1u << std::min<int64_t>(count, 16)) - 1); }

// x[i] = exp(x[i] - shift) for i < n; returns their sum.
static float exp_shifted(float* x, int64_t n, float shift) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(shift);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

static float max_of(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(kMinusHuge);
  for (int64_t i = 0; i < n; i += 16) best = _mm512_mask_max_ps(best, first(n - i), best, _mm512_loadu_ps(x + i));
  return _mm512_reduce_max_ps(best);
}

// In place: word c of each of 16 rows -> row c holds that word of every input row, rows in the lanes.
static void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // u[4a + c], 128-bit lane k: rows 4a..4a+3 of word 4k + c
    u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v2 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i w = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v, w, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v, w, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v2, w2, 0xdd);
  }
}

// bf16 pairs in 32-bit words -> float32 of the first (low) and second (high) element.
static inline __m512 low_bf16(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 high_bf16(__m512i w) {
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Scores of query heads h0..h0+H-1 for 16 keys given as dim/2 vectors of transposed dim pairs;
// stored (scaled) for the first `rows` keys at out[h * ld + lane].
template <int H>
static void score_heads(const Queries& q, int64_t h0, const __m512i* pairs, float* out, int64_t ld, __mmask16 rows) {
  const int64_t dim = q.dim, half = dim / 2;
  __m512 acc[H];
  for (int h = 0; h < H; ++h) acc[h] = _mm512_setzero_ps();
  const float* v = q.values + h0 * dim;
  for (int64_t p = 0; p < half; ++p) {
    const __m512 lo = low_bf16(pairs[p]), hi = high_bf16(pairs[p]);
    for (int h = 0; h < H; ++h) {
      acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(v[h * dim + 2 * p]), lo, acc[h]);
      acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(v[h * dim + 2 * p + 1]), hi, acc[h]);
    }
  }
  const __m512 scale = _mm512_set1_ps(q.scale);
  for (int h = 0; h < H; ++h) _mm512_mask_storeu_ps(out + h * ld, rows, _mm512_mul_ps(acc[h], scale));
}

// scores[h * ld + j] = scale · q[h] · keys[j] for every query head and n bf16 key rows (stride dim).
static void score_keys(const Queries& q, const Bf16* keys, int64_t n, float* scores, int64_t ld) {
  const int64_t dim = q.dim;
  __m512i pairs[kMaxDim / 2];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - j0);
    for (int64_t chunk = 0; chunk < dim / 32; ++chunk) {  // 32 dims = 16 pairs per row
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_loadu_si512(keys + (j0 + i) * dim + 32 * chunk) : _mm512_setzero_si512();
      transpose16(r);
      std::copy(r, r + 16, pairs + 16 * chunk);
    }
    for (int64_t h = 0; h < q.heads;) {
      const int64_t left = q.heads - h;
      float* out = scores + h * ld + j0;
      if (left >= 8) { score_heads<8>(q, h, pairs, out, ld, first(rows)); h += 8; }
      else if (left >= 4) { score_heads<4>(q, h, pairs, out, ld, first(rows)); h += 4; }
      else if (left >= 2) { score_heads<2>(q, h, pairs, out, ld, first(rows)); h += 2; }
      else { score_heads<1>(q, h, pairs, out, ld, first(rows)); h += 1; }
    }
  }
}

template <int H>
static void accumulate_heads(const float* p, int64_t ldp, const Bf16* values, int64_t n, int64_t dim, float* acc) {
  for (int64_t c = 0; c < dim; c += 16) {
    __m512 a[H];
    for (int h = 0; h < H; ++h) a[h] = _mm512_loadu_ps(acc + h * dim + c);
    for (int64_t j = 0; j < n; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + j * dim + c));
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      for (int h = 0; h < H; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * ldp + j]), v, a[h]);
    }
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(acc + h * dim + c, a[h]);
  }
}

// acc[h] += sum_j p[h * ldp + j] · values[j] for `heads` rows of weights over n bf16 value rows.
static void accumulate_values(const float* p, int64_t ldp, int64_t heads, const Bf16* values, int64_t n, int64_t dim,
                              float* acc) {
  for (int64_t h = 0; h < heads;) {
    const int64_t left = heads - h;
    const float* ph = p + h * ldp;
    float* ah = acc + h * dim;
    if (left >= 8) { accumulate_heads<8>(ph, ldp, values, n, dim, ah); h += 8; }
    else if (left >= 4) { accumulate_heads<4>(ph, ldp, values, n, dim, ah); h += 4; }
    else if (left >= 2) { accumulate_heads<2>(ph, ldp, values, n, dim, ah); h += 2; }
    else { accumulate_heads<1>(ph, ldp, values, n, dim, ah); h += 1; }
  }
}
#else
static float exp_shifted(float* x, int64_t n, float shift) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

static float max_of(const float* x, int64_t n) { return n ? *std::max_element(x, x + n) : kMinusHuge; }

static void score_keys(const Queries& q, const Bf16* keys, int64_t n, float* scores, int64_t ld) {
  for (int64_t h = 0; h < q.heads; ++h)
    for (int64_t j = 0; j < n; ++j) {
      float dot = 0.f;
      for (int64_t i = 0; i < q.dim; ++i) dot += q.values[h * q.dim + i] * static_cast<float>(keys[j * q.dim + i]);
      scores[h * ld + j] = dot * q.scale;
    }
}

static void accumulate_values(const float* p, int64_t ldp, int64_t heads, const Bf16* values, int64_t n, int64_t dim,
                              float* acc) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < dim; ++i) acc[h * dim + i] += p[h * ldp + j] * static_cast<float>(values[j * dim + i]);
}
#endif

// Running softmax state of `heads` query rows over the keys seen so far: max, sum of exp, sum of exp·v.
struct Partial {
  std::vector<float> best, total, acc;
  Partial(int64_t heads, int64_t dim) : best(heads, kMinusHuge), total(heads, 0.f), acc(heads * dim, 0.f) {}
};

// Splits each KV head's work in ranges so that the (KV head, range) tasks keep every thread busy.
static int64_t ranges_per_head(int64_t kv_heads, int64_t items) {
  const int64_t wanted = (2 * at::get_num_threads() + kv_heads - 1) / kv_heads;
  return std::max<int64_t>(1, std::min(wanted, items));
}

static void check_rows(const Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dtype() == torch::kBFloat16 && t.dim() == 3, name, ": bf16 [Hkv, n, d]");
  TORCH_CHECK(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == dim), name, ": rows of d contiguous elements");
}

// The query heads of each KV group; `storage` keeps the float32 copy they point into alive.
static std::vector<Queries> group_queries(const Tensor& query, int64_t kv_heads, int64_t dim, double scale,
                                          Tensor& storage) {
  TORCH_CHECK(query.dim() == 2 && query.size(1) == dim && query.size(0) % kv_heads == 0,
              "query: [Hq, d], Hq a multiple of the ", kv_heads, " KV heads");
  TORCH_CHECK(dim % 32 == 0 && dim <= kMaxDim, "head dim must be a multiple of 32, at most ", kMaxDim, ", got ", dim);
  storage = query.to(torch::kFloat32).contiguous();
  const int64_t group = query.size(0) / kv_heads;
  std::vector<Queries> groups;
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    groups.push_back({storage.data_ptr<float>() + kv * group * dim, group, dim, static_cast<float>(scale)});
  return groups;
}

}  // namespace infllm

// Stage 1 for one query: [Hkv, n1] float32, score[g, c] = sum over the group's heads h of
// exp(s_h(c) - lse_h), s_h(c) = q_h · fine_c · scale, lse_h the log-sum-exp of q_h · coarse · scale.
// Every compressed key in the caches is visible to the newest token.
Tensor infllm_decode_scores(Tensor query, Tensor fine, Tensor coarse, double scale) {
  using namespace infllm;
  const int64_t dim = query.size(-1), kv_heads = fine.size(0), n1 = fine.size(1), n2 = coarse.size(1);
  check_rows(fine, "fine", dim);
  check_rows(coarse, "coarse", dim);
  TORCH_CHECK(n2 > 0, "no coarse key yet: the log-sum-exp is undefined");
  Tensor storage;
  const std::vector<Queries> queries = group_queries(query, kv_heads, dim, scale, storage);
  const int64_t group = queries[0].heads;
  constexpr int64_t kKeys = 64;

  const int64_t coarse_ranges = ranges_per_head(kv_heads, (n2 + kKeys - 1) / kKeys);
  std::vector<Partial> lse_parts(kv_heads * coarse_ranges, Partial(group, 0));
  at::parallel_for(0, kv_heads * coarse_ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(group * kKeys);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / coarse_ranges, r = task % coarse_ranges;
      Partial& part = lse_parts[task];
      const Bf16* keys = coarse.data_ptr<Bf16>() + kv * coarse.stride(0);
      for (int64_t j0 = n2 * r / coarse_ranges; j0 < n2 * (r + 1) / coarse_ranges; j0 += kKeys) {
        const int64_t n = std::min(kKeys, n2 * (r + 1) / coarse_ranges - j0);
        score_keys(queries[kv], keys + j0 * dim, n, s.data(), kKeys);
        for (int64_t h = 0; h < group; ++h) {
          const float best = std::max(part.best[h], max_of(s.data() + h * kKeys, n));
          part.total[h] = part.total[h] * std::exp(part.best[h] - best) + exp_shifted(s.data() + h * kKeys, n, best);
          part.best[h] = best;
        }
      }
    }
  });
  std::vector<float> lse(kv_heads * group);
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    for (int64_t h = 0; h < group; ++h) {
      float best = kMinusHuge, total = 0.f;
      for (int64_t r = 0; r < coarse_ranges; ++r) best = std::max(best, lse_parts[kv * coarse_ranges + r].best[h]);
      for (int64_t r = 0; r < coarse_ranges; ++r) {
        const Partial& part = lse_parts[kv * coarse_ranges + r];
        total += part.total[h] * std::exp(part.best[h] - best);
      }
      lse[kv * group + h] = best + std::log(total);
    }

  auto out = torch::zeros({kv_heads, n1}, query.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  const int64_t fine_ranges = ranges_per_head(kv_heads, (n1 + kKeys - 1) / kKeys);
  at::parallel_for(0, kv_heads * fine_ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(group * kKeys);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / fine_ranges, r = task % fine_ranges;
      const Bf16* keys = fine.data_ptr<Bf16>() + kv * fine.stride(0);
      for (int64_t j0 = n1 * r / fine_ranges; j0 < n1 * (r + 1) / fine_ranges; j0 += kKeys) {
        const int64_t n = std::min(kKeys, n1 * (r + 1) / fine_ranges - j0);
        score_keys(queries[kv], keys + j0 * dim, n, s.data(), kKeys);
        float* dst = o + kv * n1 + j0;
        for (int64_t h = 0; h < group; ++h) {
          exp_shifted(s.data() + h * kKeys, n, lse[kv * group + h]);
          for (int64_t j = 0; j < n; ++j) dst[j] += s[h * kKeys + j];
        }
      }
    }
  });
  return out;
}

// Stage 2 for one query: attention of each KV group's query heads over its selected blocks of the
// first `length` keys (blocks [Hkv, k] int64, each in [0, ceil(length / block_size))), read in place
// from the bf16 caches [Hkv, >= length, d]. Returns float32 [Hq, d].
Tensor infllm_decode_attention(Tensor query, Tensor keys, Tensor values, Tensor blocks, int64_t length,
                               int64_t block_size, double scale) {
  using namespace infllm;
  const int64_t dim = query.size(-1), kv_heads = keys.size(0);
  check_rows(keys, "keys", dim);
  check_rows(values, "values", dim);
  TORCH_CHECK(keys.size(1) >= length && values.size(1) >= length, "the caches hold fewer than ", length, " keys");
  TORCH_CHECK(blocks.dtype() == torch::kInt64 && blocks.dim() == 2 && blocks.size(0) == kv_heads, "blocks: int64 [Hkv, k]");
  Tensor storage;
  const std::vector<Queries> queries = group_queries(query, kv_heads, dim, scale, storage);
  const Tensor chosen = blocks.contiguous();
  const int64_t group = queries[0].heads, selected = chosen.size(1);
  const int64_t* idx = chosen.data_ptr<int64_t>();
  const int64_t last = (length + block_size - 1) / block_size;
  for (int64_t i = 0; i < chosen.numel(); ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < last, "block ", idx[i], " outside the ", last, " blocks of ", length, " keys");

  const int64_t ranges = ranges_per_head(kv_heads, selected);
  std::vector<Partial> parts(kv_heads * ranges, Partial(group, dim));
  at::parallel_for(0, kv_heads * ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(group * block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / ranges, r = task % ranges;
      Partial& part = parts[task];
      const Bf16* k = keys.data_ptr<Bf16>() + kv * keys.stride(0);
      const Bf16* v = values.data_ptr<Bf16>() + kv * values.stride(0);
      for (int64_t slot = selected * r / ranges; slot < selected * (r + 1) / ranges; ++slot) {
        const int64_t start = idx[kv * selected + slot] * block_size, n = std::min(block_size, length - start);
        score_keys(queries[kv], k + start * dim, n, p.data(), block_size);
        for (int64_t h = 0; h < group; ++h) {
          const float best = std::max(part.best[h], max_of(p.data() + h * block_size, n));
          const float shrink = std::exp(part.best[h] - best);
          part.total[h] = part.total[h] * shrink + exp_shifted(p.data() + h * block_size, n, best);
          part.best[h] = best;
          if (shrink != 1.f)
            for (int64_t i = 0; i < dim; ++i) part.acc[h * dim + i] *= shrink;
        }
        accumulate_values(p.data(), block_size, group, v + start * dim, n, dim, part.acc.data());
      }
    }
  });
  auto out = torch::empty({kv_heads * group, dim}, storage.options());
  float* o = out.data_ptr<float>();
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    for (int64_t h = 0; h < group; ++h) {
      float best = kMinusHuge, total = 0.f;
      for (int64_t r = 0; r < ranges; ++r) best = std::max(best, parts[kv * ranges + r].best[h]);
      float* dst = o + (kv * group + h) * dim;
      std::fill(dst, dst + dim, 0.f);
      for (int64_t r = 0; r < ranges; ++r) {
        const Partial& part = parts[kv * ranges + r];
        const float weight = std::exp(part.best[h] - best);
        total += part.total[h] * weight;
        for (int64_t i = 0; i < dim; ++i) dst[i] += part.acc[h * dim + i] * weight;
      }
      for (int64_t i = 0; i < dim; ++i) dst[i] /= total;
    }
  return out;
}

// Block selection for one query, as kernels/infllm/cpu.py block_scores + select_blocks: each block's
// score is the max over stage-1 scores [4j-1, 4j+4) (pool_stride 4; none: -inf); the first
// init_blocks blocks and the last local_blocks + 1 (the query's own block is the last) are forced
// (+inf); the `count` best blocks, ties to the earlier block, are returned ascending [Hkv, count].
// Works on order-preserving integers of the float bits, so +-0 tie and +-inf order exactly as
// PyTorch's stable sort, whatever -ffast-math assumes about floats.
Tensor infllm_decode_select(Tensor scores, int64_t num_blocks, int64_t pool_stride, int64_t init_blocks,
                            int64_t local_blocks, int64_t count) {
  TORCH_CHECK(scores.dtype() == torch::kFloat32 && scores.dim() == 2, "scores: float32 [Hkv, n1]");
  TORCH_CHECK(count >= 1 && count <= num_blocks, "count must be in [1, ", num_blocks, "], got ", count);
  const Tensor s = scores.contiguous();
  const int64_t kv_heads = s.size(0), n1 = s.size(1);
  auto out = torch::empty({kv_heads, count}, s.options().dtype(torch::kInt64));
  const auto* bits = reinterpret_cast<const int32_t*>(s.data_ptr<float>());
  int64_t* o = out.data_ptr<int64_t>();
  auto ordered = [](int32_t b) -> int64_t {  // float bits -> integer of the same order, -0 as +0
    if (b == INT32_MIN) b = 0;
    return b < 0 ? (b ^ 0x7FFFFFFF) : b;
  };
  const int64_t minus_inf = ordered(static_cast<int32_t>(0xFF800000u)), plus_inf = ordered(0x7F800000);
  std::vector<int64_t> keys(num_blocks);
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    const int32_t* row = bits + kv * n1;
    for (int64_t j = 0; j < num_blocks; ++j) {
      int64_t best = minus_inf;
      for (int64_t c = std::max<int64_t>(pool_stride * j - 1, 0); c < std::min(pool_stride * (j + 1), n1); ++c)
        best = std::max(best, ordered(row[c]));
      if (j < init_blocks || j >= num_blocks - 1 - local_blocks) best = plus_inf;
      keys[j] = best * num_blocks + (num_blocks - 1 - j);  // unique: equal scores go to the earlier block
    }
    std::nth_element(keys.begin(), keys.begin() + (count - 1), keys.end(), std::greater<int64_t>());
    int64_t* dst = o + kv * count;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t rest = keys[i] % num_blocks;
      dst[i] = num_blocks - 1 - (rest < 0 ? rest + num_blocks : rest);
    }
    std::sort(dst, dst + count);
  }
  return out;
}
