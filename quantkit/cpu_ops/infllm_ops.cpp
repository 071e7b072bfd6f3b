// InfLLM v2 on the bf16 caches, read in place (their PyTorch specification is kernels/infllm/cpu.py):
// stage-1 scores and block selection for one decode step, and attention over the selected blocks
// for a decode step or a prefill chunk.
//
// At 64K keys a decode step scores ~4,096 compressed keys and attends ~6,144 selected keys per KV
// head. PyTorch needs float32 copies of the compressed keys for its matmul and gathered copies of the
// selected blocks for SDPA, which together cost as much as the attention itself; here both stages
// read the bf16 rows where they lie. q · k runs 16 keys at a time: on AMX the keys are an A tile
// loaded from the cache and the KV group's query heads the B tile; otherwise a 16 x 16 transpose of
// the keys' 32-bit dim pairs puts one key per vector lane, shared by all the group's heads, so no
// (head, key) needs a horizontal sum. p · v is a second tile product, or FMAs with the dims in the
// lanes. With AVX-512-BF16 but no AMX (AMD Zen 4, Intel before Sapphire Rapids, or a group of more
// than 16 heads) both products run on vdpbf16ps, two multiply-adds a float32 lane per instruction:
// q · k on the transposed key pairs with the query's bf16 dim pairs broadcast, p · v on value rows
// interleaved by key pairs with the probabilities' bf16 key pairs broadcast. That halves the
// instructions of float32 FMAs, which bound a long context's decode step (its keys and values
// stream from memory faster than the FMAs consume them). Softmax is online per block; tasks (token,
// KV head, range of blocks) run in parallel and merge at the end.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <climits>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define INFLLM_AMX 1
#endif
#if defined(__AVX512BF16__)
#define INFLLM_DP 1
#endif

using torch::Tensor;

