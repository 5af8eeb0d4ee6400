// A bf16-weight product for CPUs with AVX2 and FMA but no bf16 arithmetic (AMD before Zen 4, most laptops'
// Intel cores), tuned for the few rows a decoding step or a tree verification sends (1 to a few dozen).
// The AVX2 counterpart of bf16_linear.cpp, without its int8 screen.
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
#include <cstdint>
#include <cstring>
#include <optional>

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

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

 private:
  int64_t in_features_ = 0, out_features_ = 0, blocks_ = 0;
  at::Tensor packed_;  // bf16 [blocks, in, 16]
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<PackedBF16Linear>(m, "PackedBF16Linear")
      .def(pybind11::init<const at::Tensor&>(), pybind11::arg("weight"))
      .def("forward", &PackedBF16Linear::forward, pybind11::arg("x"), pybind11::arg("bias") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("in_features", &PackedBF16Linear::in_features)
      .def_property_readonly("out_features", &PackedBF16Linear::out_features);
}
