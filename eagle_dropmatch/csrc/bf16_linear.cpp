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
// -mavx512bf16, and used only where the CPU reports AVX512-BF16.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

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

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

 private:
  int64_t in_features_ = 0, out_features_ = 0, pairs_ = 0, blocks_ = 0;
  at::Tensor packed_;
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
