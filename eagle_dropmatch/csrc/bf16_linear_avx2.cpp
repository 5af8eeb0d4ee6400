// A bf16-weight product for CPUs with AVX2 and FMA but no bf16 arithmetic (AMD before Zen 4, most laptops'
// Intel cores), tuned for the few rows a decoding step or a tree verification sends (1 to a few dozen).
// The AVX2 counterpart of bf16_linear.cpp, with an AVX2 build of its int8 screen (screened_argmax below).
//
// The weight [out, in] is packed once as [out/16][in][16] bf16: for each block of 16 output columns and each
// input, the 16 columns' weights in one 32-byte line. A bf16 value is the top half of an fp32 one, so a shift
// of the line's 32-bit lanes gives the even columns' weights in fp32 and a mask the odd columns', exactly;
// both are multiplied by the same broadcast input (fp32) with FMA into one fp32 lane per output. Every output
// is summed by one lane in input order, whatever the row count or thread split, so a row's output does not
// depend on the rows beside it. Up to 6 rows share each weight line loaded (at most 12 registers of sums), and
// each thread runs every group of 6 rows over a tile of up to 4 blocks before it moves on, so the tile comes
// from the core's caches for the next group. fbgemm's fp16 kernel, which CPUs without native bf16 used before,
// shares a line between up to 6 rows too, but needs fp16-exact weights and is not row-independent. The sums
// are rounded to bf16 to nearest even (torch's rounding, subnormals kept) after the bias is added in fp32.
//
// Built at first use by eagle_dropmatch.cpu_linear.bf16_avx2_extension (torch.utils.cpp_extension) with -mavx2
// -mfma; the engine uses it where torch's best vector code is AVX2 (reported only with FMA), tests on any
// AVX2 CPU.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int kBlock = 16;      // output columns per block: one 32-byte line of bf16 weights per input
constexpr int kMaxRows = 6;     // rows sharing each weight line
constexpr int kTileBlocks = 4;  // blocks a thread runs every group of rows over before it moves on
// How far ahead of the line it multiplies a tile of several rows asks for its weights (a thread's blocks are
// one stream in memory). The hardware's own prefetch keeps up at one row, which is bound by memory, but not at
// four, where the FMAs keep the core busy: on a 2-core Zen 3 a 4-row product over weights from memory took
// about the time of the one from the caches plus that of reading them, and 10-25% less with this request
// 2 KiB ahead (one row: no gain, so one row does not ask).
constexpr int kPrefetchBytes = 2048;

// fp32 -> bf16 bits in the top half of each lane, rounded to nearest even as torch rounds (NaN kept a quiet
// NaN); the bottom half is left as it is.
inline __m256i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
}

