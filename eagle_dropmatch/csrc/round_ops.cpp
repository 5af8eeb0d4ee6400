// Small ops of every verification round on a CPU, each in one call instead of a few or a few dozen tensor ops.
//
// compact: the KV cache's compaction, all layers at once. The Python reference is
// eagle_dropmatch.verify.compact_cache: each layer's keys and values keep the accepted tree entries right after
// its prefix and are cut there. In Python that is up to three tensor ops per tensor (index_select, a slice
// assignment, the cut), 60 to 180 ops a round for a 30-layer model: 0.14 ms a round that only cuts and about
// 0.5 ms a round that moves entries on a 2-core CPU. Here the entries are moved with memmove (their rows are
// contiguous) and each tensor is cut in place (its sizes set, its storage kept), so no new tensors are made.
//
// first_argmax: the index of each row's first maximum, as torch's max(dim=-1).indices gives it (the first
// NaN where a row holds one). The Python reference is eagle_dropmatch.acceptance.first_argmax, a two-level
// reduction of five tensor ops; here it is one pass of block maxima (bf16 widened by a shift of its bits,
// which the compiler vectorizes) and a look inside the first block that holds the row's maximum.
//
// accepted_path, accepted_length: the verifier, eagle_dropmatch.acceptance.longest_accepted_path and
// accepted_length: the deepest node whose token and every ancestor's token are in their parents' accepted sets
// (the lowest index among equally deep ones), found in one pass over a depth-major tree instead of eight ops
// on its [N, N] ancestor matrix.
//
// Built at first use by eagle_dropmatch.extensions.round_ops (torch.utils.cpp_extension), for the CPU's vector
// instructions; the engine runs the Python references where it cannot be built or a tensor is not on the CPU.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Moves entries held[i] + nodes[j] of tensors[i] ([B, heads, T, D], rows contiguous) to held[i] + j for every
// j, then cuts tensors[i] to held[i] + nodes.size() entries in place (as_strided_: the same storage and
// strides). Returns false, changing nothing, where some tensor is not on the CPU.
//
// nodes: strictly ascending tree indices (nodes[j] >= j), so an entry is written only after every entry read
// from its slot has moved: the moves can run in place in order. held: one prefix length per tensor.
bool compact(std::vector<at::Tensor> tensors, const std::vector<int64_t>& held, const std::vector<int64_t>& nodes) {
  TORCH_CHECK(held.size() == tensors.size(), "expected one prefix length per tensor, got ", held.size(), " for ",
              tensors.size(), " tensors");
  const int64_t m = static_cast<int64_t>(nodes.size());
  for (int64_t j = 0; j < m; ++j) {
    TORCH_CHECK(nodes[j] >= j && (j == 0 || nodes[j] > nodes[j - 1]), "nodes must be strictly ascending indices");
  }
  int64_t in_place = 0;  // the leading 0, 1, ... run stays where it is
  while (in_place < m && nodes[in_place] == in_place) {
    ++in_place;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {  // every check before anything changes
    const at::Tensor& t = tensors[i];
    if (!t.device().is_cpu()) {
      return false;
    }
    TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "expected [B, heads, T, D] tensors with contiguous rows, got ",
                t.sizes(), " with strides ", t.strides());
    const int64_t needed = m ? held[i] + nodes[m - 1] + 1 : held[i];  // entries read
    TORCH_CHECK(held[i] >= 0 && needed <= t.size(2), "entries out of range: prefix ", held[i], ", nodes up to ",
                m ? nodes[m - 1] : -1, ", length ", t.size(2));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor& t = tensors[i];
    const int64_t start = held[i];
    if (in_place < m) {
      const int64_t item = t.element_size(), row = t.size(3) * item;
      char* base = static_cast<char*>(t.data_ptr());
      for (int64_t b = 0; b < t.size(0); ++b) {
        for (int64_t h = 0; h < t.size(1); ++h) {
          char* head = base + (b * t.stride(0) + h * t.stride(1)) * item;
          for (int64_t j = in_place; j < m; ++j) {
            std::memmove(head + (start + j) * t.stride(2) * item, head + (start + nodes[j]) * t.stride(2) * item, row);
          }
        }
      }
    }
    t.as_strided_({t.size(0), t.size(1), start + m, t.size(3)}, t.strides(), t.storage_offset());
  }
  return true;
}

constexpr int64_t kBlock = 256;  // entries per block of first_argmax's first pass

// The largest of row[start, end) widened to fp32, ignoring NaNs, and whether a NaN is among them.
template <typename T>
inline float block_max(const T* row, int64_t start, int64_t end, bool& nan) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = start; i < end; ++i) {
    const float x = static_cast<float>(row[i]);
    nan = nan || x != x;
    best = x > best ? x : best;
  }
  return best;
}

// bf16: widened by a shift of its bits and a NaN found from the largest magnitude's bits, two reductions the
// compiler vectorizes.
template <>
inline float block_max<c10::BFloat16>(const c10::BFloat16* row, int64_t start, int64_t end, bool& nan) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  float best = -std::numeric_limits<float>::infinity();
  uint16_t magnitude = 0;
#pragma omp simd reduction(max : best, magnitude)
  for (int64_t i = start; i < end; ++i) {
    best = std::max(best, __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16));
    magnitude = std::max<uint16_t>(magnitude, bits[i] & 0x7fff);
  }
  nan = nan || magnitude > 0x7f80;  // exponent all ones, mantissa not 0
  return best;
}

