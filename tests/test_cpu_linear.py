"""Linear layers on weights packed once (``cpu_linear``): oneDNN's bf16 packing gives the stock layers' outputs
bit for bit; fbgemm's fp16 packing (CPUs without native bf16) gives the fp32 product of the bf16 weights."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from eagle_dropmatch import cpu_linear
from eagle_dropmatch.cpu_linear import (PrepackedLinear, fbgemm_fp16_works, fp16_exact, onednn_packs_bf16,
                                        packed_matches, prepack_linears, prepack_wanted)
from eagle_dropmatch.loading import LoadError, default_tree, load

from conftest import tiny_target

onednn = pytest.mark.skipif(not onednn_packs_bf16(),
                            reason="oneDNN does not pack bf16 weights on this CPU (it needs AVX512 or AVX-NE-CONVERT)")
fp16 = pytest.mark.skipif(not fbgemm_fp16_works(), reason="this torch build or CPU lacks fbgemm's fp16 linear ops")


def can_build_extensions() -> bool:
    import shutil
    from torch.utils.cpp_extension import is_ninja_available
    return shutil.which("c++") is not None and is_ninja_available()


bf16 = pytest.mark.skipif(not (cpu_linear.bf16_build() and can_build_extensions()),
                          reason="the bf16 kernel needs AVX512-BF16 and AVX512-VNNI or AVX2 as the CPU's best vector "
                                 "code, a C++ compiler and ninja")
avx2 = pytest.mark.skipif(not (cpu_linear.avx2_cpu() and can_build_extensions()),
                          reason="the bf16 kernel's AVX2 build needs AVX2, FMA, a C++ compiler and ninja")
SCREEN_BUILDS = ["avx512", "avx2"]


def screen_module(build: str):
    """The compiled module of one build of the bf16 kernel and its int8 screen, or a skip where this CPU does not
    run it: "avx512" where the CPU has AVX512-BF16 and AVX512-VNNI, "avx2" on any AVX2 CPU (an AVX512 one too,
    so that both builds are tested on a CPU that runs both)."""
    if not can_build_extensions():
        pytest.skip("building the bf16 kernel needs a C++ compiler and ninja")
    if build == "avx2":
        if not cpu_linear.avx2_cpu():
            pytest.skip("the bf16 kernel's AVX2 build needs AVX2 and FMA")
        return cpu_linear.bf16_avx2_extension()
    if cpu_linear.bf16_build() != "avx512":
        pytest.skip("the bf16 kernel's AVX512 build needs AVX512-BF16 and AVX512-VNNI")
    return cpu_linear.bf16_extension()
KERNELS = [pytest.param("onednn", marks=onednn), pytest.param("fp16", marks=fp16), pytest.param("bf16", marks=bf16)]


def bf16_linear(inputs: int, outputs: int, bias: bool, seed: int = 0, fp16_values: bool = True) -> nn.Linear:
    """A random bf16 layer; with ``fp16_values`` its weights are all fp16 values too (as SmolLM2's are), so every
    kernel packs it ("bf16" packs any bf16 weight as it is)."""
    torch.manual_seed(seed)
    linear = nn.Linear(inputs, outputs, bias=bias)
    if fp16_values:
        with torch.no_grad():
            linear.weight.copy_(linear.weight.half().float())
    return linear.to(torch.bfloat16).eval()


SHAPES = [(64, 96, False), (64, 96, True), (576, 1536, False), (96, 7, True)]
ROWS = [(1,), (8,), (29,), (2, 5)]


@onednn
@pytest.mark.parametrize("inputs,outputs,bias", SHAPES)
@pytest.mark.parametrize("shape", ROWS)
def test_a_prepacked_linear_gives_the_stock_output_bit_for_bit(inputs, outputs, bias, shape):
    linear = bf16_linear(inputs, outputs, bias)
    packed = PrepackedLinear(linear, "onednn")
    x = torch.randn(*shape, inputs, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(x)
        assert out.shape == (*shape, outputs) and out.dtype == torch.bfloat16
        assert torch.equal(out, F.linear(x, linear.weight, linear.bias))


@fp16
@pytest.mark.parametrize("inputs,outputs,bias", SHAPES)
@pytest.mark.parametrize("shape", [*ROWS, ()])
def test_an_fp16_packed_linear_gives_the_fp32_product_of_the_bf16_weights(inputs, outputs, bias, shape):
    """Every product is exact in fp32 (bf16 x bf16 values), so the output is the fp32 sum rounded once to bf16,
    up to the order of the sums: equal to that rounding almost everywhere, never off by more than a step."""
    linear = bf16_linear(inputs, outputs, bias)
    packed = PrepackedLinear(linear, "fp16")
    x = torch.randn(*shape, inputs, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(x)
        bias32 = None if bias is False else linear.bias.float()
        exact = F.linear(x.float(), linear.weight.float(), bias32)  # [*shape, out]
    assert out.shape == (*shape, outputs) and out.dtype == torch.bfloat16
    rounded = exact.to(torch.bfloat16)
    assert (out == rounded).float().mean() >= 0.99
    assert bool(((out.float() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-6).all())
    assert packed_matches(linear, packed)
    wrong = PrepackedLinear(bf16_linear(inputs, outputs, bias, seed=1), "fp16")
    assert not packed_matches(linear, wrong)  # the check can fail: another weight is caught


@fp16
def test_the_fp16_extension_builds_where_a_compiler_and_ninja_exist():
    if not can_build_extensions():
        pytest.skip("no C++ compiler or no ninja here: the fp16 layers fall back to torch's binding")
    module = cpu_linear.fp16_extension()
    assert module is not None and cpu_linear.extension_matches_binding(module)
    assert PrepackedLinear(bf16_linear(64, 96, False), "fp16").threaded
    assert not PrepackedLinear(bf16_linear(64, 96, False), "fp16", threads=False).threaded


@fp16
@pytest.mark.parametrize("inputs,outputs,bias", [*SHAPES, (1152, 576, False), (576, 4100, True)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_threaded_fp16_layer_gives_torchs_binding_bit_for_bit(inputs, outputs, bias, threads):
    """Any thread count, any row count (fbgemm's blocks of 6 rows and a remainder), widths that are not a
    multiple of fbgemm's column block (its last thread takes the fringe), with and without a bias."""
    if cpu_linear.fp16_extension() is None:
        pytest.skip("the fp16 extension could not be built here")
    linear = bf16_linear(inputs, outputs, bias)
    threaded, binding = PrepackedLinear(linear, "fp16"), PrepackedLinear(linear, "fp16", threads=False)
    assert threaded.threaded and not binding.threaded
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for shape in [*ROWS, (6,), (7,), ()]:
                x = torch.randn(*shape, inputs, generator=torch.Generator().manual_seed(len(shape) + 3)).to(torch.bfloat16)
                out = threaded(x)
                assert out.shape == (*shape, outputs) and out.dtype == torch.bfloat16
                assert torch.equal(out, binding(x)), shape
    finally:
        torch.set_num_threads(saved)


@fp16
def test_threaded_layers_counts_the_layers_on_the_extension():
    if cpu_linear.fp16_extension() is None:
        pytest.skip("the fp16 extension could not be built here")
    target = fp16_valued(tiny_target())
    total = prepack_linears(target, "fp16")
    assert cpu_linear.threaded_layers(target, None) == total > 0
    other = fp16_valued(tiny_target())
    assert cpu_linear.threaded_layers(other) == 0  # stock layers
    prepack_linears(other, "fp16", threads=False)
    assert cpu_linear.threaded_layers(other) == 0 and cpu_linear.threaded_layers(target, other) == total


class OffByOne:
    """A stand-in extension module whose layer adds 1 to every output."""

    class PackedFP16Linear:
        def __init__(self, weight):
            self.packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight)
            self.zeros = torch.zeros(weight.shape[0])

        def forward(self, x, bias=None):
            return torch.fbgemm_linear_fp16_weight(x, self.packed, self.zeros if bias is None else bias) + 1


@fp16
def test_an_extension_whose_output_differs_is_not_used(monkeypatch, fresh_extension_probes, capsys):
    assert not cpu_linear.extension_matches_binding(OffByOne)
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: OffByOne)
    assert cpu_linear.fp16_extension() is None
    assert "differs from torch's binding" in capsys.readouterr().err


