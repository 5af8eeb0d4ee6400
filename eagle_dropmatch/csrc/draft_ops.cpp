// Small ops of the EAGLE-3 head's drafting on a CPU, each in one call instead of a few to a dozen tensor ops.
//
// A round drafts with three head steps (one over the accepted tokens, then one per tree level) and three
// draft-vocabulary softmaxes. On a 2-core CPU most of that time is spent starting small tensor ops, not in
// arithmetic: the head's RMSNorm alone is about ten ops (about 20 us) and runs thirteen times a round.
//
// rms_norm: weight * round(x * rsqrt(mean(x^2) + eps)), the Llama form of eagle_dropmatch.head.RMSNorm and of
// transformers' RMSNorms: the normalisation in fp32, rounded to x's dtype, then scaled in that dtype. The
// squares are summed in the order of torch's CPU sum over vectors of `lanes` floats (8 on x86), which gives
// torch's values bit for bit (eagle_dropmatch.cpu_norm checks it per norm before swapping a target's).
//
// topk_log_softmax: the k best log-probabilities of each row of logits and their indices, largest first, the
// lower index first among equal values: torch.log_softmax(logits.float()).topk(k) without the [R, V]
// intermediate (log-probabilities within rounding of torch's; the same order).
//
// select_tree: the tree kept from a tree search's candidates, eagle_dropmatch.tree.select_tree's tensors exactly,
// in one call instead of about forty ops.
//
// Built at first use by eagle_dropmatch.extensions.draft_ops (torch.utils.cpp_extension), for the CPU's vector
// instructions; the head runs its Python where it cannot be built, or for tensors off the CPU or under autograd.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;

template <typename T>
inline float widen(T value) { return static_cast<float>(value); }

// The sum of values[0, n) in the order of torch's sum over a contiguous fp32 row on the CPU (ATen's
// vectorized_inner_sum, native/cpu/SumKernel.cpp) with vectors of `lanes` floats (8 on x86, where torch's
// sum has no AVX512 variant: measured): the vectors summed into four accumulators (vector i into i % 4) through
// up to four cascade levels, the leftover vectors into the first, the four added in order, then the scalar
// tail and the lanes added one by one into a scalar; a row shorter than a vector as scalars in that scheme. So a norm that sums its squares this way gives torch's mean bit for bit
// (checked at load against torch itself; where the order differs, the check fails and torch's ops run).
constexpr int64_t kMaxLanes = 16;
constexpr int64_t kIlp = 4;
constexpr int64_t kLevels = 4;

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

float torch_order_sum(const float* values, int64_t n, int64_t lanes) {
  if (n < lanes) {
    lanes = 1;  // a row shorter than a vector: torch sums it as scalars, in the same scheme (scalar_inner_sum)
  }
  float acc[kLevels][kIlp][kMaxLanes] = {};
  const int64_t vectors = n / lanes, groups = vectors / kIlp;
  auto add_group = [&](float* into, int64_t group) {  // acc[0][k] += vector group * 4 + k, for k < 4
    for (int64_t k = 0; k < kIlp; ++k) {
      const float* v = values + (group * kIlp + k) * lanes;
      for (int64_t l = 0; l < lanes; ++l) into[k * kMaxLanes + l] += v[l];
    }
  };
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_group(&acc[0][0][0], i);
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        for (int64_t l = 0; l < lanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i) add_group(&acc[0][0][0], i);
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int64_t k = 0; k < kIlp; ++k) {
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
    }
  }
  float* partial = acc[0][0];
  for (int64_t v = groups * kIlp; v < vectors; ++v) {
    for (int64_t l = 0; l < lanes; ++l) partial[l] += values[v * lanes + l];
  }
  for (int64_t k = 1; k < kIlp; ++k) {
    for (int64_t l = 0; l < lanes; ++l) partial[l] += acc[0][k][l];
  }
  float total = 0.0f;
  for (int64_t e = vectors * lanes; e < n; ++e) total += values[e];
  for (int64_t l = 0; l < lanes; ++l) total += partial[l];
  return total;
}

// exp(x) for x <= 0 within about 2 ulp (exp(x) for x < -87 is taken as exp(-87), about 1.6e-38: the terms of
// a softmax sum whose largest term is 1). A polynomial the compiler vectorises, unlike std::exp.
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;
  // x = n ln2 + r, |r| <= ln2 / 2: n rounded to nearest by adding and removing 1.5 * 2^23 (std::floor stops
  // the compiler from vectorising the loop)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// row[0, n) widened to fp32 into out (bf16 by a shift of its bits, which the compiler vectorises).
