// A bf16-weight product for CPUs with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake and later), tuned for the
// few rows a decoding step or a tree verification sends (1 to a few dozen).
//
// The weight [out, in] is packed once as [out/16][in/2][16][2] bf16: for each block of 16 output columns and
// each pair of inputs, the 16 columns' two weights in one 64-byte line. One VDPBF16PS then adds, in each of
// 16 fp32 lanes, the two products of an input pair with that column's pair of weights: each product of two
// bf16 values is exact in fp32, and every output is summed by one lane in input order, pair by pair,
// whatever the row count or thread split. Up to 4 rows share each weight line loaded (4 blocks of 16
// columns at a time), so a product of 4 rows reads the weight once, and the weight streams at memory speed
// for 1 row as for 4, where fbgemm's fp16 kernel converts every weight to fp32 and multiplies in fp32 lanes
// (half as many products per instruction). The sums are rounded to bf16 to nearest even (torch's rounding,
// subnormals kept) after the bias is added in fp32.
//
// Built at first use by eagle_dropmatch.cpu_linear.bf16_extension (torch.utils.cpp_extension) with
// -mavx512bf16 and -mavx512vnni (the int8 screen's dot products), and used only where the CPU reports both
// (every CPU with AVX512-BF16 has AVX512-VNNI).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int kBlock = 16;   // output columns per block: one zmm of fp32 sums
constexpr int kRows = 4;     // rows sharing each weight line
constexpr int kBlocks = 4;   // blocks of columns summed at once (kRows x kBlocks zmm of sums)

// fp32 -> bf16, rounded to nearest even as torch rounds (NaN kept a quiet NaN).
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// rows x (blocks x 16) outputs: c[r, 16 b + j] = sum over input pairs p of the pair's two products, in order.
//   a: rows of the input (bf16 bits), row stride lda in pairs; w: the first block's packed weight, block
//   stride wstride (pairs of 16 lanes); c: bf16 output, row stride ldc; cols: valid columns from c's first
//   (the last block may be partial); bias: fp32 [cols] or nullptr.
template <int R, int B>
void tile(const uint16_t* a, int64_t lda, const uint32_t* w, int64_t wstride, int64_t pairs, uint16_t* c,
          int64_t ldc, int64_t cols, const float* bias) {
  __m512 sum[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) sum[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh weight[B];
    for (int b = 0; b < B; ++b)
      weight[b] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(w + b * wstride + p * kBlock));
    for (int r = 0; r < R; ++r) {
      int pair;  // the input pair as 32 bits (copied: a row may start 2 bytes off a 4-byte boundary)
      std::memcpy(&pair, a + 2 * (r * lda + p), sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], weight[b], x);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t first = b * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, cols - first);
    if (valid <= 0) break;
    const __mmask16 mask = valid == kBlock ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias ? _mm512_add_ps(sum[r][b], add) : sum[r][b];
      _mm256_mask_storeu_epi16(static_cast<void*>(c + r * ldc + first), mask, round_to_bf16(v));
    }
  }
}