@fp16
def test_without_the_extension_fp16_layers_run_on_torchs_binding(monkeypatch, fresh_extension_probes, capsys,
                                                                 tmp_path):
    """Switched off by the environment, or failing to build (a line saying it builds, then one saying why it
    is unavailable): the layer is packed for torch's binding and computes the same product."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("EAGLE_DROPMATCH_CACHE", str(tmp_path))  # nothing built there yet

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\n(more lines)")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    assert cpu_linear.fp16_extension() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "building the multi-threaded fp16 kernel" in err[0]
    assert ("unavailable (Ninja is required to load C++ extensions); fp16 layers use torch's one-thread "
            "binding, and --cpu-prepack auto packs for oneDNN where this CPU has native bf16") in err[1]
    cpu_linear.fp16_extension.cache_clear()
    monkeypatch.setenv("EAGLE_DROPMATCH_FP16_EXTENSION", "0")
    assert cpu_linear.fp16_extension() is None and capsys.readouterr().err == ""
    linear = bf16_linear(64, 96, True)
    packed = PrepackedLinear(linear, "fp16")
    assert not packed.threaded and "threaded" not in repr(packed)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = torch.fbgemm_linear_fp16_weight(x.float(), torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(
            linear.weight.float()), linear.bias.float()).to(torch.bfloat16)
        assert torch.equal(packed(x), expected)


@bf16
@pytest.mark.parametrize("inputs,outputs,bias", [*SHAPES, (33, 40, True), (1152, 960, False), (5, 3, False)])
@pytest.mark.parametrize("shape", [*ROWS, (6,), ()])
def test_a_bf16_packed_linear_gives_the_fp32_product_of_its_own_weights(inputs, outputs, bias, shape):
    """Every product of two bf16 values is exact in fp32, so the output is the fp32 sum rounded once to bf16, up
    to the order of the sums (odd widths: the packing pads a zero pair; outputs not a multiple of 16: the last
    block is stored under a mask)."""
    linear = bf16_linear(inputs, outputs, bias, fp16_values=False)
    packed = PrepackedLinear(linear, "bf16")
    assert packed.threaded and "kernel=bf16, threaded" in repr(packed)
    x = torch.randn(*shape, inputs, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(x)
        exact = F.linear(x.float(), linear.weight.float(), None if bias is False else linear.bias.float())
    assert out.shape == (*shape, outputs) and out.dtype == torch.bfloat16
    assert (out == exact.to(torch.bfloat16)).float().mean() >= 0.99
    assert cpu_linear.within_summation_bound(out, x, linear.weight.float(), linear.bias)
    assert packed_matches(linear, packed)
    wrong = PrepackedLinear(bf16_linear(inputs, outputs, bias, seed=1, fp16_values=False), "bf16")
    assert not packed_matches(linear, wrong)  # the check can fail: another weight is caught


@bf16
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_bf16_layers_row_does_not_depend_on_the_rows_beside_it_or_the_thread_count(threads):
    """Each output is summed by one lane in input order, so a row alone on one thread (plain decoding's step)
    gives bit for bit what it gives among 1-13 rows (a tree) on any number of threads."""
    linear = bf16_linear(576, 1000, True, fp16_values=False)
    packed = PrepackedLinear(linear, "bf16")
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            alone = torch.cat([packed(row[None]) for row in x])
            torch.set_num_threads(threads)
            for rows in (1, 2, 4, 5, 8, 13):
                assert torch.equal(packed(x[:rows]), alone[:rows]), rows
            shifted = torch.cat([x.new_zeros(1), x.flatten()])[1:].view_as(x)  # starts 2 bytes into its storage
            assert shifted.is_contiguous() and torch.equal(packed(shifted), alone)
    finally:
        torch.set_num_threads(saved)


class OffBF16:
    """A stand-in bf16 extension module whose layer adds 1 to every output, or (``batched``) only when given
    more than one row."""

    def __init__(self, batched: bool = False):
        outer = self

        class PackedBF16Linear:
            def __init__(self, weight):
                self.weight = weight

            def forward(self, x, bias=None):
                out = F.linear(x.float(), self.weight.float(), None if bias is None else bias.float())
                off = not outer.batched or x.reshape(-1, x.shape[-1]).shape[0] > 1
                return (out + 1 if off else out).to(torch.bfloat16)

        self.batched, self.PackedBF16Linear = batched, PackedBF16Linear


def test_a_bf16_extension_is_checked_against_the_fp32_product_and_row_by_row():
    assert not cpu_linear.bf16_extension_matches(OffBF16())
    assert not cpu_linear.bf16_extension_matches(OffBF16(batched=True))  # rows depend on their neighbours


@bf16
def test_the_bf16_extension_builds_and_passes_its_check_where_the_cpu_has_avx512_bf16_or_avx2():
    module = cpu_linear.bf16_extension()
    assert module is not None and cpu_linear.bf16_extension_matches(module)
    assert cpu_linear.bf16_screen(module)  # both builds have the int8 screen


def test_without_avx512_bf16_or_avx2_there_is_no_bf16_kernel(monkeypatch, fresh_extension_probes):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert cpu_linear.bf16_extension() is None and not cpu_linear.kernel_available("bf16")
    with pytest.raises(ValueError, match="kernel bf16 needs AVX512-BF16 or AVX2"):
        PrepackedLinear(bf16_linear(8, 8, False, fp16_values=False), "bf16")
    with pytest.raises(ValueError, match="cpu-prepack bf16 needs AVX512-BF16 or AVX2 and the compiled bf16 kernel"):
        cpu_linear.kernel_for("bf16", torch.bfloat16, "cpu")


def test_an_avx512_cpu_without_bf16_keeps_fbgemm(monkeypatch, fresh_extension_probes):
    """The AVX2 build serves CPUs whose best vector code is AVX2; it was not measured against fbgemm's AVX512
    code, so an AVX512 CPU without bf16 gets no bf16 kernel from ``bf16_extension``."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    built = []
    monkeypatch.setattr(cpu_linear, "bf16_avx2_extension", lambda: built.append(1) or object())
    assert cpu_linear.bf16_extension() is None and not built
    cpu_linear.bf16_extension.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_linear.bf16_extension() is not None and built


@avx2
@pytest.mark.parametrize("inputs,outputs,bias", [(576, 1536, False), (1536, 576, True), (33, 40, True), (5, 3, False),
                                                 (97, 300, False)])
def test_the_avx2_build_gives_the_fp32_product_with_each_row_as_it_is_alone(inputs, outputs, bias):
    """``csrc/bf16_linear_avx2.cpp`` on any AVX2 CPU (an AVX512 one too): the fp32 product of the bf16 weights
    and inputs up to the order of the sums, a row's output the same bit for bit whatever rows are beside it
    (groups of 6 rows, tiles of 1-4 blocks of 16 columns, a partial last block) and on 1 or 2 threads; a row
    holding NaN or infinity gives what the fp32 product gives there."""
    module = cpu_linear.bf16_avx2_extension()
    assert module is not None and cpu_linear.bf16_extension_matches(module) and cpu_linear.bf16_screen(module)
    linear = bf16_linear(inputs, outputs, bias, fp16_values=False)
    packed = module.PackedBF16Linear(linear.weight)
    x = torch.randn(14, inputs, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[13, 0] = float("nan")
    x[12, -1] = float("inf")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            alone = torch.cat([packed.forward(row[None], linear.bias) for row in x])
            exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
            assert cpu_linear.within_summation_bound(alone[:12], x[:12], linear.weight.float(), linear.bias)
            assert torch.equal(alone[12:].float().isnan(), exact[12:].to(torch.bfloat16).float().isnan())
            assert torch.equal(alone[12:].float().isinf(), exact[12:].to(torch.bfloat16).float().isinf())
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 14):
                    assert torch.equal(packed.forward(x[:rows], linear.bias).view(-1).view(torch.int16),
                                       alone[:rows].view(-1).view(torch.int16)), (threads, rows)
    finally:
        torch.set_num_threads(saved)


@avx2
def test_on_a_cpu_whose_best_code_is_avx2_the_bf16_kernel_is_the_avx2_build_screening_up_to_four_rows(
        monkeypatch, fresh_extension_probes):
    """Where torch runs AVX2 code at best (no AVX512-BF16), ``bf16_extension`` is the AVX2 build, "bf16" layers
    run on it, and its screen serves up to ``screen_max_rows`` (4) rows, the rows of one pass over its int8
    copy; ``screened_argmax`` says there is no screen for more (decoding then scores them in full, faster)."""
    from eagle_dropmatch.acceptance import first_argmax
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_linear.bf16_extension() is cpu_linear.bf16_avx2_extension() is not None
    assert cpu_linear.bf16_extension().PackedBF16Linear.screen_max_rows == 4
    linear = bf16_linear(64, 300, False, fp16_values=False)
    packed = PrepackedLinear(linear, "bf16")
    x = torch.randn(5, 64).to(torch.bfloat16)
    norm = float(torch.linalg.vector_norm(linear.weight.detach().float(), dim=-1).max())
    with torch.no_grad():
        assert cpu_linear.within_summation_bound(packed(x), x, linear.weight.float(), None)
        assert cpu_linear.screen_works()
        assert torch.equal(packed.screened_argmax(x[:4], norm), first_argmax(packed(x[:4])))
        assert packed.screened_argmax(x, norm) is None and packed.screened_argmax_rivals(x, norm, 4) is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_prepacked_linear_off_its_path_runs_the_stock_layer(kernel):
    converted = PrepackedLinear(bf16_linear(32, 16, True), kernel).float()  # e.g. model.float() after loading
    x32 = torch.randn(3, 32)
    assert torch.equal(converted(x32), F.linear(x32, converted.weight, converted.bias))
    linear = bf16_linear(32, 16, True)
    packed = PrepackedLinear(linear, kernel)
    x = torch.randn(3, 32).to(torch.bfloat16).requires_grad_()
    packed(x).float().sum().backward()  # with gradients it is F.linear, so they flow to input and weight
    reference = x.detach().clone().requires_grad_()
    F.linear(reference, linear.weight.detach(), linear.bias.detach()).float().sum().backward()
    assert torch.equal(x.grad, reference.grad) and linear.weight.grad is not None


def packed_now(linear: nn.Linear, kernel: str) -> PrepackedLinear:
    """The layer packed anew from a copy of its current parameters."""
    copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None).to(torch.bfloat16)
    copy.load_state_dict(linear.state_dict())
    return PrepackedLinear(copy.requires_grad_(False), kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_weight_changed_after_packing_is_packed_again(kernel):
    linear = bf16_linear(48, 40, True)
    packed = PrepackedLinear(linear, kernel)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        before = packed(x)
        linear.weight.mul_(-2)  # in place: the version counter moves
        assert torch.equal(packed(x), packed_now(linear, kernel)(x)) and not torch.equal(packed(x), before)
        linear.weight.data = torch.randn(40, 48).half().to(torch.bfloat16)  # a new storage
        assert torch.equal(packed(x), packed_now(linear, kernel)(x))
        linear.bias.add_(1)  # the bias is read at every call
        assert torch.equal(packed(x), packed_now(linear, kernel)(x))
    assert packed_matches(linear, packed)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_prepacked_linear_survives_a_deep_copy_and_a_pickle(tmp_path, kernel):
    import copy
    packed = PrepackedLinear(bf16_linear(48, 40, False), kernel)
    x = torch.randn(3, 48).to(torch.bfloat16)
    torch.save(packed, tmp_path / "layer.pt")
    with torch.no_grad():
        for other in (copy.deepcopy(packed), torch.load(tmp_path / "layer.pt", weights_only=False)):
            assert other.weight is not packed.weight and torch.equal(other(x), packed(x))


def fp16_valued(model: nn.Module) -> nn.Module:
    """The model with every parameter rounded through fp16, in bf16 (SmolLM2's weights are all fp16 values;
    a random init's smallest are not)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("kernel", KERNELS)
def test_prepacking_a_target_keeps_its_parameters_tied_and_named(kernel):
    target = tiny_target()
    target.config.tie_word_embeddings = True
    target.lm_head.weight = target.model.embed_tokens.weight
    target = fp16_valued(target)
    keys = sorted(target.state_dict())
    stock = sum(type(m) is nn.Linear for m in target.modules())
    assert prepack_linears(target, kernel) == stock > 0
    assert not any(type(m) is nn.Linear for m in target.modules())
    assert {m.kernel for m in target.modules() if type(m) is PrepackedLinear} == {kernel}
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert sorted(target.state_dict()) == keys


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_shape_whose_packed_output_differs_keeps_its_stock_layers(monkeypatch, kernel):
    target = fp16_valued(tiny_target())
    mlp = target.model.layers[0].mlp
    gate_shape = (mlp.gate_proj.in_features, mlp.gate_proj.out_features)
    monkeypatch.setattr(cpu_linear, "packed_matches",
                        lambda linear, packed: (linear.in_features, linear.out_features) != gate_shape)
    swapped = prepack_linears(target, kernel)
    kinds = {name: type(m) for name, m in target.named_modules() if name.endswith(("gate_proj", "up_proj", "q_proj"))}
    assert all(kind is nn.Linear for name, kind in kinds.items() if not name.endswith("q_proj"))
    assert all(kind is PrepackedLinear for name, kind in kinds.items() if name.endswith("q_proj"))
    assert swapped == sum(type(m) is PrepackedLinear for m in target.modules()) > 0


@fp16
@pytest.mark.parametrize("onednn_here", [False, pytest.param(True, marks=onednn)])
def test_fp16_packing_leaves_a_target_weight_that_is_not_all_fp16_values_to_onednn_or_stock(onednn_here,
                                                                                          monkeypatch):
    """A target computes with its own weights: a layer with a value fp16 cannot hold (here one below fp16's
    normal range, which loses bits as a subnormal) packs with oneDNN where oneDNN packs bf16 (the stock
    outputs) and stays stock elsewhere, unless ``exact=False`` (drafters)."""
    monkeypatch.setattr(cpu_linear, "onednn_packs_bf16", lambda: onednn_here)
    target = fp16_valued(tiny_target())
    with torch.no_grad():
        target.model.layers[0].mlp.up_proj.weight[0, 0] = 3.3e-6
    assert fp16_exact(target.model.layers[1].mlp.up_proj.weight)
    assert not fp16_exact(target.model.layers[0].mlp.up_proj.weight)
    stock = sum(type(m) is nn.Linear for m in target.modules())
    odd = lambda: target.model.layers[0].mlp.up_proj  # noqa: E731
    if onednn_here:
        assert prepack_linears(target, "fp16") == stock and odd().kernel == "onednn"
        assert {m.kernel for m in target.modules() if type(m) is PrepackedLinear} == {"onednn", "fp16"}
        x = torch.randn(3, odd().in_features).to(torch.bfloat16)
        assert torch.equal(odd()(x), F.linear(x, odd().weight))  # oneDNN: the stock output
    else:
        assert prepack_linears(target, "fp16") == stock - 1 and type(odd()) is nn.Linear
        assert prepack_linears(target, "fp16", exact=False) == 1
        assert type(odd()) is PrepackedLinear and odd().kernel == "fp16"


def test_prepack_wanted_by_mode(monkeypatch):
    for kernel in cpu_linear.KERNELS:  # auto packs with whichever kernel the CPU has
        monkeypatch.setattr(cpu_linear, "packing_kernel", lambda: kernel)
        assert not prepack_wanted("off", torch.bfloat16, "cpu")
        assert prepack_wanted("auto", torch.bfloat16, "cpu") and prepack_wanted("on", torch.bfloat16, "cpu")
        assert not prepack_wanted("auto", torch.float32, "cpu") and not prepack_wanted("auto", torch.bfloat16, "cuda")
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cuda"), (torch.bfloat16, "auto")):
        with pytest.raises(ValueError, match="cpu-prepack on packs bf16 weights on the CPU"):
            prepack_wanted("on", dtype, device)
    with pytest.raises(ValueError, match="cpu-prepack must be one of auto, on, off, onednn, fp16, bf16"):
        prepack_wanted("always", torch.bfloat16, "cpu")
    from eagle_dropmatch import gen
    choices = next(a.choices for a in gen.build_parser()._actions if a.dest == "cpu_prepack")
    assert tuple(choices) == cpu_linear.PREPACK_MODES  # gen spells them out so that parsing imports no torch
    monkeypatch.setattr(cpu_linear, "packing_kernel", lambda: None)
    assert not prepack_wanted("auto", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="lacks"):
        prepack_wanted("on", torch.bfloat16, "cpu")


def test_the_kernel_probe_says_what_this_cpu_packs():
    """Each probe answers without raising, and the kernel auto picks is one this CPU runs."""
    kernel = cpu_linear.packing_kernel()
    assert kernel in (*cpu_linear.KERNELS, None)
    assert (kernel is None) == (not onednn_packs_bf16() and not fbgemm_fp16_works()
                                and cpu_linear.bf16_extension() is None)
    assert kernel is None or cpu_linear.kernel_available(kernel)


@pytest.mark.parametrize("amx,avx512_bf16,onednn_packs,bf16_ext,extension,fbgemm,expected", [
    (True, True, True, True, True, True, "onednn"),       # AMX tiles: oneDNN
    (False, True, True, True, True, True, "bf16"),        # AVX512-BF16 without AMX (Zen 4), our bf16 kernel built
    (False, True, True, False, True, True, "fp16"),       # ... without it, the compiled fp16 kernel: fbgemm
    (False, True, True, False, False, True, "onednn"),    # ... without either (fbgemm on one thread): oneDNN
    (False, False, False, True, True, True, "bf16"),      # AVX2 only, the AVX2 build of our bf16 kernel built
    (False, False, False, False, True, True, "fp16"),     # AVX2 only, without it: fbgemm
    (False, False, False, False, False, True, "fp16"),    # ... even on one thread
    (False, True, True, False, True, False, "onednn"),    # a torch without fbgemm
    (False, True, False, True, False, False, "bf16"),     # ... nor oneDNN's bf16 packing, but our kernel
    (False, False, False, False, False, False, None),     # nothing packs
])
def test_auto_picks_the_kernel_by_what_the_cpu_has(amx, avx512_bf16, onednn_packs, bf16_ext, extension, fbgemm,
                                                   expected, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(cpu_linear, "onednn_packs_bf16", lambda: onednn_packs)
    monkeypatch.setattr(cpu_linear, "bf16_extension", lambda: object() if bf16_ext else None)
    monkeypatch.setattr(cpu_linear, "fp16_extension", lambda: object() if extension else None)
    monkeypatch.setattr(cpu_linear, "fbgemm_fp16_works", lambda: fbgemm)
    cpu_linear.packing_kernel.cache_clear()
    try:
        assert cpu_linear.packing_kernel() == expected
        assert cpu_linear.kernel_for("auto", torch.bfloat16, "cpu") == expected
    finally:
        cpu_linear.packing_kernel.cache_clear()  # the next caller probes this machine again


@pytest.mark.parametrize("kernel", cpu_linear.KERNELS)
def test_a_named_kernel_packs_with_that_kernel_or_says_in_one_line_why_not(kernel, monkeypatch):
    for available in (True, False):
        monkeypatch.setattr(cpu_linear, "kernel_available", lambda name: available and name == kernel)
        if available:
            assert cpu_linear.kernel_for(kernel, torch.bfloat16, "cpu") == kernel
        else:
            with pytest.raises(ValueError, match=f"cpu-prepack {kernel} needs .* which this CPU or torch build lacks"):
                cpu_linear.kernel_for(kernel, torch.bfloat16, "cpu")
        for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cuda")):
            with pytest.raises(ValueError, match=f"cpu-prepack {kernel} packs bf16 weights on the CPU"):
                cpu_linear.kernel_for(kernel, dtype, device)


@pytest.fixture
def fp16_model_dir(tiny_model_dir, tmp_path):
    """``tiny_model_dir``'s target with its weights rounded to fp16 values (so "fp16" packs every layer)."""
    import shutil
    from transformers import AutoModelForCausalLM
    shutil.copytree(tiny_model_dir / "target", tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir / "target"))
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.half().float())
    target.save_pretrained(str(tmp_path / "target"))
    shutil.copytree(tiny_model_dir / "head", tmp_path / "head")
    return tmp_path