namespace infllm {

using Bf16 = at::BFloat16;
constexpr float kMinusHuge = -1e30f;  // not -inf: -ffast-math assumes no infinities
constexpr int64_t kMaxDim = 256;

// One KV group's query heads, float32 rows [heads, dim]; scores are q · k · scale. With AMX, `tiles`
// also holds them as the B operands of q · k (see amx_query_tiles), and both products run on tiles;
// otherwise, with AVX-512-BF16, `pairs` holds them as bf16 dim pairs (see dp_query_pairs) for vdpbf16ps.
struct Queries {
  const float* values;
  int64_t heads, dim;
  float scale;
  std::vector<uint16_t> tiles;
  std::vector<uint32_t> pairs;
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

#ifdef INFLLM_DP
// The products of probabilities and values on bf16 pairs (vdpbf16ps, and AMX tiles, which need it too)
// take two keys at once. One row's probabilities of keys k0 .. k0 + 31 rounded to bf16, the `keys` from
// k0 on read and the rest zero: 16 words, each a key pair.
static inline __m512i bf16_probability_pairs(const float* row, int64_t keys) {
  const __m512 x0 = _mm512_maskz_loadu_ps(first(keys), row);
  const __m512 x1 = _mm512_maskz_loadu_ps(first(keys > 16 ? keys - 16 : 0), row + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
}

// Value rows k0 .. k0 + 2 count - 1 interleaved by key pairs: pairs[c] + 32 m holds dim 16 c + i of row
// k0 + 2 m at element 2 i and of row k0 + 2 m + 1 at 2 i + 1; rows from n on are zero.
static void interleave_value_pairs(const Bf16* values, int64_t n, int64_t k0, int64_t count, int64_t dim,
                                   uint16_t (*pairs)[16 * 32]) {
  alignas(64) uint16_t order[32];
  for (int i = 0; i < 16; ++i) order[2 * i] = i, order[2 * i + 1] = 16 + i;
  const __m512i interleave = _mm512_load_si512(order);
  const auto row = [&](int64_t j, int64_t c) {
    return j < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + j * dim + 16 * c)) : _mm256_setzero_si256();
  };
  for (int64_t pair = 0; pair < count; ++pair) {
    const int64_t j = k0 + 2 * pair;
    for (int64_t c = 0; c < dim / 16; ++c) {
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(row(j, c)), row(j + 1, c), 1);
      _mm512_store_si512(pairs[c] + 32 * pair, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}
#endif

#ifdef INFLLM_AMX
// AMX tiles multiply bf16 at 16 x 16 x 32 per instruction, ~16x the float32 FMAs above, so with them
// the selected blocks cost little more than reading them. Linux hands out the tile state on request.
static bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

static bool use_amx(int64_t heads) { return heads <= 16 && amx_permitted(); }

// The thread's tile configuration while it scores: all 8 tiles 16 rows of 64 bytes. Tiles here: 0 scores
// [16 keys x 16 heads] float32, 1 keys [16 x 32 dims], 2 queries [16 dim pairs x 16 heads x 2],
// 3 output [16 heads x 16 dims] float32, 4 probabilities [16 heads x 32 keys], 5 values [16 key pairs x 16 dims x 2]
// (gram_ops.cpp uses all 8).
struct TileScope {
  const bool active;
  explicit TileScope(bool active) : active(active) {
    if (!active) return;
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      reinterpret_cast<uint16_t*>(config + 16)[t] = 64;
      config[48 + t] = 16;
    }
    _tile_loadconfig(config);
  }
  ~TileScope() {
    if (active) _tile_release();
  }
};

// q as bf16 B tiles [part][dim / 32][16 pairs][16 heads][2], heads past the group zero. Part 0 is
// bf16(q); part 1, present only when q is not bf16 already, bf16(q - part 0): q to 16 mantissa bits.
static std::vector<uint16_t> amx_query_tiles(const float* q, int64_t heads, int64_t dim) {
  const int64_t chunks = dim / 32;
  std::vector<uint16_t> tiles(2 * chunks * 512, 0);
  bool exact = true;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < dim; ++i) {
      const Bf16 high(q[h * dim + i]), low(q[h * dim + i] - static_cast<float>(high));
      const int64_t at = (i / 32) * 512 + (i % 32 / 2) * 32 + h * 2 + i % 2;
      tiles[at] = high.x;
      tiles[chunks * 512 + at] = low.x;
      exact &= (low.x & 0x7FFF) == 0;
    }
  if (exact) tiles.resize(chunks * 512);
  return tiles;
}

static void score_keys_amx(const Queries& q, const Bf16* keys, int64_t n, float* scores, int64_t ld) {
  const int64_t dim = q.dim, chunks = dim / 32, parts = q.tiles.size() / (chunks * 512);
  alignas(64) Bf16 padded[16 * kMaxDim];
  alignas(64) float block[16 * 16];
  const __m512 scale = _mm512_set1_ps(q.scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - j0);
    const Bf16* a = keys + j0 * dim;
    if (rows < 16) {  // never read past the last key
      std::fill(std::copy(a, a + rows * dim, padded), padded + 16 * dim, Bf16(0.f));
      a = padded;
    }
    _tile_zero(0);
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(1, a + 32 * c, dim * 2);
        _tile_loadd(2, q.tiles.data() + (part * chunks + c) * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    _tile_stored(0, block, 64);  // [key][head]
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(block + 16 * i);
    transpose16(r);  // [head][key]
    for (int64_t h = 0; h < q.heads; ++h)
      _mm512_mask_storeu_ps(scores + h * ld + j0, first(rows), _mm512_mul_ps(_mm512_castsi512_ps(r[h]), scale));
  }
}

// acc [16 rows, dim] += p [heads, n] (rounded to bf16, as PyTorch's bf16 attention does) · values [n, dim].
static void accumulate_values_amx(const Queries& q, const float* p, int64_t ldp, const Bf16* values, int64_t n, float* acc) {
  const int64_t dim = q.dim;
  alignas(64) uint16_t probs[16 * 32];
  alignas(64) uint16_t pairs[kMaxDim / 16][16 * 32];
  for (int64_t k0 = 0; k0 < n; k0 += 32) {
    const int64_t keys = std::min<int64_t>(32, n - k0);
    for (int64_t h = 0; h < 16; ++h)
      _mm512_store_si512(probs + 32 * h, h < q.heads ? bf16_probability_pairs(p + h * ldp + k0, keys)
                                                     : _mm512_setzero_si512());
    interleave_value_pairs(values, n, k0, 16, dim, pairs);
    _tile_loadd(4, probs, 64);
    for (int64_t c = 0; c < dim / 16; ++c) {
      _tile_loadd(3, acc + 16 * c, dim * 4);
      _tile_loadd(5, pairs[c], 64);
      _tile_dpbf16ps(3, 4, 5);
      _tile_stored(3, acc + 16 * c, dim * 4);
    }
  }
}
#endif

#ifdef INFLLM_DP
// q as bf16 dim pairs [part][head][dim / 2], a pair's first element in the low half. Part 0 is bf16(q);
// part 1, present only when q is not bf16 already (the runtime's queries are), bf16(q - part 0).
static std::vector<uint32_t> dp_query_pairs(const float* q, int64_t heads, int64_t dim) {
  const int64_t words = heads * dim / 2;
  std::vector<uint32_t> pairs(2 * words, 0);
  bool exact = true;
  for (int64_t i = 0; i < heads * dim; ++i) {
    const Bf16 high(q[i]), low(q[i] - static_cast<float>(high));
    pairs[i / 2] |= static_cast<uint32_t>(high.x) << (16 * (i % 2));
    pairs[words + i / 2] |= static_cast<uint32_t>(low.x) << (16 * (i % 2));
    exact &= (low.x & 0x7FFF) == 0;
  }
  if (exact) pairs.resize(words);
  return pairs;
}

static inline __m512bh broadcast_pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)); }

