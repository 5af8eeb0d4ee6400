// DropMatch's contest in one call: which children could be which dropout samples' argmax, and so which
// samples the match rule must score.
//
// The Python reference is eagle_dropmatch.dropmatch.contested_samples, with contested_children and its rivals
// from rival_tokens: a sample at node n can accept a child c other than n's undropped token only if c is the
// sample's argmax, so the sample's logit for c must be at least its logits for n's rivals (the undropped token
// and the best few tokens of the best blocks of n's undropped logits) and for c's siblings; the samples worth
// scoring are those with such a child that could change the path. On a CPU the reference takes 0.6-1 ms a
// round, most of it in the overhead of a few dozen small tensor ops; here contested_children is a few loops
// over the nodes with a contested child (their rivals, then for each of their samples the dropped input
// rounded as the scorer gets it, its fp32 dot products with the rivals' and children's rows of W and
// the rounding test of dropmatch.may_win for one rounding, no logit transform), and contested_samples adds
// the selection on the tree (reach, acceptance.could_outrank) in plain loops over its few nodes. The sums run
// in another order than torch's, which the error bound (dropmatch.accumulation_error) covers, so a child
// passes here exactly where it passes there except where a logit sits on a rounding boundary. Where the
// engine takes the undropped tokens from the LM head's int8 screen (no undropped logits), the rivals come from
// the screen too and are passed in place of the logits; any rivals keep the contest exact.
//
// Built at first use by eagle_dropmatch.dropmatch.contest_extension (torch.utils.cpp_extension), for the CPU's
// vector instructions; the engine runs the Python reference where it cannot be built.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRivalBlock = 256;     // dropmatch.RIVAL_BLOCK
constexpr int64_t kRivalBlocks = 16;     // dropmatch.RIVAL_BLOCKS
constexpr int64_t kRivalsPerBlock = 4;   // dropmatch.RIVALS_PER_BLOCK

constexpr int64_t kMostBest = kRivalBlocks * kRivalsPerBlock;  // the most ids append_best keeps

// The `count` ids of values[first, last) with the highest values, best first (ties towards the lower id),
// appended to `out`: one pass that keeps the best so far in order (count is at most kMostBest).
template <typename T>
void append_best(const T* values, int64_t first, int64_t last, int64_t count, std::vector<int64_t>& out) {
  TORCH_CHECK(count <= kMostBest, "append_best keeps at most ", kMostBest, " ids, asked for ", count);
  count = std::min<int64_t>(count, last - first);
  if (count <= 0) {
    return;
  }
  const size_t base = out.size();
  out.resize(base + count);
  int64_t* ids = out.data() + base;
  float kept[kMostBest];
  int64_t size = 0;
  for (int64_t id = first; id < last; ++id) {
    const float value = static_cast<float>(values[id]);
    if (size == count && !(value > kept[count - 1])) {
      continue;  // not above the worst kept (a tie keeps the lower id, seen first)
    }
    int64_t at = size < count ? size++ : count - 1;
    for (; at > 0 && value > kept[at - 1]; --at) {
      kept[at] = kept[at - 1];
      ids[at] = ids[at - 1];
    }
    kept[at] = value;
    ids[at] = id;
  }
}

// The largest of kRivalBlock values, widened to fp32 as they are read.
template <typename T>
inline float block_max(const T* block) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < kRivalBlock; ++i) {
    best = std::max(best, static_cast<float>(block[i]));
  }
  return best;
}

// bf16 is widened by a shift of its bits, which the compiler vectorizes (a NaN logit is left to the caller's
// checks: the engine's logits are finite).
template <>
inline float block_max<c10::BFloat16>(const c10::BFloat16* block) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(block);
  float best = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < kRivalBlock; ++i) {
    best = std::max(best, __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16));
  }
  return best;
}

// A node's rivals, as dropmatch.rival_tokens: its undropped token, then the best `per_block` tokens of each of
// the `blocks` blocks of kRivalBlock ids with the highest maxima (a partial last block left out), or the exact
// best blocks x per_block tokens of a vocabulary of fewer blocks.
template <typename T>
std::vector<int64_t> rivals_of(const T* logits, int64_t vocab, int64_t undropped, int64_t blocks, int64_t per_block) {
  std::vector<int64_t> rivals{undropped};
  const int64_t count = vocab / kRivalBlock;
  if (count < blocks) {
    append_best(logits, 0, vocab, blocks * per_block, rivals);
    return rivals;
  }
  std::vector<float> maxima(count);
  for (int64_t b = 0; b < count; ++b) {
    maxima[b] = block_max(logits + b * kRivalBlock);
  }
  std::vector<int64_t> best_blocks;
  append_best(maxima.data(), 0, count, blocks, best_blocks);
  for (const int64_t b : best_blocks) {
    append_best(logits, b * kRivalBlock, (b + 1) * kRivalBlock, per_block, rivals);
  }
  return rivals;
}