@onednn
def test_a_onednn_packed_model_decodes_the_same_tokens(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cpu_linear, "packing_kernel", lambda: "onednn")
    d = tiny_model_dir
    packed = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="on")
    stock = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="off")
    assert packed.prepacked == sum(type(m) is PrepackedLinear for m in (*packed.target.modules(), *packed.head.modules()))
    assert packed.prepacked > 0 and stock.prepacked == 0
    assert type(stock.target.lm_head) is nn.Linear
    prompt = packed.chat_ids([{"role": "user", "content": "Say something long."}])
    tree = default_tree("onednn")._asdict()  # packed and stock layers default to other trees: compare one
    for settings in ({"baseline": True}, tree, {"dropmatch_k": 5, "dropout_p": 0.3, **tree},
                     {"temperature": 0.8, "seed": 3, **tree}):
        a, b = packed.generate(prompt, max_new_tokens=24, **settings), stock.generate(prompt, max_new_tokens=24, **settings)
        assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths, settings
    other = packed.with_head(d / "head")
    assert other.prepacked > packed.prepacked and type(other.head.lm_head) is PrepackedLinear


def assert_same_tokens_up_to_a_near_tie(judge, prompt, ours, theirs) -> None:
    """Two greedy turns of ``prompt`` in bf16 whose forwards round differently (a tree forward against a one-token
    forward, or two kernels) have the same tokens up to the first where they differ, if any, and there the
    ``judge`` model's logits tie the two tokens within a few bf16 rounding steps: only a near-tie may flip (and
    the flipped token then makes the rest of the answer another one)."""
    a, b = ours.token_ids, theirs.token_ids
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None:
        assert len(a) == len(b) and ours.stop_reason == theirs.stop_reason, (a, b)
        return
    with torch.no_grad():
        logits = judge.target(torch.cat([prompt, torch.tensor(a[:first])])[None]).logits[0, -1].float()
    top = float(logits.max())
    tol = 2 ** -5 * max(1.0, abs(top))  # a few bf16 rounding steps at the logits' scale
    assert float(logits[a[first]]) >= top - tol and float(logits[b[first]]) >= top - tol, \
        (first, a[first], b[first], logits.topk(3))