// score_heads on vdpbf16ps: one instruction takes a head's dim pair against 16 keys' pairs.
template <int H>
static void score_heads_dp(const Queries& q, int64_t h0, const __m512i* pairs, float* out, int64_t ld, __mmask16 rows) {
  const int64_t half = q.dim / 2, words = q.heads * half, parts = q.pairs.size() / words;
  __m512 acc[H];
  for (int h = 0; h < H; ++h) acc[h] = _mm512_setzero_ps();
  for (int64_t part = 0; part < parts; ++part) {
    const uint32_t* w = q.pairs.data() + part * words + h0 * half;
    for (int64_t p = 0; p < half; ++p) {
      const __m512bh keys = (__m512bh)pairs[p];
      for (int h = 0; h < H; ++h) acc[h] = _mm512_dpbf16_ps(acc[h], keys, broadcast_pair(w[h * half + p]));
    }
  }
  const __m512 scale = _mm512_set1_ps(q.scale);
  for (int h = 0; h < H; ++h) _mm512_mask_storeu_ps(out + h * ld, rows, _mm512_mul_ps(acc[h], scale));
}

// acc[h] += probs of head h (16 bf16 key pairs a row) · `count` key pairs of values interleaved per dim
// ([chunk of 16 dims][pair][dim][2]), for H heads.
template <int H>
static void accumulate_heads_dp(const uint32_t* probs, const uint16_t (*pairs)[16 * 32], int64_t count, int64_t dim,
                                float* acc) {
  for (int64_t c = 0; c < dim / 16; ++c) {
    __m512 a[H];
    for (int h = 0; h < H; ++h) a[h] = _mm512_loadu_ps(acc + h * dim + 16 * c);
    for (int64_t m = 0; m < count; ++m) {
      const __m512bh v = (__m512bh)_mm512_load_si512(pairs[c] + 32 * m);
      for (int h = 0; h < H; ++h) a[h] = _mm512_dpbf16_ps(a[h], v, broadcast_pair(probs[16 * h + m]));
    }
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(acc + h * dim + 16 * c, a[h]);
  }
}

// accumulate_values on vdpbf16ps, p rounded to bf16 (as the AMX path and PyTorch's bf16 attention).
static void accumulate_values_dp(const Queries& q, const float* p, int64_t ldp, const Bf16* values, int64_t n,
                                 float* acc) {
  const int64_t dim = q.dim;
  alignas(64) uint32_t probs[16 * 16];                // [head of 16][key pair]
  alignas(64) uint16_t pairs[kMaxDim / 16][16 * 32];  // [chunk][key pair][dim][2]
  for (int64_t k0 = 0; k0 < n; k0 += 32) {
    const int64_t keys = std::min<int64_t>(32, n - k0), count = (keys + 1) / 2;
    interleave_value_pairs(values, n, k0, count, dim, pairs);
    for (int64_t g = 0; g < q.heads; g += 16) {
      const int64_t heads = std::min<int64_t>(16, q.heads - g);
      for (int64_t h = 0; h < heads; ++h)
        _mm512_store_si512(probs + 16 * h, bf16_probability_pairs(p + (g + h) * ldp + k0, keys));
      for (int64_t h = 0; h < heads;) {
        const int64_t left = heads - h;
        float* ah = acc + (g + h) * dim;
        if (left >= 8) { accumulate_heads_dp<8>(probs + 16 * h, pairs, count, dim, ah); h += 8; }
        else if (left >= 4) { accumulate_heads_dp<4>(probs + 16 * h, pairs, count, dim, ah); h += 4; }
        else if (left >= 2) { accumulate_heads_dp<2>(probs + 16 * h, pairs, count, dim, ah); h += 2; }
        else { accumulate_heads_dp<1>(probs + 16 * h, pairs, count, dim, ah); h += 1; }
      }
    }
  }
}
#endif