// rows x (blocks x 16) outputs: c[r, 16 b + j] = sum over inputs k, in order, of x[r, k] w[16 b + j, k].
//   a: rows of the input in fp32, row stride lda floats; w: the first block's packed weight (a line of 16 bf16
//   per input), block stride wstride (lines); inputs: the input width; c: bf16 output, row stride ldc; cols:
//   valid columns from c's first (the last block may be partial); bias: fp32 [cols] or nullptr.
// A line's 32-bit lane j holds columns 2j (low half) and 2j + 1 (high half): a shift gives the even columns'
// fp32 weights and a mask the odd ones' (one instruction where two shifts were: 4 rows over one block on a
// Zen 3 core, weights in the caches, 35.1 against 38.4 us), and both multiply the same broadcast input.
template <int R, int B>
void tile(const float* a, int64_t lda, const uint16_t* w, int64_t wstride, int64_t inputs, uint16_t* c,
          int64_t ldc, int64_t cols, const float* bias) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));  // a lane's top half
  __m256 even[R][B], odd[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) even[r][b] = odd[r][b] = _mm256_setzero_ps();
  for (int64_t k = 0; k < inputs; ++k) {
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      if (R > 1 && (k & 1) == 0)  // once per 64-byte cache line (two inputs' lines)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * wstride + k * kBlock) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * wstride + k * kBlock));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(line, high));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
        even[r][b] = _mm256_fmadd_ps(we, x, even[r][b]);
        odd[r][b] = _mm256_fmadd_ps(wo, x, odd[r][b]);
      }
    }
  }
  // the sums leave the registers here, once (indexing them in the loops below would keep them in memory)
  alignas(32) float sums[R][B][2][kBlock / 2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      _mm256_store_ps(sums[r][b][0], even[r][b]);
      _mm256_store_ps(sums[r][b][1], odd[r][b]);
    }
  for (int b = 0; b < B; ++b) {
    const int64_t first = b * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, cols - first);
    if (valid <= 0) break;
    alignas(32) float add[kBlock] = {};
    if (bias) std::memcpy(add, bias + first, valid * sizeof(float));
    alignas(32) float even_bias[kBlock / 2], odd_bias[kBlock / 2];  // as the sums hold the columns
    for (int j = 0; j < kBlock / 2; ++j) even_bias[j] = add[2 * j], odd_bias[j] = add[2 * j + 1];
    const __m256 bias_even = _mm256_load_ps(even_bias), bias_odd = _mm256_load_ps(odd_bias);
    for (int r = 0; r < R; ++r) {
      const __m256 e_sum = _mm256_load_ps(sums[r][b][0]), o_sum = _mm256_load_ps(sums[r][b][1]);
      const __m256i e = round_to_bf16(bias ? _mm256_add_ps(e_sum, bias_even) : e_sum);
      const __m256i o = round_to_bf16(bias ? _mm256_add_ps(o_sum, bias_odd) : o_sum);
      const __m256i out = _mm256_or_si256(_mm256_srli_epi32(e, 16), _mm256_and_si256(o, high));  // [c0, c1, ...]
      if (valid == kBlock) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + first), out);
      } else {
        alignas(32) uint16_t lanes[kBlock];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), out);
        std::memcpy(c + r * ldc + first, lanes, valid * sizeof(uint16_t));
      }
    }
  }
}