def assert_decodes_as_the_engine_promises(packed, stock) -> None:
    """The packed target's hidden states are the stock bf16 model's up to rounding; DropMatch at p = 0 is
    lossless EAGLE-3 bit for bit on the packed layers (tokens and rounds, with the head's trees and with trees
    whose drafts are mostly accepted); EAGLE-3's tokens are plain decoding's on the same layers up to a near-tie
    (a tree forward rounds otherwise than a one-token forward in bf16); sampling runs on them."""
    from eagle_dropmatch.dropmatch import DropMatchConfig
    from eagle_dropmatch.generate import DecodeConfig
    from conftest import OracleDrafter
    prompt = packed.chat_ids([{"role": "user", "content": "Say something long."}])
    with torch.no_grad():
        ours, theirs = (m.target.model(prompt[None]).last_hidden_state.float() for m in (packed, stock))
    assert F.cosine_similarity(ours, theirs, dim=-1).min() > 0.999
    lossless = packed.generate(prompt, max_new_tokens=24)
    off = packed.generate(prompt, max_new_tokens=24, dropmatch_k=5, dropout_p=0.0)
    assert (off.token_ids, off.accept_lengths, off.exact_accept_lengths) == \
        (lossless.token_ids, lossless.accept_lengths, lossless.exact_accept_lengths)
    assert off.verified_positions == 0 and len(lossless.token_ids) > 0
    plain = packed.generate(prompt, max_new_tokens=24, baseline=True)
    assert plain.rounds == len(plain.token_ids) + (plain.stop_reason == "eos") > 0  # one token per forward
    assert_same_tokens_up_to_a_near_tie(packed, prompt, lossless, plain)
    runs = []  # trees whose drafts are plain decoding's tokens, with a wrong one at a random depth half the time
    for dm in (DropMatchConfig(), DropMatchConfig(k=5, p=0.0)):
        drafter = OracleDrafter(plain.token_ids, depth=3, vocab=packed.target.config.vocab_size, error_rate=0.5)
        runs.append(packed.decoder.generate(prompt, drafter, DecodeConfig(max_new_tokens=24, dropmatch=dm)))
    assert (runs[1].token_ids, runs[1].accept_lengths, runs[1].exact_accept_lengths) == \
        (runs[0].token_ids, runs[0].accept_lengths, runs[0].exact_accept_lengths)
    assert max(runs[0].accept_lengths) > 1 and runs[1].verified_positions == 0
    sampled = packed.generate(prompt, max_new_tokens=24, dropmatch_k=5, dropout_p=0.3, temperature=0.8, seed=3)
    assert len(sampled.token_ids) > 0 and sampled.rounds > 0