// w[0, width) widened to fp32 into out (bf16 by a shift of its bits, which the compiler vectorizes).
template <typename T>
inline void widen(const T* w, int64_t width, float* out) {
  for (int64_t i = 0; i < width; ++i) {
    out[i] = static_cast<float>(w[i]);
  }
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* w, int64_t width, float* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(w);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    out[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
  }
}

constexpr int64_t kLanes = 16;  // partial sums per dot product, one vector's worth

// out[a * stride] = sum_i xs[a * width + i] * w[i] in fp32 for the B rows a < B of xs: B independent sums
// over one weight row, each in kLanes partial sums (the lanes summed in any order: the error bound allows it).
template <int B>
inline void dots(const float* xs, const float* w, int64_t width, float* out, int64_t stride) {
  float sums[B][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    for (int a = 0; a < B; ++a) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) {
        sums[a][l] += xs[a * width + i + l] * w[i + l];
      }
    }
  }
  for (int a = 0; a < B; ++a) {
    float total = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) {
      total += sums[a][l];
    }
    for (int64_t j = i; j < width; ++j) {
      total += xs[a * width + j] * w[j];
    }
    out[a * stride] = total;
  }
}

// dots for any number of rows of xs, four at a time.
inline void dots_of_rows(const float* xs, int64_t rows, const float* w, int64_t width, float* out, int64_t stride) {
  for (int64_t a = 0; a < rows; a += 4) {
    const float* x = xs + a * width;
    float* o = out + a * stride;
    switch (std::min<int64_t>(4, rows - a)) {
      case 4: dots<4>(x, w, width, o, stride); break;
      case 3: dots<3>(x, w, width, o, stride); break;
      case 2: dots<2>(x, w, width, o, stride); break;
      default: dots<1>(x, w, width, o, stride); break;
    }
  }
}

// Whether rivals_from holds the rivals themselves (int64 ids) rather than the undropped logits.
inline bool rivals_given(const at::Tensor& rivals_from) { return rivals_from.scalar_type() == at::kLong; }

// The vocabulary the ids must index: the weight's rows where rivals are given, else the logits' width.
inline int64_t vocab_of(const at::Tensor& rivals_from, const at::Tensor& weight) {
  return rivals_given(rivals_from) ? weight.size(0) : rivals_from.size(1);
}

// A value rounded to the scorer's output dtype, as Tensor.to rounds it (to nearest, ties to even).
template <typename T>
inline float rounded(float value) {
  return static_cast<float>(static_cast<T>(value));
}