// Scores of query heads h0..h0+H-1 for 16 keys given as dim/2 vectors of transposed dim pairs;
// stored (scaled) for the first `rows` keys at out[h * ld + lane].
template <int H>
static void score_heads(const Queries& q, int64_t h0, const __m512i* pairs, float* out, int64_t ld, __mmask16 rows) {
#ifdef INFLLM_DP
  if (!q.pairs.empty()) return score_heads_dp<H>(q, h0, pairs, out, ld, rows);
#endif
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
#ifdef INFLLM_AMX
  if (!q.tiles.empty()) return score_keys_amx(q, keys, n, scores, ld);
#endif
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

// acc[h] += sum_j p[h * ldp + j] · values[j] for the group's heads over n bf16 value rows.
static void accumulate_values(const Queries& q, const float* p, int64_t ldp, const Bf16* values, int64_t n, float* acc) {
#ifdef INFLLM_AMX
  if (!q.tiles.empty()) return accumulate_values_amx(q, p, ldp, values, n, acc);
#endif
#ifdef INFLLM_DP
  if (!q.pairs.empty()) return accumulate_values_dp(q, p, ldp, values, n, acc);
#endif
  const int64_t heads = q.heads, dim = q.dim;
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

static void accumulate_values(const Queries& q, const float* p, int64_t ldp, const Bf16* values, int64_t n, float* acc) {
  for (int64_t h = 0; h < q.heads; ++h)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < q.dim; ++i) acc[h * q.dim + i] += p[h * ldp + j] * static_cast<float>(values[j * q.dim + i]);
}
#endif

#ifndef INFLLM_AMX
static bool use_amx(int64_t) { return false; }
struct TileScope {
  explicit TileScope(bool) {}
};
#endif

// Running softmax state of `heads` query rows over the keys seen so far: max, sum of exp, sum of exp·v.
// dim 0 keeps no acc (a log-sum-exp); otherwise acc has at least 16 rows, the AMX output tile's.
struct Partial {
  int64_t dim;
  std::vector<float> best, total, acc;
  Partial(int64_t heads, int64_t dim)
      : dim(dim), best(heads, kMinusHuge), total(heads, 0.f), acc(std::max<int64_t>(heads, 16) * dim, 0.f) {}

  // Takes n more scores of head h: they become exp(score - max) in place, for the caller's p · v,
  // and the sum and acc so far are rescaled to the new max.
  void absorb(int64_t h, float* scores, int64_t n) {
    const float now = std::max(best[h], max_of(scores, n));
    const float shrink = std::exp(best[h] - now);
    total[h] = total[h] * shrink + exp_shifted(scores, n, now);
    best[h] = now;
    if (shrink != 1.f)
      for (int64_t i = 0; i < dim; ++i) acc[h * dim + i] *= shrink;
  }
};

// Head h of `count` partials over disjoint key ranges, merged: returns {max, sum of exp(score - max)}
// and, given `out`, writes the merged acc row (still to be divided by the sum) there.
static std::pair<float, float> merge_head(const Partial* parts, int64_t count, int64_t h, float* out) {
  float best = kMinusHuge, total = 0.f;
  for (int64_t r = 0; r < count; ++r) best = std::max(best, parts[r].best[h]);
  const int64_t dim = parts[0].dim;
  if (out != nullptr) std::fill(out, out + dim, 0.f);
  for (int64_t r = 0; r < count; ++r) {
    const float weight = std::exp(parts[r].best[h] - best);
    total += parts[r].total[h] * weight;
    if (out != nullptr)
      for (int64_t i = 0; i < dim; ++i) out[i] += parts[r].acc[h * dim + i] * weight;
  }
  return {best, total};
}

// Asks for `count` bf16 elements from `rows` on in L2: a block's keys and values come from memory
// while the one before is computed (at 8K keys of MiniCPM4.1-8B's shape, caches cold, 0.90 against
// 1.22 ms a layer without it).
static void prefetch_rows(const Bf16* rows, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(rows);
  for (int64_t at = 0; at < count * 2; at += 64) __builtin_prefetch(bytes + at, 0, 2);
}

// Splits each KV head's work in ranges so that the (KV head, range) tasks keep every thread busy.
static int64_t ranges_per_head(int64_t kv_heads, int64_t items) {
  const int64_t wanted = (2 * at::get_num_threads() + kv_heads - 1) / kv_heads;
  return std::max<int64_t>(1, std::min(wanted, items));
}

static void check_rows(const Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dtype() == torch::kBFloat16 && t.dim() == 3, name, ": bf16 [Hkv, n, d]");
  TORCH_CHECK(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == dim), name, ": rows of d contiguous elements");
}