@fp16
def test_an_fp16_packed_model_decodes_as_the_engine_promises(fp16_model_dir, monkeypatch):
    """With fbgemm's kernel every layer of target and head is packed; the target's hidden states stay those
    of the stock bf16 model up to rounding; DropMatch at p = 0 is lossless EAGLE-3 bit for bit on the packed
    layers, as on the stock ones; plain decoding runs on them too."""
    monkeypatch.setattr(cpu_linear, "packing_kernel", lambda: "fp16")
    d = fp16_model_dir
    packed = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="on")
    stock = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="off")
    layers = [m for m in (*packed.target.modules(), *packed.head.modules()) if isinstance(m, nn.Linear | PrepackedLinear)]
    assert packed.prepacked == len(layers) > 0 and all(type(m) is PrepackedLinear and m.kernel == "fp16" for m in layers)
    assert packed.threaded == (len(layers) if cpu_linear.fp16_extension() is not None else 0) and stock.threaded == 0
    assert_decodes_as_the_engine_promises(packed, stock)


@bf16
def test_a_bf16_packed_model_decodes_as_the_engine_promises(tiny_model_dir):
    """With this package's bf16 kernel every layer of target and head is packed, whatever its values; the
    target's hidden states stay those of the stock bf16 model up to rounding; DropMatch at p = 0 is lossless
    EAGLE-3 bit for bit on the packed layers; plain decoding runs on them too."""
    d = tiny_model_dir
    packed = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="bf16")
    stock = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="off")
    layers = [m for m in (*packed.target.modules(), *packed.head.modules()) if isinstance(m, nn.Linear | PrepackedLinear)]
    assert packed.prepacked == packed.threaded == len(layers) > 0
    assert all(type(m) is PrepackedLinear and m.kernel == "bf16" for m in layers)
    assert packed.kernel == "bf16" and default_tree(packed.kernel) == (4, 3, 3)
    assert_decodes_as_the_engine_promises(packed, stock)


