// fbgemm's fp16-weight product on all of torch's intra-op threads.
//
// torch's own binding (torch.fbgemm_linear_fp16_weight) calls fbgemm::cblas_gemm_compute as thread 0 of 1,
// so on a CPU without native bf16 every packed layer of the engine ran on one core while the others waited.
// fbgemm's kernel splits the weight's column blocks between the threads it is told about, and each output is
// summed by one thread in the same order whatever the split, so running it as thread t of n on torch's
// OpenMP team gives torch's binding's output bit for bit, faster. The input is converted to fp32 and the
// output back to the input's dtype here, not by two more Python-level ops.
//
// Built at first use by eagle_dropmatch.cpu_linear.fp16_extension (torch.utils.cpp_extension); the engine
// falls back to torch's binding where it cannot be built.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <fbgemm/FbgemmFP16.h>

#include <algorithm>
#include <memory>
#include <optional>

namespace {

class PackedFP16Linear {
 public:
  // weight: [out, in], any float dtype; packed as fp16 as torch's fbgemm_pack_gemm_matrix_fp16 packs it
  // (values clamped to fp16's range first).
  explicit PackedFP16Linear(const at::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2, "weight must be [out, in], got ", weight.dim(), " dimensions");
    auto w = weight.detach().to(at::kFloat).contiguous().clamp(-65504.0, 65504.0);
    out_features_ = w.size(0);
    in_features_ = w.size(1);
    packed_ = std::make_unique<fbgemm::PackedGemmMatrixFP16>(
        fbgemm::matrix_op_t::Transpose, in_features_, out_features_, 1.0f, w.data_ptr<float>());
  }

  // x: [..., in] -> [..., out] in x's dtype: (x in fp32) @ weight^T (+ bias), summed in fp32.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features_, "expected inputs of width ", in_features_,
                ", got ", x.sizes());
    const auto a = x.reshape({-1, in_features_}).to(at::kFloat).contiguous();  // [M, in]
    const int m = static_cast<int>(a.size(0));
    auto c = at::empty({a.size(0), out_features_}, a.options());  // [M, out]
    const float* a_ptr = a.data_ptr<float>();
    float* c_ptr = c.data_ptr<float>();
    const auto& b = *packed_;
    if (m > 0) {
      const int threads = std::max(1, at::get_num_threads());
      at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, m, a_ptr, b, 0.0f, c_ptr,
                                     static_cast<int>(t), threads);
        }
      });
    }
    if (bias.has_value()) {
      c.add_(bias->to(at::kFloat));
    }
    auto sizes = x.sizes().vec();
    sizes.back() = out_features_;
    return c.to(x.scalar_type()).view(sizes);
  }

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

 private:
  std::unique_ptr<fbgemm::PackedGemmMatrixFP16> packed_;
  int64_t in_features_ = 0;
  int64_t out_features_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<PackedFP16Linear>(module, "PackedFP16Linear")
      .def(pybind11::init<const at::Tensor&>(), pybind11::arg("weight"))
      .def("forward", &PackedFP16Linear::forward, pybind11::arg("x"), pybind11::arg("bias") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("in_features", &PackedFP16Linear::in_features)
      .def_property_readonly("out_features", &PackedFP16Linear::out_features);
}