// Blocks per tile for R rows: 2 R B sums, with the line's two weight registers and the broadcast inputs all
// in the 16 registers. 2 rows x 3 blocks or 3 x 2 (12 sums) left too few: GCC kept sums on the stack, and on
// a Zen 3 core 3 rows took 1.7x as long as over one block at a time, 2 rows 1.9x as long as over two.
constexpr int blocks_for(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

template <int R>
void run_rows(int64_t blocks, const float* a, int64_t lda, const uint16_t* w, int64_t wstride, int64_t inputs,
              uint16_t* c, int64_t ldc, int64_t cols, const float* bias) {
  constexpr int B = blocks_for(R);
  int64_t b = 0;
  for (; b + B <= blocks; b += B)
    tile<R, B>(a, lda, w + b * wstride, wstride, inputs, c + b * kBlock, ldc, cols - b * kBlock,
               bias ? bias + b * kBlock : nullptr);
  for (; b < blocks; ++b)
    tile<R, 1>(a, lda, w + b * wstride, wstride, inputs, c + b * kBlock, ldc, cols - b * kBlock,
               bias ? bias + b * kBlock : nullptr);
}

void run_any(int rows, int64_t blocks, const float* a, int64_t lda, const uint16_t* w, int64_t wstride,
             int64_t inputs, uint16_t* c, int64_t ldc, int64_t cols, const float* bias) {
  switch (rows) {
    case 1: run_rows<1>(blocks, a, lda, w, wstride, inputs, c, ldc, cols, bias); break;
    case 2: run_rows<2>(blocks, a, lda, w, wstride, inputs, c, ldc, cols, bias); break;
    case 3: run_rows<3>(blocks, a, lda, w, wstride, inputs, c, ldc, cols, bias); break;
    case 4: run_rows<4>(blocks, a, lda, w, wstride, inputs, c, ldc, cols, bias); break;
    case 5: run_rows<5>(blocks, a, lda, w, wstride, inputs, c, ldc, cols, bias); break;
    default: run_rows<6>(blocks, a, lda, w, wstride, inputs, c, ldc, cols, bias); break;
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
    blocks_ = (out_features_ + kBlock - 1) / kBlock;
    auto padded = at::zeros({blocks_ * kBlock, in_features_}, w.options());
    padded.narrow(0, 0, out_features_).copy_(w);
    // [blocks, 16, in] -> [blocks, in, 16]
    packed_ = padded.view({blocks_, kBlock, in_features_}).permute({0, 2, 1}).contiguous();
  }

  // x: [..., in] -> [..., out] in bf16.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features_, "expected inputs of width ", in_features_,
                ", got ", x.sizes());
    const auto a = x.reshape({-1, in_features_}).to(at::kBFloat16).to(at::kFloat).contiguous();  // [M, in], exact
    const int64_t m = a.size(0);
    auto c = at::empty({m, out_features_}, x.options().dtype(at::kBFloat16));  // [M, out]
    at::Tensor bias_fp32;
    const float* bias_ptr = nullptr;
    if (bias.has_value()) {
      bias_fp32 = bias->to(at::kFloat).contiguous();
      bias_ptr = bias_fp32.data_ptr<float>();
    }
    const float* a_ptr = a.data_ptr<float>();
    const auto* w_ptr = reinterpret_cast<const uint16_t*>(packed_.data_ptr<at::BFloat16>());
    auto* c_ptr = reinterpret_cast<uint16_t*>(c.data_ptr<at::BFloat16>());
    const int64_t lda = in_features_, wstride = in_features_ * kBlock, ldc = out_features_;
    const int64_t blocks = blocks_, inputs = in_features_, out = out_features_;
    if (m > 0) {
      const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks)));
      at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t first = blocks * t / threads, last = blocks * (t + 1) / threads;
          for (int64_t b = first; b < last; b += kTileBlocks) {
            const int64_t n = std::min<int64_t>(kTileBlocks, last - b);
            const int64_t col = b * kBlock;
            for (int64_t r = 0; r < m; r += kMaxRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r));
              run_any(rows, n, a_ptr + r * lda, lda, w_ptr + b * wstride, wstride, inputs, c_ptr + r * ldc + col,
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
  // ones), for rows x [P, in] without a bias, screened on an int8 copy of the weight (built at first call).
  // The bounds are those of bf16_linear.cpp's screen (its comment gives the argument): each weight row j is
  // s_j q_j (q_j int8), each input s_x q_x (q_x an integer), a_j = s_j s_x (q_j . q_x) is within
  // e_j = 0.51 s_j |x|_1 + 0.51 s_x s_j |q_j|_1 of w_j . x, plus a bound on the kernel's own fp32 sums and a_j's
  // rounding; a block of 16 outputs whose largest a_j + e_j rounds (to bf16) below what the best a_i - e_i rounds
  // to holds no first maximum, and only the other blocks are computed, by forward's own tile (the same sums).
  // AVX2 has no VPDPBUSD. The int8 copy holds, for each block and each pair of inputs, the 16 outputs' two
  // weights in 32 bytes; VPMOVSXBW widens each half (8 outputs) to int16 and VPMADDWD multiplies it by the
  // pair's two int16 inputs (q_x, |q_x| <= 32639 as in the AVX512 build), adding both products into the
  // output's own 32-bit lane: one multiply per row for 16 products. VPMADDUBSW (unsigned bytes by signed ones,
  // saturating in int16) needs the input split into two 7-bit digits and twice the multiplies: on a Zen 3 core,
  // weights in the caches, 4 rows of SmolLM2's head took 2.44 ms that way, 1.88 ms this way and 1.90-2.90 ms in
  // full. q_j . q_x is exact in int32 (wrapping on the way, as the result fits). The int8 copy streams half the
  // bf16 weight's bytes.
  // A row gets -1 where the screen leaves more than `max_blocks` blocks or meets a value that is not finite.
  at::Tensor screened_argmax(const at::Tensor& x, double max_row_norm, int64_t max_blocks) {
    return std::get<0>(screened_argmax_rivals(x, max_row_norm, max_blocks, 0, std::nullopt));
  }

  // screened_argmax, and for each row `rivals` outputs that score high, from the same bounds: the output with
  // the largest upper bound in each of the `rivals` blocks whose largest upper bound is highest (as in
  // bf16_linear.cpp). rival_rows: bool [P], the rows that want rivals (the others get -1), or None for all.
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
    for (int64_t r = 0; r < m; r += kScreenRows) {  // up to 4 rows share each int8 weight line read
      const int n = static_cast<int>(std::min<int64_t>(kScreenRows, m - r));
      const uint16_t* part = rows_ptr + r * in_features_;
      int64_t* into = result.data_ptr<int64_t>() + r;
      int64_t* rivals_into = rival_ids.data_ptr<int64_t>() + r * rivals;
      const bool* want = wanted.data_ptr<bool>() + r;
      switch (n) {
        case 1: screen_rows<1>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 2: screen_rows<2>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        case 3: screen_rows<3>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
        default: screen_rows<4>(part, max_row_norm, max_blocks, into, rivals, want, rivals_into); break;
      }
    }
    return {result, rival_ids};
  }

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  // The most rows the screen serves faster than forward: those of one pass over the int8 copy. Each row costs
  // a multiply per 16 products (as forward's FMA per 8 columns), so the screen saves only the bytes it does
  // not read, and a second pass reads them again. SmolLM2's head, 49152 x 576, 2-core Zen 3, weights from
  // memory, ms, screen / forward: 1 row 1.0-1.5 / 1.5-2.1, 4 rows 1.7-2.1 / 1.9-2.8, 5 rows (two passes)
  // 2.6-2.9 / 2.0-2.1; one pass of 6 rows (12 sums and more registers than AVX2 has) 3.2 / 3.0.
  static int64_t screen_max_rows() { return kScreenRows; }

 private:
  // Rows sharing each int8 weight line: 2 R sums, the line's two halves and a broadcast input pair stay in
  // the 16 registers at 4.
  static constexpr int kScreenRows = 4;
  static constexpr int kScreenPrefetchBytes = 2048;

  // Bounds for R rows on the block of 16 outputs `block` (two halves of 8): the largest upper bound of its
  // outputs into upper[r * blocks_ + block], the output that has it into lanes[r * blocks_ + block] (0-15; none
  // kept where lanes is null), and the best lower bounds into best[r] (per lane; -inf where a bound is not a
  // number, so that the row is left open).
  //   xq: per row, q_x as int16, two inputs to an int32 (pairs_ of them).
  template <int R>
  void screen_block(int64_t block, const int32_t* xq, const float* scale_x, const float* weight_term,
                    const float* input_term, const float* sum_error, float* upper, uint8_t* lanes,
                    __m256* best) const {
    const int64_t first = block * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, out_features_ - first);
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256 plus_inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256i sums[2][R];  // per half of the block
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[0][r] = sums[1][r] = _mm256_setzero_si256();
    const int8_t* q = screen_q_.data() + block * pairs_ * 32;
    for (int64_t p = 0; p < pairs_; ++p) {
      if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + p * 32) + kScreenPrefetchBytes, _MM_HINT_T0);
      const __m256i first_half = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 32)));
      const __m256i second_half =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 32 + 16)));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(xq[r * pairs_ + p]);
        sums[0][r] = _mm256_add_epi32(sums[0][r], _mm256_madd_epi16(first_half, x));
        sums[1][r] = _mm256_add_epi32(sums[1][r], _mm256_madd_epi16(second_half, x));
      }
    }
    alignas(32) float bounds[R][kBlock];
    for (int half = 0; half < 2; ++half) {
      const int64_t at = first + half * 8;
      const __m256 scale = _mm256_loadu_ps(screen_scale_.data() + at);
      const __m256 l1 = _mm256_loadu_ps(screen_l1_.data() + at);
      // the lanes of real outputs (the last block may be partial; padded ones take no part)
      const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
          _mm256_set1_epi32(static_cast<int>(valid - half * 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(sums[half][r]);
        const __m256 approx = _mm256_mul_ps(_mm256_mul_ps(dot, _mm256_set1_ps(scale_x[r])), scale);
        const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), approx);
        __m256 error = _mm256_mul_ps(scale, _mm256_add_ps(_mm256_set1_ps(weight_term[r]),
                                                          _mm256_mul_ps(_mm256_set1_ps(input_term[r]), l1)));
        error = _mm256_add_ps(_mm256_add_ps(error, _mm256_set1_ps(sum_error[r])),
                              _mm256_add_ps(_mm256_mul_ps(magnitude, _mm256_set1_ps(4.8e-7f)), _mm256_set1_ps(1e-30f)));
        __m256 up = _mm256_add_ps(approx, error);
        up = _mm256_blendv_ps(up, plus_inf, _mm256_cmp_ps(up, up, _CMP_UNORD_Q));  // not a number: kept
        _mm256_store_ps(bounds[r] + half * 8, _mm256_blendv_ps(minus_inf, up, real));
        __m256 low = _mm256_sub_ps(approx, error);
        low = _mm256_blendv_ps(low, minus_inf, _mm256_cmp_ps(low, low, _CMP_UNORD_Q));
        best[r] = _mm256_max_ps(best[r], _mm256_blendv_ps(minus_inf, low, real));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float largest = max_of(_mm256_max_ps(_mm256_load_ps(bounds[r]), _mm256_load_ps(bounds[r] + 8)));
      upper[r * blocks_ + block] = largest;
      if (lanes != nullptr) {
        int lane = 0;
        while (lane < kBlock - 1 && bounds[r][lane] != largest) ++lane;
        lanes[r * blocks_ + block] = static_cast<uint8_t>(lane);
      }
    }
  }

  static float max_of(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }

  // screened_argmax for R rows (bf16 bits, R x in) into result[0, R): -1 where undecided; with rivals > 0,
  // the rivals of each row r that wants them (want[r]) into rival_ids[r * rivals, (r + 1) * rivals).
  template <int R>
  void screen_rows(const uint16_t* rows, double max_row_norm, int64_t max_blocks, int64_t* result, int64_t rivals,
                   const bool* want, int64_t* rival_ids) {
    // |q_x| <= limit, so that |q_j . q_x| <= 127 limit width < 2^31
    const int64_t width = pairs_ * 2;
    const int64_t limit = std::min<int64_t>(32639, (int64_t{1} << 31) / (128 * std::max<int64_t>(width, 1)));
    std::vector<int32_t> xq(R * pairs_, 0);
    std::vector<float> xf(R * in_features_);
    float scale_x[R], weight_term[R], input_term[R], sum_error[R];
    bool usable[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* row = rows + r * in_features_;
      float* values = xf.data() + r * in_features_;
      float largest = 0.0f, l1 = 0.0f, l2 = 0.0f;
      bool finite = true;
      for (int64_t k = 0; k < in_features_; ++k) {
        const uint32_t bits = static_cast<uint32_t>(row[k]) << 16;
        std::memcpy(&values[k], &bits, sizeof(float));
        finite = finite && std::isfinite(values[k]);
        largest = std::max(largest, std::fabs(values[k]));
        l1 += std::fabs(values[k]);
        l2 += values[k] * values[k];
      }
      usable[r] = finite;
      scale_x[r] = largest > 0.0f ? largest / static_cast<float>(limit) : 1.0f;
      auto* quantized = reinterpret_cast<int16_t*>(xq.data() + r * pairs_);
      for (int64_t k = 0; k < in_features_ && finite; ++k)
        quantized[k] = static_cast<int16_t>(std::lrint(values[k] / scale_x[r]));
      // |x|_1 and |x|_2 summed in fp32: inflated by (1 + (in + 2) 2^-23) to bound them from above
      const float inflate = 1.0f + static_cast<float>(in_features_ + 2) * 1.2e-7f;
      weight_term[r] = 0.51f * l1 * inflate;
      input_term[r] = 0.51f * scale_x[r];
      sum_error[r] = static_cast<float>(4.0 * (in_features_ + 1) * std::ldexp(1.0, -24) *
                                        std::sqrt(static_cast<double>(l2) * inflate) * max_row_norm);
    }
    std::vector<float> upper(R * blocks_);  // per row and block: the largest upper bound of its outputs
    std::vector<float> again(rivals > 0 ? blocks_ : 0);  // a rival block's bound, found again with its lane
    std::vector<uint8_t> lanes(rivals > 0 ? blocks_ : 0);
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks_)));
    std::vector<float> best_lower(threads * R, -std::numeric_limits<float>::infinity());
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        __m256 best[R];
        for (int r = 0; r < R; ++r) best[r] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t block = blocks_ * t / threads; block < blocks_ * (t + 1) / threads; ++block)
          screen_block<R>(block, xq.data(), scale_x, weight_term, input_term, sum_error, upper.data(), nullptr,
                          best);
        for (int r = 0; r < R; ++r) best_lower[t * R + r] = max_of(best[r]);
      }
    });
    const int64_t wstride = in_features_ * kBlock, out = out_features_;
    const auto* w_ptr = reinterpret_cast<const uint16_t*>(packed_.data_ptr<at::BFloat16>());
    std::vector<uint16_t> c(kBlock);
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
          __m256 unused = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          screen_block<1>(order[i], xq.data() + r * pairs_, scale_x + r, weight_term + r, input_term + r,
                          sum_error + r, again.data(), lanes.data(), &unused);
        }
        for (int64_t i = 0; i < rivals; ++i) {
          const int64_t b = order[i % top];
          rival_ids[r * rivals + i] = b * kBlock + lanes[b];
        }
      }
      // a block whose largest bound rounds below what the best lower bound rounds to holds no first maximum
      const float floor = bf16_rounded(lower);
      blocks.clear();
      for (int64_t b = 0; b < blocks_ && static_cast<int64_t>(blocks.size()) <= max_blocks; ++b) {
        if (bf16_rounded(upper[r * blocks_ + b]) >= floor) blocks.push_back(b);
      }
      if (static_cast<int64_t>(blocks.size()) > max_blocks) continue;
      // the candidate blocks by forward's own tile (each output summed in input order by one lane, as there),
      // in increasing order: the first maximum
      float best_value = -std::numeric_limits<float>::infinity();
      int64_t best_index = -1;
      bool finite = true;
      for (const int64_t b : blocks) {
        const int64_t col = b * kBlock, valid = std::min<int64_t>(kBlock, out - col);
        tile<1, 1>(xf.data() + r * in_features_, in_features_, w_ptr + b * wstride, wstride, in_features_, c.data(),
                   kBlock, valid, nullptr);
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

  // The int8 copy of the weight for screened_argmax, packed [blocks][pairs][16 outputs][2 inputs] (pairs_ = in
  // / 2 rounded up; padding holds 0), each output's scale and the sum of its |q|. Made from packed_ at the
  // first call.
  void build_screen() {
    std::call_once(screen_once_, [this] {
      pairs_ = (in_features_ + 1) / 2;
      const int64_t outputs = blocks_ * kBlock;
      screen_q_.assign(outputs * pairs_ * 2, 0);
      screen_scale_.assign(outputs, 0.0f);
      screen_l1_.assign(outputs, 0.0f);
      const auto weight = packed_.permute({0, 2, 1}).reshape({blocks_ * kBlock, in_features_})
                              .narrow(0, 0, out_features_).to(at::kFloat).contiguous();
      const float* w = weight.data_ptr<float>();
      for (int64_t j = 0; j < out_features_; ++j) {
        float largest = 0.0f;
        for (int64_t k = 0; k < in_features_; ++k) largest = std::max(largest, std::fabs(w[j * in_features_ + k]));
        const float scale = largest > 0.0f ? largest / 127.0f : 1.0f;
        float l1 = 0.0f;
        int8_t* line = screen_q_.data() + (j / kBlock) * pairs_ * 32 + (j % kBlock) * 2;
        for (int64_t k = 0; k < in_features_; ++k) {
          const long q = std::max(-127L, std::min(127L, std::lrint(w[j * in_features_ + k] / scale)));
          line[(k / 2) * 32 + k % 2] = static_cast<int8_t>(q);
          l1 += std::fabs(static_cast<float>(q));
        }
        screen_scale_[j] = scale;
        screen_l1_[j] = l1;  // an integer below 2^24: exact
      }
    });
  }

  int64_t in_features_ = 0, out_features_ = 0, blocks_ = 0;
  at::Tensor packed_;  // bf16 [blocks, in, 16]
  std::once_flag screen_once_;
  int64_t pairs_ = 0;
  std::vector<int8_t> screen_q_;
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
      .def_property_readonly_static("screen_max_rows", [](pybind11::object) {
        return PackedBF16Linear::screen_max_rows();
      })
      .def_property_readonly("in_features", &PackedBF16Linear::in_features)
      .def_property_readonly("out_features", &PackedBF16Linear::out_features);
}