// `heads` float32 query rows [heads, dim] at `values` (kept alive by the caller), in the form the products take.
static Queries make_queries(const float* values, int64_t heads, int64_t dim, double scale) {
  Queries q{values, heads, dim, static_cast<float>(scale), {}, {}};
#ifdef INFLLM_AMX
  if (use_amx(heads)) q.tiles = amx_query_tiles(values, heads, dim);
#endif
#ifdef INFLLM_DP
  if (q.tiles.empty()) q.pairs = dp_query_pairs(values, heads, dim);
#endif
  return q;
}

// The query heads of each (token, KV group) of query [Hq, T, d], at [t * Hkv + g]; `storage` keeps
// the float32 copy [T, Hq, d] they point into alive.
static std::vector<Queries> group_queries(const Tensor& query, int64_t kv_heads, int64_t dim, double scale,
                                          Tensor& storage) {
  TORCH_CHECK(query.dim() == 3 && query.size(2) == dim && query.size(0) % kv_heads == 0,
              "query: [Hq, T, d], Hq a multiple of the ", kv_heads, " KV heads");
  TORCH_CHECK(dim % 32 == 0 && dim <= kMaxDim, "head dim must be a multiple of 32, at most ", kMaxDim, ", got ", dim);
  storage = query.to(torch::kFloat32).transpose(0, 1).contiguous();
  const int64_t heads = query.size(0), group = heads / kv_heads;
  std::vector<Queries> groups;
  for (int64_t t = 0; t < query.size(1); ++t)
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      groups.push_back(make_queries(storage.data_ptr<float>() + (t * heads + kv * group) * dim, group, dim, scale));
  return groups;
}

}  // namespace infllm

