// Two small ops of every verification round on a CPU, each in one call instead of a few dozen tensor ops.
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

// x widened to fp32 (bf16 by a shift of its bits).
template <typename T>
inline float widened(T x) {
  return static_cast<float>(x);
}

template <>
inline float widened<c10::BFloat16>(c10::BFloat16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
}

// The index of the first maximum of row[0, v), or of its first NaN.
template <typename T>
int64_t row_first_argmax(const T* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = 0;
  bool nan = false;
  for (int64_t start = 0; start < v; start += kBlock) {
    const int64_t end = std::min(v, start + kBlock);
    float block = -std::numeric_limits<float>::infinity();
    bool block_nan = false;
#pragma omp simd reduction(max : block) reduction(|| : block_nan)
    for (int64_t i = start; i < end; ++i) {
      const float x = widened(row[i]);
      block = std::max(block, x);
      block_nan = block_nan || x != x;
    }
    nan = nan || block_nan;
    if (block > best) {  // the first block holding the maximum (-inf everywhere: block 0)
      best = block;
      best_block = start / kBlock;
    }
  }
  if (nan) {
    for (int64_t i = 0; i < v; ++i) {
      const float x = widened(row[i]);
      if (x != x) {
        return i;
      }
    }
  }
  for (int64_t i = best_block * kBlock; i < v; ++i) {
    if (widened(row[i]) == best) {
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("compact", &compact, pybind11::arg("tensors"), pybind11::arg("held"), pybind11::arg("nodes"));
  module.def("first_argmax", &first_argmax, pybind11::arg("logits"),
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