def test_load_refuses_prepacking_an_fp32_model_in_one_line(tiny_model_dir):
    with pytest.raises(LoadError, match="cpu-prepack on packs bf16 weights on the CPU"):
        load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", cpu_prepack="on")


@pytest.mark.parametrize("kernel", KERNELS)
def test_load_packs_with_the_kernel_named(fp16_model_dir, kernel):
    """``cpu_prepack="onednn"``, ``"fp16"`` or ``"bf16"`` packs target and head with that kernel whatever auto
    would pick here, sets the model's kernel (and so its default tree) to it, and decodes as the stock layers do:
    bit for bit with oneDNN, up to a near-tie with the kernels that sum in another order."""
    d = fp16_model_dir
    model = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack=kernel)
    layers = [m for m in (*model.target.modules(), *model.head.modules()) if type(m) is PrepackedLinear]
    assert model.kernel == kernel and len(layers) == model.prepacked > 0 and {m.kernel for m in layers} == {kernel}
    stock = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="off")
    prompt = model.chat_ids([{"role": "user", "content": "Say something long."}])
    ours, theirs = (m.generate(prompt, max_new_tokens=16, baseline=True) for m in (model, stock))
    assert len(ours.token_ids) > 0
    if kernel == "onednn":  # the stock arithmetic, bit for bit
        assert ours.token_ids == theirs.token_ids and ours.stop_reason == theirs.stop_reason
    else:  # the products of the model's own weights, summed in another order: the same tokens but at a near-tie
        assert_same_tokens_up_to_a_near_tie(stock, prompt, ours, theirs)


# ---------------------------------------------------------------- the bf16 kernel's int8 screen (DropMatch's scoring)