// rivals_from: the undropped logits [N, V] (each node's rivals picked by rivals_of) or the rivals themselves,
// int64 [N, R] (the undropped token first, as the engine takes them from the LM head's int8 screen).
template <typename T>
at::Tensor contest(const at::Tensor& hidden, const at::Tensor& masks, const at::Tensor& rivals_from,
                   const at::Tensor& undropped, const at::Tensor& children, const at::Tensor& parents,
                   const at::Tensor& contested, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   double max_row_norm) {
  const bool given = rivals_given(rivals_from);
  const int64_t k = masks.size(0), n = masks.size(1), width = masks.size(2);
  const int64_t vocab = vocab_of(rivals_from, weight), rival_width = rivals_from.size(1);
  const int64_t edges = n - 1;
  const T* hidden_ptr = hidden.data_ptr<T>();
  const T* masks_ptr = masks.data_ptr<T>();
  const T* logits_ptr = given ? nullptr : rivals_from.data_ptr<T>();
  const int64_t* rivals_ptr = given ? rivals_from.data_ptr<int64_t>() : nullptr;
  const T* weight_ptr = weight.data_ptr<T>();
  const int64_t* undropped_ptr = undropped.data_ptr<int64_t>();
  const int64_t* children_ptr = children.data_ptr<int64_t>();
  const int64_t* parents_ptr = parents.data_ptr<int64_t>();
  const bool* contested_ptr = contested.data_ptr<bool>();
  const T* bias_ptr = bias.has_value() ? bias->data_ptr<T>() : nullptr;  // read where needed, not copied
  auto bias_of = [&](int64_t id) { return bias_ptr == nullptr ? 0.0f : static_cast<float>(bias_ptr[id]); };

  // Each node's children, and the nodes with a contested child.
  std::vector<std::vector<int64_t>> kids(n);
  std::vector<char> needed(n, 0);
  for (int64_t j = 0; j < edges; ++j) {
    TORCH_CHECK(parents_ptr[j] >= 0 && parents_ptr[j] < n, "parent ", parents_ptr[j], " out of range");
    TORCH_CHECK(children_ptr[j] >= 0 && children_ptr[j] < vocab, "token ", children_ptr[j], " out of range");
    kids[parents_ptr[j]].push_back(j);
    for (int64_t s = 0; s < k; ++s) {
      needed[parents_ptr[j]] = needed[parents_ptr[j]] || contested_ptr[s * edges + j];
    }
  }
  auto passes = at::zeros({k, edges}, contested.options());
  bool* passes_ptr = passes.data_ptr<bool>();
  std::vector<int64_t> nodes;
  for (int64_t node = 0; node < n; ++node) {
    if (needed[node]) {
      TORCH_CHECK(undropped_ptr[node] >= 0 && undropped_ptr[node] < vocab, "token ", undropped_ptr[node],
                  " out of range");
      nodes.push_back(node);
    }
  }
  if (nodes.empty()) {
    return passes;
  }

  // accumulation_error's factor: 4 (H + 1) 2^-24, times |x| and the largest row norm.
  const float error_factor = static_cast<float>(4.0 * static_cast<double>(width + 1) * std::ldexp(1.0, -24));
  const float row_norm = static_cast<float>(max_row_norm);
  // The scorer's input of a pair, hidden * mask rounded to the model's dtype, into x, and its error bound.
  auto input_of = [&](int64_t s, int64_t node, float* x) {
    const T* h = hidden_ptr + node * width;
    const T* m = masks_ptr + (s * n + node) * width;
    for (int64_t i = 0; i < width; ++i) {
      x[i] = static_cast<float>(static_cast<T>(static_cast<float>(h[i]) * static_cast<float>(m[i])));
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) {
      squares += x[i] * x[i];
    }
    return (error_factor * std::sqrt(squares)) * row_norm;
  };
  // Node by node: its rivals, its contesting samples' dropped inputs, then each rival's and child's row of W
  // (widened once) against all of those samples.
  at::parallel_for(0, static_cast<int64_t>(nodes.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs, errors, row(width), logits_of;  // [S, H], [S], [H], [S, R]
    std::vector<int64_t> samples;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t node = nodes[i];
      std::vector<int64_t> ids = given ? std::vector<int64_t>(rivals_ptr + node * rival_width,
                                                              rivals_ptr + (node + 1) * rival_width)
                                       : rivals_of(logits_ptr + node * vocab, vocab, undropped_ptr[node],
                                                   kRivalBlocks, kRivalsPerBlock);
      const int64_t rival_count = static_cast<int64_t>(ids.size());
      const auto& siblings = kids[node];
      for (const int64_t j : siblings) {
        ids.push_back(children_ptr[j]);
      }
      const int64_t count = static_cast<int64_t>(ids.size());
      for (const int64_t id : ids) {  // ask for every row now: they come from memory together, not one by one
        const char* w = reinterpret_cast<const char*>(weight_ptr + id * width);
        for (int64_t byte = 0; byte < width * static_cast<int64_t>(sizeof(T)); byte += 64) {
          __builtin_prefetch(w + byte);
        }
      }
      samples.clear();
      for (int64_t s = 0; s < k; ++s) {
        if (std::any_of(siblings.begin(), siblings.end(), [&](int64_t j) { return contested_ptr[s * edges + j]; })) {
          samples.push_back(s);
        }
      }
      const int64_t contesting = static_cast<int64_t>(samples.size());
      xs.resize(contesting * width);
      errors.resize(contesting);
      for (int64_t a = 0; a < contesting; ++a) {
        errors[a] = input_of(samples[a], node, xs.data() + a * width);
      }
      logits_of.resize(contesting * count);
      for (int64_t r = 0; r < count; ++r) {
        widen(weight_ptr + ids[r] * width, width, row.data());
        dots_of_rows(xs.data(), contesting, row.data(), width, logits_of.data() + r, count);
      }
      for (int64_t a = 0; a < contesting; ++a) {
        const int64_t s = samples[a];
        const float* sample_logits = logits_of.data() + a * count;
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t r = 0; r < count; ++r) {
          best = std::max(best, sample_logits[r] + bias_of(ids[r]));
        }
        const float floor = rounded<T>(best - errors[a]);  // may_win with one rounding
        for (size_t c = 0; c < siblings.size(); ++c) {
          const int64_t j = siblings[c];
          if (contested_ptr[s * edges + j]) {
            passes_ptr[s * edges + j] = rounded<T>(sample_logits[rival_count + c] + bias_of(ids[rival_count + c]) +
                                                   errors[a]) >= floor;
          }
        }
      }
    }
  });
  return passes;
}