// The index of the first maximum of row[0, v), or of its first NaN.
template <typename T>
int64_t row_first_argmax(const T* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = 0;
  bool nan = false;
  for (int64_t start = 0; start < v; start += kBlock) {
    const float block = block_max(row, start, std::min(v, start + kBlock), nan);
    if (block > best) {  // the first block holding the maximum (-inf everywhere: block 0)
      best = block;
      best_block = start / kBlock;
    }
  }
  if (nan) {
    for (int64_t i = 0; i < v; ++i) {
      const float x = static_cast<float>(row[i]);
      if (x != x) {
        return i;
      }
    }
  }
  for (int64_t i = best_block * kBlock; i < v; ++i) {
    if (static_cast<float>(row[i]) == best) {
      return i;
    }
  }
  return 0;  // not reached
}

// int64 [...]: the index of the first maximum of each row of logits [..., V] (fp32, bf16 or fp16, contiguous,
// on the CPU; V >= 1), or of its first NaN, as max(dim=-1).indices.
at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) >= 1 && logits.device().is_cpu() && logits.is_contiguous(),
              "expected contiguous CPU logits [..., V] with V >= 1, got ", logits.sizes());
  const int64_t v = logits.size(-1), rows = logits.numel() / v;
  auto out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kLong));
  int64_t* out_ptr = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "first_argmax", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        out_ptr[r] = row_first_argmax(data + r * v, v);
      }
    });
  });
  return out;
}

// The deepest accepted node of a depth-major tree (root first, parents[j] < j), the lowest index among equally
// deep ones, or -1 where the tree is not depth-major (the caller then runs the Python verifier). tokens,
// parents and depths: int64 [N]; accept_sets: int64 [N, S], any strides (row j: the tokens accepted as a
// child of node j).
int64_t deepest_accepted(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths,
                         const at::Tensor& accept_sets) {
  const int64_t n = tokens.numel();
  for (const at::Tensor* t : {&tokens, &parents, &depths}) {
    TORCH_CHECK(t->dim() == 1 && t->numel() == n && t->scalar_type() == at::kLong && t->device().is_cpu() &&
                    t->is_contiguous(),
                "expected contiguous int64 CPU tensors [N] for tokens, parents and depths");
  }
  TORCH_CHECK(n >= 1 && accept_sets.dim() == 2 && accept_sets.size(0) == n && accept_sets.scalar_type() == at::kLong &&
                  accept_sets.device().is_cpu(),
              "expected int64 CPU accept_sets [N, S] for ", n, " nodes, got ", accept_sets.sizes());
  const int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t* parent = parents.data_ptr<int64_t>();
  const int64_t* depth = depths.data_ptr<int64_t>();
  const int64_t* sets = accept_sets.data_ptr<int64_t>();
  const int64_t row_stride = accept_sets.stride(0), column_stride = accept_sets.stride(1), width = accept_sets.size(1);
  if (parent[0] != -1) {
    return -1;
  }
  std::vector<char> reached(n, 0);
  reached[0] = 1;
  int64_t best = 0;
  for (int64_t j = 1; j < n; ++j) {
    const int64_t p = parent[j];
    if (p < 0 || p >= j) {
      return -1;
    }
    if (!reached[p]) {
      continue;
    }
    const int64_t* set = sets + p * row_stride;
    for (int64_t s = 0; s < width; ++s) {
      if (set[s * column_stride] == token[j]) {
        reached[j] = 1;
        break;
      }
    }
    if (reached[j] && depth[j] > depth[best]) {
      best = j;
    }
  }
  return best;
}

// int64 [m + 1]: the root-first node indices of the longest accepted path (acceptance.longest_accepted_path), or
// an empty tensor where the tree is not depth-major.
at::Tensor accepted_path(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths,
                         const at::Tensor& accept_sets) {
  const int64_t best = deepest_accepted(tokens, parents, depths, accept_sets);
  if (best < 0) {
    return at::empty({0}, tokens.options());
  }
  const int64_t* parent = parents.data_ptr<int64_t>();
  std::vector<int64_t> path;
  for (int64_t node = best; node >= 0; node = parent[node]) {
    path.push_back(node);
  }
  auto out = at::empty({static_cast<int64_t>(path.size())}, tokens.options());
  std::copy(path.rbegin(), path.rend(), out.data_ptr<int64_t>());
  return out;
}

// int64 0-d: the length of that path, the root included (acceptance.accepted_length), or -1 where the tree is not
// depth-major.
at::Tensor accepted_length(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depths,
                           const at::Tensor& accept_sets) {
  const int64_t best = deepest_accepted(tokens, parents, depths, accept_sets);
  return at::scalar_tensor(best < 0 ? -1 : depths.data_ptr<int64_t>()[best] + 1, tokens.options());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("compact", &compact, pybind11::arg("tensors"), pybind11::arg("held"), pybind11::arg("nodes"));
  module.def("first_argmax", &first_argmax, pybind11::arg("logits"),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("accepted_path", &accepted_path, pybind11::arg("tokens"), pybind11::arg("parents"),
             pybind11::arg("depths"), pybind11::arg("accept_sets"));
  module.def("accepted_length", &accepted_length, pybind11::arg("tokens"), pybind11::arg("parents"),
             pybind11::arg("depths"), pybind11::arg("accept_sets"));
}