def screen_case(outputs=1000, inputs=97, seed=0, build="native"):
    """(a packed bf16 weight, a function screening rows with it, rows): rows of inputs random, scaled, zero and
    with outlier dimensions; with 660 outputs or more, rows 600-659 repeat rows 100-159 (exact ties) and rows
    9-13 of the inputs peak at a tied pair. ``build``: "native" (``bf16_extension``) or one of ``SCREEN_BUILDS``
    (``screen_module``)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(outputs, inputs, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(24, inputs, generator=gen) * torch.tensor([1.0, 10.0, 0.01, 40.0]).repeat(6)[:, None]
    x[5] = 0
    x[6:9, :3] *= 60
    if outputs >= 660:
        weight[600:660] = weight[100:160]
        x[9:14] = weight[100:105].float() * 40
    module = cpu_linear.bf16_extension() if build == "native" else screen_module(build)
    packed = module.PackedBF16Linear(weight)
    norm = float(torch.linalg.vector_norm(weight.float(), dim=-1).max())
    return packed, (lambda rows, max_blocks: packed.screened_argmax(rows, norm, max_blocks)), x.to(torch.bfloat16)


@bf16  # both builds of the bf16 kernel have the int8 screen
def test_the_screen_passes_its_check():
    assert cpu_linear.screen_works()


@pytest.mark.parametrize("build", SCREEN_BUILDS)
@pytest.mark.parametrize("outputs,inputs", [(1000, 97), (49, 576), (2000, 64), (300, 4096)])
def test_the_screen_gives_the_full_products_first_argmax(outputs, inputs, build):
    """Every build's screen; 4096 inputs (Llama-3.1-8B's width) make the input's integer range smaller, so that
    the int32 sums cannot overflow."""
    from eagle_dropmatch.acceptance import first_argmax
    packed, screened, x = screen_case(outputs, inputs, build=build)
    expected = first_argmax(packed.forward(x, None))
    assert torch.equal(screened(x, 10 ** 6), expected)  # every row decided, the same index
    some = screened(x, 2)
    assert bool(((some == expected) | (some == -1)).all())
    if inputs < 4096:  # 4096 random inputs make bounds too wide for 2 blocks of 16: every row open there
        assert bool((some >= 0).any())
    assert bool((screened(x, 0) == -1).all())  # no block allowed: every row left open
    if outputs == 1000:  # a tied pair's first index wins (rows 9-13 peak at outputs 100-104 and 600-604)
        assert expected[9:14].tolist() == list(range(100, 105))


@pytest.mark.parametrize("build", SCREEN_BUILDS)
@pytest.mark.parametrize("rows", range(1, 10))
def test_the_screen_gives_the_same_indices_for_any_row_count(rows, build):
    """Up to 8 rows (the AVX2 build: 4) share each pass over the int8 weight (a kernel per count); more take two
    or three passes."""
    from eagle_dropmatch.acceptance import first_argmax
    packed, screened, x = screen_case(700, 97, build=build)
    for start in (0, 24 - rows):
        part = x[start:start + rows].contiguous()
        assert torch.equal(screened(part, 10 ** 6), first_argmax(packed.forward(part, None)))


@pytest.mark.parametrize("build", SCREEN_BUILDS)
@pytest.mark.parametrize("outputs,rivals", [(1000, 8), (1000, 64), (49, 8)])
def test_the_screen_gives_rivals_from_its_highest_blocks_without_changing_its_indices(outputs, rivals, build):
    """``screened_argmax_rivals``: the same indices as ``screened_argmax``; per row, one output of each of the
    ``rivals`` blocks of 16 with the highest bounds, so distinct blocks while there are enough (49 outputs
    make 4 blocks, which then repeat), every one in range; -1 on a row with a value that is not finite."""
    packed, screened, x = screen_case(outputs, 97, build=build)
    norm = float(torch.linalg.vector_norm(packed.forward(torch.eye(97, dtype=torch.bfloat16), None).float().T,
                                          dim=-1).max())
    x[2, 5] = float("nan")
    indices, rival_ids = packed.screened_argmax_rivals(x, 10 * norm, 64, rivals)
    assert torch.equal(indices, packed.screened_argmax(x, 10 * norm, 64))
    wanted = torch.arange(24) % 3 == 0
    _, some = packed.screened_argmax_rivals(x, 10 * norm, 64, rivals, wanted)
    assert torch.equal(some[wanted], rival_ids[wanted]) and bool((some[~wanted] == -1).all())
    assert rival_ids.shape == (24, rivals) and rival_ids.dtype == torch.long
    assert bool((rival_ids[2] == -1).all())
    rows = [r for r in range(24) if r != 2]
    assert bool((rival_ids[rows] >= 0).all()) and bool((rival_ids[rows] < outputs).all())
    blocks = -(-outputs // 16)
    logits = packed.forward(x, None).float()
    for r in rows:
        assert len(set((rival_ids[r] // 16).tolist())) == min(rivals, blocks)
        if r != 5:  # the zero row ties everywhere; elsewhere the best block holds a rival
            assert int(indices[r]) // 16 in set((rival_ids[r] // 16).tolist())
    assert bool(torch.isfinite(logits[rows]).all())


@bf16  # both builds of the bf16 kernel have the int8 screen
def test_greedy_tokens_are_the_full_products_and_rows_the_screen_leaves_open_are_computed(monkeypatch):
    """``verify.greedy_tokens`` on a packed bf16 LM head: the tokens of ``first_argmax`` of the logits, the rivals
    after each row's token; a row the screen leaves open is computed in full (its rivals still the screen's);
    no screen (fp32 rows, the screen switched off): None."""
    from eagle_dropmatch.acceptance import first_argmax
    from eagle_dropmatch.verify import TargetLMHead, greedy_tokens
    linear = bf16_linear(96, 1200, bias=False, fp16_values=False)
    head = TargetLMHead(PrepackedLinear(linear, "bf16"))
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)  # the AVX2 build's most
    x[3] = 0  # every logit 0: 75 blocks of candidates, more than the screen computes, so the row is left open
    with torch.no_grad():
        expected = first_argmax(head(x))
        assert int(cpu_linear.PrepackedLinear.screened_argmax(head.linear, x, float(head.max_row_norm()))[3]) == -1
        tokens, rivals = greedy_tokens(head, x, 8)
        assert torch.equal(tokens, expected) and rivals.shape == (4, 9)
        assert torch.equal(rivals[:, 0], tokens) and bool(((rivals >= 0) & (rivals < 1200)).all())
        assert torch.equal(greedy_tokens(head, x)[0], expected) and greedy_tokens(head, x)[1] is None
        wanted = torch.tensor([True, False, True, False])  # rows 1 and 3 want no rivals
        tokens, some = greedy_tokens(head, x, 8, wanted)
        assert torch.equal(tokens, expected) and torch.equal(some[wanted], rivals[wanted])
        assert bool((some[~wanted] == tokens[~wanted, None]).all())  # left out: their own token throughout
        assert greedy_tokens(head, x.float()) is None
        monkeypatch.setenv("EAGLE_DROPMATCH_SCREEN", "0")
        assert greedy_tokens(head, x) is None


@bf16  # both builds of the bf16 kernel have the int8 screen
def test_a_screen_that_picks_otherwise_is_not_used(monkeypatch, fresh_extension_probes, capsys):
    real = cpu_linear.bf16_extension()

    class OffByOne:
        def __init__(self, weight):
            self.inner = real.PackedBF16Linear(weight)

        def forward(self, x, bias=None):
            return self.inner.forward(x, bias)

        def screened_argmax(self, x, max_row_norm, max_blocks):
            out = self.inner.screened_argmax(x, max_row_norm, max_blocks)
            return torch.where(out > 0, out - 1, out)

        def screened_argmax_rivals(self, x, max_row_norm, max_blocks, rivals, rival_rows=None):
            return self.inner.screened_argmax_rivals(x, max_row_norm, max_blocks, rivals, rival_rows)

    class Module:
        PackedBF16Linear = OffByOne
    monkeypatch.setattr(cpu_linear, "bf16_extension", lambda: Module())
    assert not cpu_linear.screen_works()
    assert "int8 screen differs" in capsys.readouterr().err


@pytest.mark.parametrize("build", SCREEN_BUILDS)
def test_the_screen_leaves_rows_that_are_not_finite_open(build):
    _, screened, x = screen_case(build=build)
    x[2, 5] = float("inf")
    x[3, 0] = float("nan")
    out = screened(x, 10 ** 6)
    assert out[2] == -1 and out[3] == -1 and bool((out[4:] >= 0).all())


@bf16  # both builds of the bf16 kernel have the int8 screen
def test_a_prepacked_head_screens_only_where_it_can_and_follows_a_changed_weight():
    from eagle_dropmatch.acceptance import first_argmax
    linear = bf16_linear(96, 800, bias=False, fp16_values=False)
    packed = PrepackedLinear(linear, "bf16")
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)  # the AVX2 build's most
    norm = float(torch.linalg.vector_norm(linear.weight.detach().float(), dim=-1).max())
    with torch.no_grad():
        assert torch.equal(packed.screened_argmax(x, norm), first_argmax(packed(x)))
        linear.weight.mul_(-1)  # the weight changes after packing: packed again, screen and all
        assert torch.equal(packed.screened_argmax(x, 2 * norm), first_argmax(F.linear(x, linear.weight)))
        assert packed.screened_argmax(x.float(), norm) is None  # fp32 rows
        biased = PrepackedLinear(bf16_linear(96, 800, bias=True, fp16_values=False), "bf16")
        assert biased.screened_argmax(x, norm) is None  # a bias: no screen
    if onednn_packs_bf16():
        assert PrepackedLinear(linear, "onednn").screened_argmax(x, norm) is None


@bf16  # both builds of the bf16 kernel have the int8 screen
def test_decoding_takes_its_greedy_tokens_through_the_screen_with_the_same_tokens(monkeypatch):
    """A bf16 target whose LM head is packed for the bf16 kernel: plain decoding, lossless EAGLE-3 and contested
    DropMatch take their undropped tokens (and DropMatch its rivals and sample rows) from the screen, which is
    called, and their tokens and rounds are those of the full product (the screen off) and, for DropMatch, of
    stacking every sample row into the head's product."""
    from eagle_dropmatch.drafters import Eagle3Drafter
    from eagle_dropmatch.dropmatch import SCREEN_RIVALS, DropMatchConfig
    from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
    from conftest import tiny_head
    target = tiny_target(seed=1, vocab=400).to(torch.bfloat16)
    assert prepack_linears(target, "bf16") > 0
    calls = []
    real = PrepackedLinear.screened_argmax_rivals

    def counting(self, x, max_row_norm, rivals, rival_rows=None):
        served = real(self, x, max_row_norm, rivals, rival_rows)
        if served is not None:
            calls.append(rivals)
        return served
    monkeypatch.setattr(PrepackedLinear, "screened_argmax_rivals", counting)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    # a tree whose rows the screen serves: the AVX2 build serves up to 4 (``screen_max_rows``)
    tree = (16, 4, 4) if cpu_linear.bf16_build() == "avx512" else (3, 3, 2)
    gen = torch.Generator().manual_seed(3)
    methods = {"plain": None, "eagle3": DropMatchConfig(), "contested": DropMatchConfig(k=5, p=0.3, rows="contested"),
               "all": DropMatchConfig(k=5, p=0.3, rows="all")}
    for i in range(3):
        prompt = torch.randint(3, 400, (12,), generator=gen)
        out = {}
        for method, dm in methods.items():
            for screen in ("1", "0"):
                monkeypatch.setenv("EAGLE_DROPMATCH_SCREEN", screen)
                if dm is None:
                    out[method, screen] = engine.generate_baseline(prompt, DecodeConfig(max_new_tokens=24, seed=i))
                else:
                    cfg = DecodeConfig(max_new_tokens=24, seed=i, dropmatch=dm)
                    out[method, screen] = engine.generate(
                        prompt, Eagle3Drafter(tiny_head(target, seed=i).to(torch.bfloat16), *tree), cfg)
        for method in methods:
            assert out[method, "1"].token_ids == out[method, "0"].token_ids
            assert out[method, "1"].accept_lengths == out[method, "0"].accept_lengths
        assert out["contested", "1"].token_ids == out["all", "1"].token_ids
        assert out["contested", "1"].accept_lengths == out["all", "1"].accept_lengths
    assert 0 in calls and SCREEN_RIVALS in calls  # undropped rows without rivals and with them