// bool [K, N - 1]: `contested` where the child could be the sample's argmax (dropmatch.contested_children's
// test with rival_tokens' rivals, one rounding), False elsewhere.
//
// hidden [N, H], masks [K, N, H], rivals_from [N, V] (the undropped logits) and weight [V, H] in one dtype (fp32,
// bf16 or fp16), or rivals_from int64 [N, R] (each node's rivals, its undropped token first, ids in [0, V)),
// contiguous, on the CPU; undropped [N], children [N - 1] (the tree's tokens 1..N-1) and
// parents [N - 1] int64; contested bool [K, N - 1], the pairs to test; max_row_norm the largest |row| of
// weight; bias [V] in their dtype, or None.
at::Tensor contested_children(const at::Tensor& hidden, const at::Tensor& masks, const at::Tensor& rivals_from,
                              const at::Tensor& undropped, const at::Tensor& children, const at::Tensor& parents,
                              const at::Tensor& contested, const at::Tensor& weight, double max_row_norm,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(masks.dim() == 3 && hidden.dim() == 2 && rivals_from.dim() == 2 && weight.dim() == 2,
              "expected masks [K, N, H], hidden [N, H], logits [N, V] or rivals [N, R] and weight [V, H]");
  const int64_t k = masks.size(0), n = masks.size(1), width = masks.size(2);
  const bool given = rivals_given(rivals_from);
  TORCH_CHECK(n >= 1 && hidden.size(0) == n && hidden.size(1) == width && rivals_from.size(0) == n &&
                  weight.size(1) == width &&
                  (given ? rivals_from.size(1) >= 1 : rivals_from.size(1) <= weight.size(0)),
              "shapes do not fit: masks ", masks.sizes(), ", hidden ", hidden.sizes(), ", logits or rivals ",
              rivals_from.sizes(), ", weight ", weight.sizes());
  TORCH_CHECK(undropped.numel() == n && children.numel() == n - 1 && parents.numel() == n - 1 &&
                  contested.dim() == 2 && contested.size(0) == k && contested.size(1) == n - 1,
              "tree tensors do not fit ", n, " nodes and ", k, " samples");
  for (const at::Tensor* t : {&hidden, &masks, &rivals_from, &weight, &undropped, &children, &parents, &contested}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "expected contiguous CPU tensors");
  }
  TORCH_CHECK(masks.scalar_type() == hidden.scalar_type() && weight.scalar_type() == hidden.scalar_type() &&
                  (given || rivals_from.scalar_type() == hidden.scalar_type()),
              "hidden, masks, logits and weight must share one dtype");
  const int64_t vocab = vocab_of(rivals_from, weight);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == hidden.scalar_type() && bias->device().is_cpu() &&
                                    bias->is_contiguous() && bias->numel() >= vocab),
              "the bias must be a contiguous CPU tensor [V] of hidden's dtype");
  if (given) {  // every rival indexes a row of the weight
    const int64_t* ids = rivals_from.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(ids, ids + rivals_from.numel(), [vocab](int64_t id) { return id >= 0 && id < vocab; }),
                "rival ids must be in [0, ", vocab, ")");
  }
  TORCH_CHECK(undropped.scalar_type() == at::kLong && children.scalar_type() == at::kLong &&
                  parents.scalar_type() == at::kLong && contested.scalar_type() == at::kBool,
              "expected int64 token and parent ids and a bool contest");
  switch (hidden.scalar_type()) {
    case at::kFloat:
      return contest<float>(hidden, masks, rivals_from, undropped, children, parents, contested, weight, bias,
                            max_row_norm);
    case at::kBFloat16:
      return contest<c10::BFloat16>(hidden, masks, rivals_from, undropped, children, parents, contested, weight, bias,
                                    max_row_norm);
    case at::kHalf:
      return contest<c10::Half>(hidden, masks, rivals_from, undropped, children, parents, contested, weight, bias,
                                max_row_norm);
    default:
      TORCH_CHECK(false, "unsupported dtype ", hidden.scalar_type());
  }
}

