// The KV cache's compaction after a verification round, all layers in one call.
//
// The Python reference is eagle_dropmatch.verify.compact_cache: each layer's keys and values keep the accepted
// tree entries right after its prefix and are cut there. In Python that is up to three tensor ops per tensor
// (index_select, a slice assignment, the cut), 60 to 180 ops a round for a 30-layer model: 0.14 ms a round that
// only cuts and about 0.5 ms a round that moves entries on a 2-core CPU. Here it is one call: the entries are
// moved with memmove (their rows are contiguous) and each tensor is cut in place (its sizes set, its storage
// kept), so no new tensors are made.
//
// Built at first use by eagle_dropmatch.verify.cache_extension (torch.utils.cpp_extension); the engine runs the
// Python reference where it cannot be built or a cache is not on the CPU.

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("compact", &compact, pybind11::arg("tensors"), pybind11::arg("held"), pybind11::arg("nodes"));
}