template <typename T>
void widen_row(const T* row, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(row[i]);
}

template <>
void widen_row<c10::BFloat16>(const c10::BFloat16* row, float* out, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(row);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    std::memcpy(out + i, &bits, sizeof(float));
  }
}

// Whether a ranks strictly above b in a top-k: NaN above every number (as torch.topk), then by value.
inline bool ranks_above(float a, float b) {
  return std::isnan(a) ? !std::isnan(b) : a > b;
}

// [..., H] (bf16, fp16 or fp32, contiguous, on the CPU) -> the same shape and dtype; weight: [H] in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu() && x.is_contiguous() && x.size(-1) >= 1,
              "expected contiguous CPU x [..., H], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
              weight.is_contiguous() && weight.device().is_cpu(),
              "expected a contiguous CPU weight [H] in x's dtype, got ", weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(lanes >= 1 && lanes <= kMaxLanes, "lanes must be in [1, ", kMaxLanes, "], got ", lanes);
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    std::vector<float> squares(h);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* row = in + r * h;
      for (int64_t i = 0; i < h; ++i) {
        const float v = widen(row[i]);
        squares[i] = v * v;
      }
      const float mean = torch_order_sum(squares.data(), h, lanes) / static_cast<float>(h);
      const float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) {
        const scalar_t normed = static_cast<scalar_t>(widen(row[i]) * scale);  // rounded to x's dtype
        o[r * h + i] = static_cast<scalar_t>(widen(w[i]) * widen(normed));
      }
    }
  });
  return out;
}

// The k best log-probabilities of row[0, v) (fp32) into scores[0, k) and their indices into ids[0, k).
void row_topk_log_softmax(const float* row, int64_t v, int64_t k, float* scores, int64_t* ids) {
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  float top = -std::numeric_limits<float>::infinity(), nan_seen = 0.0f;
#pragma omp simd reduction(max : top) reduction(+ : nan_seen)
  for (int64_t i = 0; i < v; ++i) {
    top = row[i] > top ? row[i] : top;
    nan_seen += row[i] != row[i] ? 1.0f : 0.0f;
  }
  const bool nan = nan_seen != 0.0f;
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < v; ++i) total += exp_nonpositive(row[i] - top);
  const float log_total = (nan || std::isinf(top)) ? std::numeric_limits<float>::quiet_NaN()
                                                   : top + std::log(total);
  // The k best by insertion: a later index enters only when it ranks strictly higher, so ties keep the
  // lower index; NaN ranks above every number, as in torch.topk. A block of kLanes entries none of which
  // ranks above the k-th best so far is skipped whole.
  int64_t held = 0;
  for (int64_t b = 0; b < v; b += kLanes) {
    const int64_t b_end = b + kLanes < v ? b + kLanes : v;
    if (held == k && !nan) {
      bool any = false;
      for (int64_t j = b; j < b_end; ++j) any |= row[j] > best[k - 1];
      if (!any) continue;
    }
    for (int64_t j = b; j < b_end; ++j) {
      const float x = row[j];
      if (held == k && !ranks_above(x, best[k - 1])) continue;
      int64_t slot = held < k ? held++ : k - 1;
      while (slot > 0 && ranks_above(x, best[slot - 1])) {
        best[slot] = best[slot - 1];
        where[slot] = where[slot - 1];
        --slot;
      }
      best[slot] = x;
      where[slot] = j;
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    scores[j] = best[j] - log_total;
    ids[j] = where[j];
  }
}

// logits [R, V] (bf16, fp16 or fp32, contiguous, on the CPU), 1 <= k <= V -> (fp32 [R, k] log-probabilities,
// int64 [R, k] indices), each row's best first, the lower index first among equal logits. Rows holding NaN or
// an infinity that decides their maximum give NaN log-probabilities, as torch's log_softmax does.
std::tuple<at::Tensor, at::Tensor> topk_log_softmax(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.is_contiguous(),
              "expected contiguous CPU logits [R, V], got ", logits.sizes());
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= v, "k must be in [1, ", v, "], got ", k);
  auto scores = at::empty({rows, k}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({rows, k}, logits.options().dtype(at::kLong));
  float* s = scores.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  std::vector<float> buffer(v);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "topk_log_softmax", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      widen_row(data + r * v, buffer.data(), v);
      row_topk_log_softmax(buffer.data(), v, k, s + r * k, id + r * k);
    }
  });
  return {scores, ids};
}