// drops[i] = whether mask row i of `rows` rows of `width` multipliers drops something (holds a zero).
template <typename T>
void mark_drops(const T* masks, int64_t rows, int64_t width, std::vector<char>& drops) {
  for (int64_t i = 0; i < rows; ++i) {
    drops[i] = std::any_of(masks + i * width, masks + (i + 1) * width,
                           [](T v) { return static_cast<float>(v) == 0.0f; });
  }
}

// The (sample, node) pairs whose rows the match rule must score, as dropmatch.contested_samples selects them:
// (int64 [P] samples, int64 [P] nodes), sample-major. A child other than its parent's undropped token is
// contested by each sample of its parent (without `rescale`, each sample whose mask drops something); the
// contest keeps those it passes; a node may be reached through undropped tokens and passing children, and
// surely is through undropped tokens alone; a passing child counts only if some node of its own subtree that
// may be reached would end the path ahead of every node surely reached (acceptance.could_outrank: deeper, or
// as deep with a lower index). The pairs: a sample and a node that may be reached with a passing child that
// counts.
//
// tokens, parents and depths [N] int64 describe the tree (root first, depth-major: parents[0] = -1 and every
// other parent has a lower index); the rest as contested_children.
std::tuple<at::Tensor, at::Tensor> contested_samples(const at::Tensor& hidden, const at::Tensor& masks,
                                                     const at::Tensor& rivals_from, const at::Tensor& undropped,
                                                     const at::Tensor& tokens, const at::Tensor& parents,
                                                     const at::Tensor& depths, const at::Tensor& weight,
                                                     double max_row_norm, const std::optional<at::Tensor>& bias,
                                                     bool rescale) {
  TORCH_CHECK(masks.dim() == 3, "expected masks [K, N, H], got ", masks.sizes());
  const int64_t k = masks.size(0), n = masks.size(1), width = masks.size(2), edges = n - 1;
  for (const at::Tensor* t : {&undropped, &tokens, &parents, &depths}) {
    TORCH_CHECK(t->numel() == n && t->scalar_type() == at::kLong && t->device().is_cpu() && t->is_contiguous(),
                "tree tensors must be contiguous int64 CPU tensors of ", n, " nodes");
  }
  TORCH_CHECK(masks.device().is_cpu() && masks.is_contiguous(), "expected contiguous CPU tensors");
  TORCH_CHECK(rivals_from.dim() == 2 && rivals_from.size(0) == n && weight.dim() == 2,
              "shapes do not fit: logits or rivals ", rivals_from.sizes(), ", weight ", weight.sizes());
  const int64_t vocab = vocab_of(rivals_from, weight);
  const int64_t* token_ptr = tokens.data_ptr<int64_t>();
  const int64_t* parent_ptr = parents.data_ptr<int64_t>();
  const int64_t* depth_ptr = depths.data_ptr<int64_t>();
  const int64_t* undropped_ptr = undropped.data_ptr<int64_t>();
  TORCH_CHECK(n >= 1 && parent_ptr[0] == -1, "the root's parent must be -1");
  for (int64_t j = 1; j < n; ++j) {
    TORCH_CHECK(parent_ptr[j] >= 0 && parent_ptr[j] < j, "parent ", parent_ptr[j], " of node ", j,
                " out of range (nodes must be depth-major)");
    TORCH_CHECK(undropped_ptr[parent_ptr[j]] >= 0 && undropped_ptr[parent_ptr[j]] < vocab, "token ",
                undropped_ptr[parent_ptr[j]], " out of range");
  }
  auto none = at::empty({0}, tokens.options());
  // Which samples drop something (the mask has a zero), where that matters.
  std::vector<char> drops(k * n, 1);
  if (!rescale) {
    switch (masks.scalar_type()) {
      case at::kFloat:
        mark_drops(masks.data_ptr<float>(), k * n, width, drops);
        break;
      case at::kBFloat16:
        mark_drops(masks.data_ptr<c10::BFloat16>(), k * n, width, drops);
        break;
      case at::kHalf:
        mark_drops(masks.data_ptr<c10::Half>(), k * n, width, drops);
        break;
      default:
        TORCH_CHECK(false, "unsupported dtype ", masks.scalar_type());
    }
  }
  std::vector<char> other(n, 0);  // non-root nodes whose token is not their parent's undropped token
  auto contest = at::zeros({k, edges}, masks.options().dtype(at::kBool));
  bool* contest_ptr = contest.data_ptr<bool>();
  bool any = false;
  for (int64_t j = 1; j < n; ++j) {
    other[j] = token_ptr[j] != undropped_ptr[parent_ptr[j]];
    for (int64_t s = 0; other[j] && s < k; ++s) {
      contest_ptr[s * edges + j - 1] = drops[s * n + parent_ptr[j]];
      any = any || drops[s * n + parent_ptr[j]];
    }
  }
  if (!any) {
    return {none, none.clone()};
  }
  const at::Tensor passes = contested_children(hidden, masks, rivals_from, undropped, tokens.slice(0, 1),
                                               parents.slice(0, 1), contest, weight, max_row_norm, bias);
  const bool* pass_ptr = passes.data_ptr<bool>();
  // Reach (parents come before their children) and the rank the verifier's path ends by.
  std::vector<char> maybe(n, 1), sure(n, 1), outranks(n, 0);
  int64_t best_sure = 0;  // the root's rank
  for (int64_t j = 1; j < n; ++j) {
    bool passed = false;
    for (int64_t s = 0; s < k; ++s) passed = passed || pass_ptr[s * edges + j - 1];
    maybe[j] = maybe[parent_ptr[j]] && (!other[j] || passed);
    sure[j] = sure[parent_ptr[j]] && !other[j];
    if (sure[j]) best_sure = std::max(best_sure, depth_ptr[j] * (n + 1) - j);
  }
  for (int64_t j = n - 1; j >= 1; --j) {  // a node outranks where its subtree holds a maybe node ahead
    outranks[j] = outranks[j] || (maybe[j] && depth_ptr[j] * (n + 1) - j > best_sure);
    outranks[parent_ptr[j]] = outranks[parent_ptr[j]] || outranks[j];
  }
  std::vector<int64_t> samples, nodes;
  for (int64_t s = 0; s < k; ++s) {
    std::vector<char> flagged(n, 0);
    for (int64_t j = 1; j < n; ++j) {
      if (pass_ptr[s * edges + j - 1] && outranks[j]) flagged[parent_ptr[j]] = 1;
    }
    for (int64_t node = 0; node < n; ++node) {
      if (flagged[node] && maybe[node]) {
        samples.push_back(s);
        nodes.push_back(node);
      }
    }
  }
  const int64_t count = static_cast<int64_t>(samples.size());
  auto sample_ids = at::empty({count}, tokens.options()), node_ids = at::empty({count}, tokens.options());
  std::copy(samples.begin(), samples.end(), sample_ids.data_ptr<int64_t>());
  std::copy(nodes.begin(), nodes.end(), node_ids.data_ptr<int64_t>());
  return {sample_ids, node_ids};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("contested_children", &contested_children, pybind11::arg("hidden"), pybind11::arg("masks"),
             pybind11::arg("rivals_from"), pybind11::arg("undropped"), pybind11::arg("children"),
             pybind11::arg("parents"), pybind11::arg("contested"), pybind11::arg("weight"),
             pybind11::arg("max_row_norm"), pybind11::arg("bias") = pybind11::none(),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("contested_samples", &contested_samples, pybind11::arg("hidden"), pybind11::arg("masks"),
             pybind11::arg("rivals_from"), pybind11::arg("undropped"), pybind11::arg("tokens"),
             pybind11::arg("parents"), pybind11::arg("depths"), pybind11::arg("weight"),
             pybind11::arg("max_row_norm"), pybind11::arg("bias") = pybind11::none(),
             pybind11::arg("rescale") = false, pybind11::call_guard<pybind11::gil_scoped_release>());
}