template <int R>
void tile_rows(int blocks, const uint16_t* a, int64_t lda, const uint32_t* w, int64_t wstride, int64_t pairs,
               uint16_t* c, int64_t ldc, int64_t cols, const float* bias) {
  switch (blocks) {
    case 1: tile<R, 1>(a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
    case 2: tile<R, 2>(a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
    case 3: tile<R, 3>(a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
    default: tile<R, 4>(a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
  }
}

void tile_any(int rows, int blocks, const uint16_t* a, int64_t lda, const uint32_t* w, int64_t wstride,
              int64_t pairs, uint16_t* c, int64_t ldc, int64_t cols, const float* bias) {
  switch (rows) {
    case 1: tile_rows<1>(blocks, a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
    case 2: tile_rows<2>(blocks, a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
    case 3: tile_rows<3>(blocks, a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
    default: tile_rows<4>(blocks, a, lda, w, wstride, pairs, c, ldc, cols, bias); break;
  }
}

// A float rounded to bf16 to nearest even (as round_to_bf16), back as a float: what the kernel's output holds.
inline float bf16_rounded(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

class PackedBF16Linear {
 public:
  // weight: [out, in], any float dtype (rounded to bf16 as torch rounds it; a bf16 weight is kept as it is).
  explicit PackedBF16Linear(const at::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2, "weight must be [out, in], got ", weight.dim(), " dimensions");
    const auto w = weight.detach().to(at::kBFloat16).contiguous();
    out_features_ = w.size(0);
    in_features_ = w.size(1);
    pairs_ = (in_features_ + 1) / 2;
    blocks_ = (out_features_ + kBlock - 1) / kBlock;
    auto padded = at::zeros({blocks_ * kBlock, pairs_ * 2}, w.options());
    padded.narrow(0, 0, out_features_).narrow(1, 0, in_features_).copy_(w);
    // [blocks, 16, pairs, 2] -> [blocks, pairs, 16, 2]
    packed_ = padded.view({blocks_, kBlock, pairs_, 2}).permute({0, 2, 1, 3}).contiguous();
  }

  // x: [..., in] -> [..., out] in bf16.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features_, "expected inputs of width ", in_features_,
                ", got ", x.sizes());
    auto a = x.reshape({-1, in_features_}).to(at::kBFloat16).contiguous();  // [M, in]
    const int64_t m = a.size(0);
    if (in_features_ % 2 == 1) {  // an odd width: a zero input pairs with the padded zero weight
      a = at::constant_pad_nd(a, {0, 1}, 0.0);
    }
    auto c = at::empty({m, out_features_}, a.options());  // [M, out]
    at::Tensor bias_fp32;
    const float* bias_ptr = nullptr;
    if (bias.has_value()) {
      bias_fp32 = bias->to(at::kFloat).contiguous();
      bias_ptr = bias_fp32.data_ptr<float>();
    }
    const auto* a_ptr = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    const auto* w_ptr = reinterpret_cast<const uint32_t*>(packed_.data_ptr<at::BFloat16>());
    auto* c_ptr = reinterpret_cast<uint16_t*>(c.data_ptr<at::BFloat16>());
    const int64_t lda = pairs_, wstride = pairs_ * kBlock, ldc = out_features_;
    const int64_t blocks = blocks_, pairs = pairs_, out = out_features_;
    if (m > 0) {
      const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks)));
      at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t first = blocks * t / threads, last = blocks * (t + 1) / threads;
          for (int64_t b = first; b < last; b += kBlocks) {
            const int n = static_cast<int>(std::min<int64_t>(kBlocks, last - b));
            const int64_t col = b * kBlock;
            for (int64_t r = 0; r < m; r += kRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r));
              tile_any(rows, n, a_ptr + 2 * r * lda, lda, w_ptr + b * wstride, wstride, pairs, c_ptr + r * ldc + col,
                       ldc, out - col, bias_ptr ? bias_ptr + col : nullptr);
            }
          }
        }
      });
    }
    auto sizes = x.sizes().vec();
    sizes.back() = out_features_;
    return c.view(sizes);
  }

  // The first maximum of each row's output (the index of forward(x)'s largest value, the lowest among equal
  // ones), for rows x [P, in] without a bias, screened on an int8 copy of the weight (built at first call):
  //   - each weight row j is s_j q_j (q_j int8, s_j = max |w_j| / 127: every entry within 0.5 s_j, a little
  //     more for fp32's rounding), each input s_x q_x (q_x int16), so q_j . q_x is exact in int32 and
  //     a_j = s_j s_x (q_j . q_x) is within e_j = 0.51 s_j |x|_1 + 0.51 s_x s_j |q_j|_1 of w_j . x, plus a
  //     bound on the kernel's own fp32 sum (`sum_error`: 4 (in + 1) 2^-24 |x| times the largest row norm)
  //     and a_j's rounding;
  //   - an output whose a_j + e_j rounds (to bf16) below what the best a_i - e_i rounds to cannot be the row's
  //     first maximum (rounding keeps order, so it rounds strictly below that output), so only the blocks of
  //     16 outputs holding the others are computed, by the same tile as forward (the same sums, bit for bit),
  //     and the first maximum taken among them.
  // The int8 copy is packed as forward's weight is, by blocks of 16 outputs, four inputs of the 16 outputs
  // in each 64-byte line, so one VPDPBUSD adds four products to each output's own lane (no sums across
  // lanes). VPDPBUSD multiplies unsigned bytes by signed ones, broadcast from memory: the copy holds
  // q_j + 128 (unsigned) and q_x goes in as two signed bytes, l and h (q_x = 256 h + l), so that
  // q_j . q_x = (q_j + 128) . l + 256 ((q_j + 128) . h) - 128 sum(q_x), exact in int32 (wrapping on the
  // way, as the result fits).
  // A row gets -1 where the screen leaves more than `max_blocks` blocks or meets a value that is not finite:
  // the caller computes that row in full. The int8 copy streams half the bytes of the bf16 weight.
  at::Tensor screened_argmax(const at::Tensor& x, double max_row_norm, int64_t max_blocks) {
    return std::get<0>(screened_argmax_rivals(x, max_row_norm, max_blocks, 0, std::nullopt));
  }

  // screened_argmax, and for each row `rivals` outputs that score high, from the same bounds (the chosen
  // blocks are read again, not the whole copy): the output with the largest upper bound in each of the
  // `rivals` blocks whose largest upper bound is highest (the order among them, and among equal bounds,
  // unspecified). Any outputs would do for DropMatch's contest (it computes their values itself); high ones
  // let it rule out more samples. A row with a value that is not finite gets -1 throughout; fewer blocks
  // than `rivals`: the row's blocks repeat.
  // rival_rows: bool [P], the rows that want rivals (the others get -1), or None for all.
  // Returns (int64 [P], int64 [P, rivals]).
  std::tuple<at::Tensor, at::Tensor> screened_argmax_rivals(const at::Tensor& x, double max_row_norm,
                                                            int64_t max_blocks, int64_t rivals,
                                                            const std::optional<at::Tensor>& rival_rows) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features_, "expected rows of width ", in_features_, ", got ",
                x.sizes());
    TORCH_CHECK(rivals >= 0, "rivals must be >= 0, got ", rivals);
    TORCH_CHECK(!rival_rows.has_value() || (rival_rows->scalar_type() == at::kBool && rival_rows->is_cpu() &&
                                            rival_rows->numel() == x.size(0)),
                "rival_rows must be a bool CPU tensor of one flag per row");
    const auto wanted = rival_rows.has_value() ? rival_rows->contiguous() : at::ones({x.size(0)}, at::kBool);
    build_screen();
    auto rows = x.to(at::kBFloat16).contiguous();
    const int64_t m = rows.size(0);
    auto result = at::full({m}, -1, at::TensorOptions().dtype(at::kLong));
    auto rival_ids = at::full({m, rivals}, -1, at::TensorOptions().dtype(at::kLong));
    const auto* rows_ptr = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < m; r += kScreenRows) {  // up to 8 rows share each int8 weight line read
      const int n = static_cast<int>(std::min<int64_t>(kScreenRows, m - r));
      const uint16_t* part = rows_ptr + r * in_features_;
      int64_t* into = result.data_ptr<int64_t>() + r;
      int64_t* rivals_into = rival_ids.data_ptr<int64_t>() + r * rivals;
      const bool* want = wanted.data_ptr<bool>() + r;
      switch (n) {
        case 1: screen_rows<1>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 2: screen_rows<2>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 3: screen_rows<3>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 4: screen_rows<4>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 5: screen_rows<5>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 6: screen_rows<6>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 7: screen_rows<7>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        default: screen_rows<8>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
      }
    }
    return {result, rival_ids};
  }

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

 private:
  static constexpr int kScreenRows = 8;  // rows sharing each int8 weight line

  // Bounds for R rows on the block of 16 outputs `block`: the largest upper bound of its outputs into
  // upper[r * blocks_ + block], the output that has it into lanes[r * blocks_ + block] (0-15; none kept where
  // lanes is null), and the best lower bounds into best[r] (per lane).
  //   xl, xh: per row, the signed low and high bytes of q_x, four to an int32 (groups_ of them);
  //   offset: per row, 128 sum(q_x).
  template <int R>
  void screen_block(int64_t block, const int32_t* xl, const int32_t* xh, const int32_t* offset, const float* scale_x,
                    const float* weight_term, const float* input_term, const float* sum_error, float* upper,
                    uint8_t* lanes, __m512* best) const {
    __m512i low[R], high[R];  // 2 R sums in registers (the loops over rows unrolled)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) low[r] = high[r] = _mm512_setzero_si512();
    const uint8_t* q = screen_q_.data() + block * groups_ * 64;
    for (int64_t g = 0; g < groups_; ++g) {
      const __m512i weight = _mm512_loadu_si512(static_cast<const void*>(q + g * 64));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        low[r] = _mm512_dpbusd_epi32(low[r], weight, _mm512_set1_epi32(xl[r * groups_ + g]));
        high[r] = _mm512_dpbusd_epi32(high[r], weight, _mm512_set1_epi32(xh[r * groups_ + g]));
      }
    }
    const int64_t first = block * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, out_features_ - first);
    const __mmask16 real = valid >= kBlock ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 scale = _mm512_loadu_ps(screen_scale_.data() + first);
    const __m512 l1 = _mm512_loadu_ps(screen_l1_.data() + first);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(low[r], _mm512_slli_epi32(high[r], 8)),
                                           _mm512_set1_epi32(offset[r]));
      const __m512 approx = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale_x[r])), scale);
      __m512 error = _mm512_mul_ps(scale, _mm512_add_ps(_mm512_set1_ps(weight_term[r]),
                                                        _mm512_mul_ps(_mm512_set1_ps(input_term[r]), l1)));
      error = _mm512_add_ps(_mm512_add_ps(error, _mm512_set1_ps(sum_error[r])),
                            _mm512_add_ps(_mm512_mul_ps(_mm512_abs_ps(approx), _mm512_set1_ps(4.8e-7f)),
                                          _mm512_set1_ps(1e-30f)));
      const __m512 up = _mm512_add_ps(approx, error);
      // a bound that is not a number keeps its block (+inf); padded outputs take no part
      const __mmask16 nan = _mm512_cmp_ps_mask(up, up, _CMP_UNORD_Q);
      const float largest = nan & real ? std::numeric_limits<float>::infinity() : _mm512_mask_reduce_max_ps(real, up);
      upper[r * blocks_ + block] = largest;
      if (lanes != nullptr) {
        const __mmask16 at = _mm512_mask_cmp_ps_mask(real, up, _mm512_set1_ps(largest), _CMP_EQ_OQ);
        lanes[r * blocks_ + block] = at ? static_cast<uint8_t>(__builtin_ctz(at)) : 0;
      }
      best[r] = _mm512_mask_max_ps(best[r], real, best[r], _mm512_sub_ps(approx, error));
    }
  }

  // screened_argmax for R rows (bf16 bits, R x in) into result[0, R): -1 where undecided; with rivals > 0,
  // the rivals of each row r that wants them (want[r]) into rival_ids[r * rivals, (r + 1) * rivals).
  template <int R>
  void screen_rows(const uint16_t* rows, double max_row_norm, int64_t max_blocks, int64_t* result, int64_t rivals,
                   const bool* want, int64_t* rival_ids) {
    // q_x in [-limit, limit], so that |q_j . q_x| <= 127 limit width < 2^31 and h is a signed byte
    const int64_t width = groups_ * 4;
    const int64_t limit = std::min<int64_t>(32639, (int64_t{1} << 31) / (128 * std::max<int64_t>(width, 1)));
    std::vector<int32_t> xl(R * groups_, 0), xh(R * groups_, 0);
    float scale_x[R], weight_term[R], input_term[R], sum_error[R];
    int32_t offset[R];
    bool usable[R];
    std::vector<float> xf(in_features_);
    for (int r = 0; r < R; ++r) {
      const uint16_t* row = rows + r * in_features_;
      float largest = 0.0f, l1 = 0.0f, l2 = 0.0f;
      bool finite = true;
      for (int64_t k = 0; k < in_features_; ++k) {
        const uint32_t bits = static_cast<uint32_t>(row[k]) << 16;
        std::memcpy(&xf[k], &bits, sizeof(float));
        finite = finite && std::isfinite(xf[k]);
        largest = std::max(largest, std::fabs(xf[k]));
        l1 += std::fabs(xf[k]);
        l2 += xf[k] * xf[k];
      }
      usable[r] = finite;
      scale_x[r] = largest > 0.0f ? largest / static_cast<float>(limit) : 1.0f;
      auto* low = reinterpret_cast<int8_t*>(xl.data() + r * groups_);
      auto* high = reinterpret_cast<int8_t*>(xh.data() + r * groups_);
      int64_t sum = 0;
      for (int64_t k = 0; k < width; ++k) {  // q_x = 256 h + l, l and h in [-128, 127]
        const int32_t qx = finite && k < in_features_ ? static_cast<int32_t>(std::lrint(xf[k] / scale_x[r])) : 0;
        low[k] = static_cast<int8_t>(((qx + 128) & 0xFF) - 128);
        high[k] = static_cast<int8_t>((qx - low[k]) / 256);
        sum += qx;
      }
      offset[r] = static_cast<int32_t>(static_cast<uint32_t>(128 * sum));  // modulo 2^32, as the sums below
      // |x|_1 and |x|_2 summed in fp32: inflated by (1 + (in + 2) 2^-23) to bound them from above
      const float inflate = 1.0f + static_cast<float>(in_features_ + 2) * 1.2e-7f;
      weight_term[r] = 0.51f * l1 * inflate;
      input_term[r] = 0.51f * scale_x[r];
      sum_error[r] = static_cast<float>(4.0 * (in_features_ + 1) * std::ldexp(1.0, -24) *
                                        std::sqrt(static_cast<double>(l2) * inflate) * max_row_norm);
    }
    std::vector<float> upper(R * blocks_);  // per row and block: the largest upper bound of its outputs
    // a rival block's output with the largest bound, found again for the rival blocks only (keeping it for
    // every block in the pass above was slower: 0.96 against 0.62 ms for one row of SmolLM2's head, alone)
    std::vector<float> again(rivals > 0 ? blocks_ : 0);
    std::vector<uint8_t> lanes(rivals > 0 ? blocks_ : 0);
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks_)));
    std::vector<float> best_lower(threads * R, -std::numeric_limits<float>::infinity());
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        __m512 best[R];
        for (int r = 0; r < R; ++r) best[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t block = blocks_ * t / threads; block < blocks_ * (t + 1) / threads; ++block)
          screen_block<R>(block, xl.data(), xh.data(), offset, scale_x, weight_term, input_term, sum_error,
                          upper.data(), nullptr, best);
        for (int r = 0; r < R; ++r) best_lower[t * R + r] = _mm512_reduce_max_ps(best[r]);
      }
    });
    const int64_t lda = pairs_, wstride = pairs_ * kBlock, out = out_features_;
    const auto* w_ptr = reinterpret_cast<const uint32_t*>(packed_.data_ptr<at::BFloat16>());
    std::vector<uint16_t> a(2 * pairs_, 0), c(kBlock);
    std::vector<int64_t> blocks, order(rivals > 0 ? blocks_ : 0);
    for (int r = 0; r < R; ++r) {
      float lower = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < threads; ++t) lower = std::max(lower, best_lower[t * R + r]);
      if (!usable[r] || !std::isfinite(lower)) continue;
      if (rivals > 0 && want[r]) {  // the blocks with the highest bounds, each by its output with the highest bound
        const float* bounds = upper.data() + r * blocks_;
        for (int64_t b = 0; b < blocks_; ++b) order[b] = b;
        const int64_t top = std::min(rivals, blocks_);
        std::nth_element(order.begin(), order.begin() + (top - 1), order.end(),
                         [bounds](int64_t i, int64_t j) { return bounds[i] > bounds[j]; });
        for (int64_t i = 0; i < top; ++i) {
          __m512 unused = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          screen_block<1>(order[i], xl.data() + r * groups_, xh.data() + r * groups_, offset + r, scale_x + r,
                          weight_term + r, input_term + r, sum_error + r, again.data(), lanes.data(), &unused);
        }
        for (int64_t i = 0; i < rivals; ++i) {
          const int64_t b = order[i % top];
          rival_ids[r * rivals + i] = b * kBlock + lanes[b];
        }
      }
      // a block whose largest bound rounds below what the best lower bound rounds to holds no first maximum
      // (rounding to bf16 keeps order, so every bound of the block rounds below it too)
      const float floor = bf16_rounded(lower);
      blocks.clear();
      for (int64_t b = 0; b < blocks_ && static_cast<int64_t>(blocks.size()) <= max_blocks; ++b) {
        if (bf16_rounded(upper[r * blocks_ + b]) >= floor) blocks.push_back(b);
      }
      if (static_cast<int64_t>(blocks.size()) > max_blocks) continue;
      // the candidate blocks by forward's own tile (the same sums), in increasing order: the first maximum
      std::memcpy(a.data(), rows + r * in_features_, in_features_ * sizeof(uint16_t));
      float best_value = -std::numeric_limits<float>::infinity();
      int64_t best_index = -1;
      bool finite = true;
      for (const int64_t b : blocks) {
        const int64_t col = b * kBlock, valid = std::min<int64_t>(kBlock, out - col);
        tile<1, 1>(a.data(), lda, w_ptr + b * wstride, wstride, pairs_, c.data(), kBlock, valid, nullptr);
        for (int64_t i = 0; i < valid; ++i) {
          const uint32_t bits = static_cast<uint32_t>(c[i]) << 16;
          float v;
          std::memcpy(&v, &bits, sizeof v);
          finite = finite && std::isfinite(v);
          if (v > best_value) {
            best_value = v;
            best_index = col + i;
          }
        }
      }
      result[r] = finite ? best_index : -1;
    }
  }

  // The int8 copy of the weight for screened_argmax, as q + 128 in unsigned bytes packed [blocks][groups][16][4]
  // (groups_ = in / 4 rounded up; padding holds q = 0), each output's scale and the sum of its |q|.
  // Made from packed_ at the first call.
  void build_screen() {
    std::call_once(screen_once_, [this] {
      groups_ = (in_features_ + 3) / 4;
      const int64_t outputs = blocks_ * kBlock;
      screen_q_.assign(outputs * groups_ * 4, 128);
      screen_scale_.assign(outputs, 0.0f);
      screen_l1_.assign(outputs, 0.0f);
      const auto weight = packed_.permute({0, 2, 1, 3}).reshape({blocks_ * kBlock, pairs_ * 2})
                              .narrow(0, 0, out_features_).narrow(1, 0, in_features_).to(at::kFloat).contiguous();
      const float* w = weight.data_ptr<float>();
      for (int64_t j = 0; j < out_features_; ++j) {
        float largest = 0.0f;
        for (int64_t k = 0; k < in_features_; ++k) largest = std::max(largest, std::fabs(w[j * in_features_ + k]));
        const float scale = largest > 0.0f ? largest / 127.0f : 1.0f;
        float l1 = 0.0f;
        uint8_t* line = screen_q_.data() + (j / kBlock) * groups_ * 64 + (j % kBlock) * 4;
        for (int64_t k = 0; k < in_features_; ++k) {
          const long q = std::max(-127L, std::min(127L, std::lrint(w[j * in_features_ + k] / scale)));
          line[(k / 4) * 64 + k % 4] = static_cast<uint8_t>(q + 128);
          l1 += std::fabs(static_cast<float>(q));
        }
        screen_scale_[j] = scale;
        screen_l1_[j] = l1;  // an integer below 2^24: exact
      }
    });
  }

  int64_t in_features_ = 0, out_features_ = 0, pairs_ = 0, blocks_ = 0;
  at::Tensor packed_;
  std::once_flag screen_once_;
  int64_t groups_ = 0;
  std::vector<uint8_t> screen_q_;
  std::vector<float> screen_scale_, screen_l1_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<PackedBF16Linear>(m, "PackedBF16Linear")
      .def(pybind11::init<const at::Tensor&>(), pybind11::arg("weight"))
      .def("forward", &PackedBF16Linear::forward, pybind11::arg("x"), pybind11::arg("bias") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("screened_argmax", &PackedBF16Linear::screened_argmax, pybind11::arg("x"), pybind11::arg("max_row_norm"),
           pybind11::arg("max_blocks"), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("screened_argmax_rivals", &PackedBF16Linear::screened_argmax_rivals, pybind11::arg("x"),
           pybind11::arg("max_row_norm"), pybind11::arg("max_blocks"), pybind11::arg("rivals"),
           pybind11::arg("rival_rows") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("in_features", &PackedBF16Linear::in_features)
      .def_property_readonly("out_features", &PackedBF16Linear::out_features);
}