// The draft tree kept from a tree search's candidates, as eagle_dropmatch.tree.select_tree builds it (the same
// tensors, exactly): the best keep = min(total_token - 1, C) candidates by score (a stable sort, descending:
// the earlier candidate first among equal scores; NaN first, as torch.sort), in creation order after the root.
//
// cand_tokens, cand_parents: int64 [C] (a parent is an earlier candidate's index, -1 for the root's children);
// cand_scores: fp32 [C]; root_token: int64 [1]. Returns tokens, parents, depths (int64 [N]), ancestors
// (bool [N, N]: ancestors[i][j] when j is i or an ancestor of i) and has_children (bool [N]), N = keep + 1.
std::vector<at::Tensor> select_tree(const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                                    const at::Tensor& cand_parents, const at::Tensor& root_token,
                                    int64_t total_token) {
  const int64_t c = cand_tokens.numel();
  TORCH_CHECK(cand_tokens.device().is_cpu() && cand_tokens.scalar_type() == at::kLong && cand_tokens.dim() == 1 &&
              cand_parents.scalar_type() == at::kLong && cand_parents.numel() == c &&
              cand_scores.scalar_type() == at::kFloat && cand_scores.numel() == c &&
              root_token.scalar_type() == at::kLong && root_token.numel() == 1 && total_token >= 1,
              "expected int64 tokens and parents and fp32 scores [C] and an int64 root on the CPU");
  const auto tokens_in = cand_tokens.contiguous(), parents_in = cand_parents.contiguous();
  const auto scores_in = cand_scores.contiguous();
  const int64_t* tok = tokens_in.data_ptr<int64_t>();
  const int64_t* par = parents_in.data_ptr<int64_t>();
  const float* score = scores_in.data_ptr<float>();
  std::vector<int64_t> order(c);
  for (int64_t i = 0; i < c; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ranks_above(score[a], score[b]); });
  const int64_t keep = std::min(total_token - 1, c), n = keep + 1;
  std::vector<int64_t> chosen(order.begin(), order.begin() + keep);
  std::sort(chosen.begin(), chosen.end());  // creation order: parents before children
  std::vector<int64_t> node_of(c, -1);
  for (int64_t j = 0; j < keep; ++j) node_of[chosen[j]] = j + 1;
  auto long_options = cand_tokens.options();
  auto tokens = at::empty({n}, long_options), parents = at::empty({n}, long_options);
  auto depths = at::zeros({n}, long_options);
  auto ancestors = at::zeros({n, n}, long_options.dtype(at::kBool));
  auto has_children = at::zeros({n}, long_options.dtype(at::kBool));
  int64_t* t = tokens.data_ptr<int64_t>();
  int64_t* p = parents.data_ptr<int64_t>();
  int64_t* d = depths.data_ptr<int64_t>();
  bool* a = ancestors.data_ptr<bool>();
  bool* h = has_children.data_ptr<bool>();
  t[0] = root_token.item<int64_t>();
  p[0] = -1;
  a[0] = true;
  for (int64_t j = 1; j < n; ++j) {
    const int64_t cand = chosen[j - 1];
    t[j] = tok[cand];
    p[j] = par[cand] < 0 ? 0 : node_of[par[cand]];  // -1 where the parent was not kept (then not a child)
    if (p[j] >= 0) {
      d[j] = d[p[j]] + 1;
      std::memcpy(a + j * n, a + p[j] * n, n * sizeof(bool));
    }
    a[j * n + j] = true;
    h[p[j] < 0 ? 0 : p[j]] = true;
  }
  return {tokens, parents, depths, ancestors, has_children};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("rms_norm", &rms_norm, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
             pybind11::arg("lanes") = 8);
  module.def("topk_log_softmax", &topk_log_softmax, pybind11::arg("logits"), pybind11::arg("k"));
  module.def("select_tree", &select_tree, pybind11::arg("cand_tokens"), pybind11::arg("cand_scores"),
             pybind11::arg("cand_parents"), pybind11::arg("root_token"), pybind11::arg("total_token"));
}