// The instruction set the kernels here run on, the most capable first: "amx" (tiles, where the CPU has
// them and Linux grants them), "avx512_bf16", "avx512" (float32 FMAs), or "portable" (plain C++ loops,
// as built for a CPU without AVX-512).
std::string infllm_isa() {
#ifdef INFLLM_AMX
  if (infllm::amx_permitted()) return "amx";
#endif
#if defined(INFLLM_DP)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

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
  const std::vector<Queries> queries = group_queries(query.unsqueeze(1), kv_heads, dim, scale, storage);
  const int64_t group = queries[0].heads;
  constexpr int64_t kKeys = 64;

  const int64_t coarse_ranges = ranges_per_head(kv_heads, (n2 + kKeys - 1) / kKeys);
  std::vector<Partial> lse_parts(kv_heads * coarse_ranges, Partial(group, 0));
  at::parallel_for(0, kv_heads * coarse_ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(group * kKeys);
    const TileScope tiles(!queries[0].tiles.empty());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / coarse_ranges, r = task % coarse_ranges;
      Partial& part = lse_parts[task];
      const Bf16* keys = coarse.data_ptr<Bf16>() + kv * coarse.stride(0);
      for (int64_t j0 = n2 * r / coarse_ranges; j0 < n2 * (r + 1) / coarse_ranges; j0 += kKeys) {
        const int64_t n = std::min(kKeys, n2 * (r + 1) / coarse_ranges - j0);
        score_keys(queries[kv], keys + j0 * dim, n, s.data(), kKeys);
        for (int64_t h = 0; h < group; ++h) part.absorb(h, s.data() + h * kKeys, n);
      }
    }
  });
  std::vector<float> lse(kv_heads * group);
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    for (int64_t h = 0; h < group; ++h) {
      const auto [best, total] = merge_head(lse_parts.data() + kv * coarse_ranges, coarse_ranges, h, nullptr);
      lse[kv * group + h] = best + std::log(total);
    }

  auto out = torch::zeros({kv_heads, n1}, query.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  const int64_t fine_ranges = ranges_per_head(kv_heads, (n1 + kKeys - 1) / kKeys);
  at::parallel_for(0, kv_heads * fine_ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(group * kKeys);
    const TileScope tiles(!queries[0].tiles.empty());
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

// Stage 2: attention of each query token's KV-group heads over its selected blocks, read in place
// from the bf16 caches [Hkv, S, d]. query [Hq, T, d] are the tokens at positions first..first+T-1;
// blocks [Hkv, T, k] int64, -1 for an unused slot; token t attends the keys of its blocks up to its
// own position. Returns float32 [Hq, T, d]. Tasks are (token, KV head, range of slots): a decode step
// splits its slots in ranges to occupy every thread, a prefill chunk has tokens enough.
Tensor infllm_block_attention(Tensor query, Tensor keys, Tensor values, Tensor blocks, int64_t first,
                              int64_t block_size, double scale) {
  using namespace infllm;
  const int64_t dim = query.size(-1), kv_heads = keys.size(0), tokens = query.size(1);
  check_rows(keys, "keys", dim);
  check_rows(values, "values", dim);
  TORCH_CHECK(keys.size(1) >= first + tokens && values.size(1) >= first + tokens, "the caches hold fewer than ",
              first + tokens, " keys");
  TORCH_CHECK(blocks.dtype() == torch::kInt64 && blocks.dim() == 3 && blocks.size(0) == kv_heads &&
              blocks.size(1) == tokens, "blocks: int64 [Hkv, T, k]");
  Tensor storage;
  const std::vector<Queries> queries = group_queries(query, kv_heads, dim, scale, storage);
  const Tensor chosen = blocks.contiguous();
  const int64_t group = queries[0].heads, selected = chosen.size(2);
  const int64_t* idx = chosen.data_ptr<int64_t>();
  for (int64_t i = 0; i < chosen.numel(); ++i) {
    const int64_t own = (first + (i / selected) % tokens) / block_size;  // the token's own block: the last it sees
    TORCH_CHECK(idx[i] >= -1 && idx[i] <= own, "block ", idx[i], " outside blocks 0..", own, " of token ",
                first + (i / selected) % tokens);
  }

  const int64_t ranges = ranges_per_head(kv_heads * tokens, selected), tasks = tokens * kv_heads * ranges;
  std::vector<Partial> parts(tasks, Partial(group, dim));
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(group * block_size);
    const TileScope tiles(!queries[0].tiles.empty());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (kv_heads * ranges), kv = task / ranges % kv_heads, r = task % ranges;
      const int64_t length = first + t + 1;
      const int64_t* slots = idx + (kv * tokens + t) * selected;
      Partial& part = parts[task];
      const Bf16* k = keys.data_ptr<Bf16>() + kv * keys.stride(0);
      const Bf16* v = values.data_ptr<Bf16>() + kv * values.stride(0);
      const int64_t last = selected * (r + 1) / ranges;
      for (int64_t slot = selected * r / ranges; slot < last; ++slot) {
        if (slots[slot] < 0) continue;
        const int64_t start = slots[slot] * block_size, n = std::min(block_size, length - start);
        if (slot + 1 < last && slots[slot + 1] >= 0) {
          const int64_t next = slots[slot + 1] * block_size;
          prefetch_rows(k + next * dim, std::min(block_size, length - next) * dim);
          prefetch_rows(v + next * dim, std::min(block_size, length - next) * dim);
        }
        score_keys(queries[t * kv_heads + kv], k + start * dim, n, p.data(), block_size);
        for (int64_t h = 0; h < group; ++h) part.absorb(h, p.data() + h * block_size, n);
        accumulate_values(queries[t * kv_heads + kv], p.data(), block_size, v + start * dim, n, part.acc.data());
      }
    }
  });
  auto out = torch::empty({kv_heads * group, tokens, dim}, storage.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, kv = item % kv_heads;
      for (int64_t h = 0; h < group; ++h) {
        float* dst = o + ((kv * group + h) * tokens + t) * dim;
        const float total = merge_head(parts.data() + item * ranges, ranges, h, dst).second;
        for (int64_t i = 0; i < dim; ++i) dst[i] /= total;
      }
    }
  });
  return out;
}

// Dense attention of a speculative round's T new tokens (a chain of drafts or a draft tree), written to the
// caches at slots first..first+T-1: each token attends all `first` cached keys, and of the T new ones those
// its row of `visible` [T, T] (bool: its ancestors and itself) allows. query [Hq, T, d]; returns float32
// [Hq, T, d]. All T tokens of a KV group are the rows of one problem (G x T query rows), so each cached key
// is read once for all of them, where SDPA with an additive mask over every key (the specification,
// kernels/model.py masked_attention) pays for the mask's adds and a dispatch per layer; tasks are
// (KV head, range of cached blocks), the new keys going to each head's last range.
Tensor verify_attention(Tensor query, Tensor keys, Tensor values, int64_t first, Tensor visible, int64_t block_size,
                        double scale) {
  using namespace infllm;
  const int64_t dim = query.size(-1), kv_heads = keys.size(0), tokens = query.size(1);
  check_rows(keys, "keys", dim);
  check_rows(values, "values", dim);
  TORCH_CHECK(query.dim() == 3 && query.size(0) % kv_heads == 0, "query: [Hq, T, d], Hq a multiple of the ",
              kv_heads, " KV heads");
  TORCH_CHECK(dim % 32 == 0 && dim <= kMaxDim, "head dim must be a multiple of 32, at most ", kMaxDim, ", got ", dim);
  TORCH_CHECK(keys.size(1) >= first + tokens && values.size(1) >= first + tokens, "the caches hold fewer than ",
              first + tokens, " keys");
  TORCH_CHECK(visible.dtype() == torch::kBool && visible.dim() == 2 && visible.size(0) == tokens &&
              visible.size(1) == tokens, "visible: bool [T, T]");
  const Tensor allowed = visible.contiguous();
  const bool* sees = allowed.data_ptr<bool>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sees[t * tokens + t], "token ", t, " must see itself");
  const Tensor storage = query.to(torch::kFloat32).contiguous();  // [Hkv][G][T][d]: row h T + t of a group
  const int64_t rows = query.size(0) / kv_heads * tokens;
  std::vector<Queries> groups;
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    groups.push_back(make_queries(storage.data_ptr<float>() + kv * rows * dim, rows, dim, scale));

  const int64_t blocks = (first + block_size - 1) / block_size;
  const int64_t ranges = ranges_per_head(kv_heads, std::max<int64_t>(blocks, 1)), tasks = kv_heads * ranges;
  std::vector<Partial> parts(tasks, Partial(rows, dim));
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(rows * std::max(block_size, tokens));
    const TileScope tiles(!groups[0].tiles.empty());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / ranges, r = task % ranges;
      const Queries& q = groups[kv];
      Partial& part = parts[task];
      const Bf16* k = keys.data_ptr<Bf16>() + kv * keys.stride(0);
      const Bf16* v = values.data_ptr<Bf16>() + kv * values.stride(0);
      for (int64_t block = blocks * r / ranges; block < blocks * (r + 1) / ranges; ++block) {
        const int64_t start = block * block_size, n = std::min(block_size, first - start);
        score_keys(q, k + start * dim, n, p.data(), block_size);
        for (int64_t i = 0; i < rows; ++i) part.absorb(i, p.data() + i * block_size, n);
        accumulate_values(q, p.data(), block_size, v + start * dim, n, part.acc.data());
      }
      if (r == ranges - 1) {
        score_keys(q, k + first * dim, tokens, p.data(), tokens);
        for (int64_t i = 0; i < rows; ++i) {
          const bool* row_sees = sees + i % tokens * tokens;
          for (int64_t j = 0; j < tokens; ++j)
            if (!row_sees[j]) p[i * tokens + j] = kMinusHuge;
          part.absorb(i, p.data() + i * tokens, tokens);
          for (int64_t j = 0; j < tokens; ++j)  // exactly nothing from keys it does not see
            if (!row_sees[j]) p[i * tokens + j] = 0.f;
        }
        accumulate_values(q, p.data(), tokens, v + first * dim, tokens, part.acc.data());
      }
    }
  });
  auto out = torch::empty({query.size(0), tokens, dim}, storage.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, kv_heads * rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / rows, i = item % rows;
      float* dst = o + item * dim;
      const float total = merge_head(parts.data() + kv * ranges, ranges, i, dst).second;
      for (int64_t c = 0; c < dim; ++c) dst[c] /= total;
    }
  });
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
