"""Linear layers on weights packed once, for bf16 decoding on a CPU.

A bf16 ``nn.Linear`` on a CPU hands its weight in the plain [out, in] layout to a bf16 product at every call.
``load`` packs each weight once instead, with the kernel that suits the CPU (``packing_kernel``), or the one
``--cpu-prepack onednn|fp16`` names:

- ``"onednn"``: the weight reordered into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
  and applied with ``torch.ops.mkldnn._linear_pointwise`` (the pair torch's own CPU compiler emits for frozen
  linears). The same oneDNN arithmetic as the stock layer, bit for bit, faster: SmolLM2-135M's LM head
  (49152 x 576) serves 1 or 8 rows in 1.2-1.3 ms instead of 1.8-2.3 ms on an AVX512-BF16 CPU, and the small
  projections of every layer gain 23-45%. oneDNN packs bf16 only on a CPU with native bf16 (AVX512-BF16 or
  AMX). ``auto`` picks it on a CPU with AMX tiles, and on one with AVX512-BF16 where ``fp16_extension`` is
  missing. With AMX its products take tiles of 16 rows: on a 2-core Xeon SmolLM2's target forward over 1, 6
  and 12 tokens took 22.7, 25.0 and 25.3 ms against fbgemm's 20.8, 29.0 and 32.5, so trees cost little there
  (default 10/3/3, ``loading.default_tree``) and only plain decoding would run faster on fp16 (1.08x; stop 42,
  docs/BENCHMARKS.md, "On an Intel Xeon with AMX").
- ``"fp16"``: the weight packed as fp16 for fbgemm (``torch.ops.aten.fbgemm_pack_gemm_matrix_fp16``) and
  applied with ``fbgemm_linear_fp16_weight``, which reads the fp16 weight (as many bytes as bf16) and
  multiplies and adds in fp32. A target's layer takes it only where every bf16 value of its weight is exactly
  an fp16 value (SmolLM2's all are), so the products are the model's own; the sums run in another order than
  the stock kernel's, so an output may differ from the stock layer's by a bf16 rounding step. A layer whose
  weight is not fp16-exact packs with oneDNN where oneDNN packs bf16, and stays stock elsewhere.
  ``auto`` picks it on a CPU without native bf16 (AVX2 only: most laptops' Intel cores, AMD before Zen 4),
  where torch computes a bf16 product of more than one row element by element and oneDNN refuses to pack
  bf16. On a 2-core AVX2 Zen 3 a tree of 8 rows through SmolLM2's LM head takes about 10 ms instead of 27;
  the kernel's AVX2 code reads the weight once per 6 rows (6 rows 5.0 ms, 7 rows 9.5), hence the smaller
  default tree there (``loading.default_tree``; docs/MACHINES.md, "On a CPU without native bf16").
  ``auto`` also picks it on a CPU with AVX512-BF16 but no AMX (AMD Zen 4) where ``fp16_extension`` runs:
  there oneDNN streams the weights of a one-row product at about half fbgemm's rate. On a 2-core Zen 4,
  SmolLM2's target forward over 1 token took 17.8 ms instead of 28.1 (plain decoding 43-45 tok/s instead of
  31), and over 6 tokens 26.6 ms instead of 28.0 (stop 41; docs/BENCHMARKS.md, "Which kernel").

torch's binding of fbgemm's product runs it as thread 0 of 1: the layer ran on one core while the others
waited. ``fp16_extension`` builds (once per machine, with torch's C++ extension loader: about a minute) a small
module of this package (``csrc/fp16_linear.cpp``) that runs the same fbgemm kernel on the same packed weight
as thread t of torch's n intra-op threads, each summing its own outputs in the same order, so its outputs are
torch's binding's bit for bit; it also converts the input and output inside the call. On the 2-core Zen 3,
SmolLM2's target forward plus LM head over 1 token took 36.9 ms instead of 50.2, over 6 tokens 48.0 instead of
65.5 (medians of 36, alternating). Where it cannot be built (no C++ compiler, no ninja, torch without fbgemm's
headers) or with ``EAGLE_DROPMATCH_FP16_EXTENSION=0``, the "fp16" layers use torch's binding, with one line
on stderr saying why.

- ``"bf16"``: the weight packed by this package's own kernel for CPUs with AVX512-BF16 (``bf16_extension``,
  ``csrc/bf16_linear.cpp``): bf16 weights as they are (any values, no fp16 condition), in lines of 16
  columns x 2 inputs, multiplied by VDPBF16PS (two exact bf16 products added into each of 16 fp32 lanes), up
  to 4 rows per weight line loaded, on all intra-op threads. Every output is summed in the same order
  whatever the row count or thread split, so a row's output does not depend on the rows beside it. ``auto``
  picks it on a CPU with AVX512-BF16 and no AMX (AMD Zen 4) where it builds and passes its check. On a 2-core
  Zen 4 (``scripts/bench_kernels.py``) it ran SmolLM2's layer shapes 1.7-2.3x faster than fbgemm's fp16
  kernel with the weights in cache (576 x 1536: 16.6 against 28.7 us for 1 row, 23.0 against 52.8 for 4);
  streamed from memory, as a forward reads them, as fast for 1 row (52.0 against 52.9 us; the 576 x 49152 LM
  head slower, 1.25 against 1.08 ms) and faster for more (57.2 against 61.7 us for 4, 68.8 against 98.6 for
  8). In decoding the target's forward in a round of the 4/3/3 tree took 19.4 ms against fbgemm's 22.0
  (``scripts/bench_round.py``; stop 47; docs/BENCHMARKS.md, "A bf16 kernel of our own").
  On a CPU whose best vector code is AVX2 (no bf16 arithmetic) "bf16" runs the same product from an AVX2
  build (``bf16_avx2_extension``, ``csrc/bf16_linear_avx2.cpp``): lines of 16 columns of one input, each
  bf16 weight widened to fp32 by a shift or a mask, FMA in input order per output lane, up to 6 rows per line loaded;
  its int8 screen widens int8 weights to int16 for VPMADDWD and serves up to 4 rows (``screen_max_rows``: more
  are faster in full on AVX2; stop 56). ``auto`` picks it there. On a 2-core Zen 3, weights streamed: 576 x 1536
  1 row 72.4 against fbgemm's 84.7 us, 4 rows 92.3 against 100.5, 6 rows 102.3 against 99.6; plain decoding
  1.101x faster and EAGLE-3 on the same tree 1.063x (stop 53; docs/MACHINES.md, "On an AMD EPYC Zen 3, AVX2
  only").

``PrepackedLinear`` keeps the module's ``weight`` and ``bias`` parameters (so tied embeddings, state dicts and
every ``.weight`` reader see the same tensors) and holds the packed copy beside them: the weights' memory is
held twice. It is for frozen models (decoding): a weight changed after packing is packed again at the next
call; with gradients enabled, or an input or weight that is not bf16 on the CPU, the layer runs the stock
``F.linear``. ``prepack_linears`` checks each layer shape against its reference on random rows
(``packed_matches``) before it swaps anything, and keeps the stock layer where they differ.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from .extensions import load_extension

PREPACK_MODES = ("auto", "on", "off", "onednn", "fp16", "bf16")
KERNELS = ("onednn", "fp16", "bf16")


def onednn_packs_bf16() -> bool:
    """Whether this torch build has oneDNN's linear ops and they pack a bf16 weight on this CPU (oneDNN
    refuses without AVX512 or AVX-NE-CONVERT)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return False
    try:
        mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), 8)
    except RuntimeError:
        return False
    return True


@functools.cache
def fbgemm_fp16_works() -> bool:
    """Whether this torch build has fbgemm's fp16-weight linear ops and they run on this CPU (probed once per
    process, with torch's deprecation notice for them kept off stderr)."""
    aten = torch.ops.aten
    if not (hasattr(aten, "fbgemm_pack_gemm_matrix_fp16") and hasattr(aten, "fbgemm_linear_fp16_weight")):
        return False
    try:
        with stderr_silenced():  # torch prints a deprecation notice for each op at its first call in a process
            packed = aten.fbgemm_pack_gemm_matrix_fp16(torch.ones(8, 8))
            out = aten.fbgemm_linear_fp16_weight(torch.ones(1, 8), packed, torch.zeros(8))
        return bool(torch.equal(out, torch.full((1, 8), 8.0)))
    except RuntimeError:
        return False


EXTENSION_NAME = "eagle_dropmatch_fp16_linear"


@functools.cache
def fp16_extension():
    """The compiled module whose ``PackedFP16Linear`` runs fbgemm's fp16 product on all of torch's intra-op
    threads (``csrc/fp16_linear.cpp``), or None where fbgemm's fp16 ops do not run here, the environment sets
    ``EAGLE_DROPMATCH_FP16_EXTENSION=0``, or it cannot be built or does not give torch's binding's output bit
    for bit (one line on stderr says which). Built once per machine (``extensions.load_extension``) and
    loaded from the package's cache after."""
    if not fbgemm_fp16_works():
        return None
    return load_extension(EXTENSION_NAME, "fp16_linear.cpp", "the multi-threaded fp16 kernel",
                          "fp16 layers use torch's one-thread binding, and --cpu-prepack auto packs for "
                          "oneDNN where this CPU has native bf16", ("-O3", "-fopenmp"), ("-fopenmp",),
                          switch="EAGLE_DROPMATCH_FP16_EXTENSION", check=extension_matches_binding,
                          reference="torch's binding")


def extension_matches_binding(module, shapes=((1, 96, 200), (7, 64, 40), (13, 576, 1536))) -> bool:
    """Whether ``module``'s layer gives torch's ``fbgemm_linear_fp16_weight`` output bit for bit (rows, in,
    out; with and without a bias)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows, inputs, outputs in shapes:
            weight = torch.randn(outputs, inputs, generator=generator) * 0.05
            bias = torch.randn(outputs, generator=generator)
            x = torch.randn(rows, inputs, generator=generator)
            packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight)
            ours = module.PackedFP16Linear(weight)
            for b in (None, bias):
                theirs = torch.fbgemm_linear_fp16_weight(x, packed, torch.zeros(outputs) if b is None else b)
                if not torch.equal(ours.forward(x, b), theirs):
                    return False
    return True


BF16_EXTENSION_NAME = "eagle_dropmatch_bf16_linear"
BF16_FLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")


def bf16_kernel_cpu() -> bool:
    """Whether this CPU runs the bf16 kernel's AVX512 build: AVX512-BF16 for its products and AVX512-VNNI for its
    int8 screen (every CPU with the first has the second). Read from torch's CPU probes at each call."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_vnni_supported")]
    return all(check is not None and check() for check in checks)


BF16_AVX2_EXTENSION_NAME = "eagle_dropmatch_bf16_linear_avx2"
BF16_AVX2_FLAGS = ("-O3", "-fopenmp", "-mavx2", "-mfma")


def avx2_cpu() -> bool:
    """Whether this CPU runs AVX2 and FMA code: torch reports an AVX2 or AVX512 capability only with both."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def bf16_build() -> str | None:
    """Which build of this package's bf16 kernel serves this CPU: "avx512" where it has AVX512-BF16 and
    AVX512-VNNI (``bf16_kernel_cpu``), "avx2" where torch's best vector code is AVX2, else None (an AVX512 CPU
    without bf16 keeps fbgemm's AVX512 code, which the AVX2 build was not measured against). Read from torch's
    CPU probes at each call."""
    if bf16_kernel_cpu():
        return "avx512"
    return "avx2" if torch.backends.cpu.get_cpu_capability() == "AVX2" else None


@functools.cache
def bf16_extension():
    """The compiled module whose ``PackedBF16Linear`` runs this package's bf16-weight product on all of torch's
    intra-op threads: with AVX512-BF16 dot products (``csrc/bf16_linear.cpp``; its int8 screen on VNNI) on a CPU
    that has them, else with AVX2 and FMA (``bf16_avx2_extension``) on a CPU whose best vector code torch runs
    is AVX2 (``bf16_build`` says which). None elsewhere, where the environment sets
    ``EAGLE_DROPMATCH_BF16_EXTENSION=0``, or where it cannot be built or does not compute the fp32 product
    within its summation bound (``bf16_extension_matches``; one line on stderr says which).
    Built once per machine (``extensions.load_extension``) and loaded from the package's cache after."""
    build = bf16_build()
    if build != "avx512":
        return bf16_avx2_extension() if build == "avx2" else None
    return load_extension(BF16_EXTENSION_NAME, "bf16_linear.cpp", "the AVX512-BF16 kernel",
                          "--cpu-prepack auto packs for fbgemm's fp16 kernel or oneDNN instead", BF16_FLAGS,
                          ("-fopenmp",), switch="EAGLE_DROPMATCH_BF16_EXTENSION", check=bf16_extension_matches,
                          reference="the fp32 product")


@functools.cache
def bf16_avx2_extension():
    """The AVX2 build of this package's bf16 kernel (``csrc/bf16_linear_avx2.cpp``: the bf16 weight widened to
    fp32 and multiplied with FMA, every output summed in input order by one lane; its int8 screen on up to
    ``screen_max_rows`` rows), or None on a CPU without AVX2 and FMA (``avx2_cpu``) and where ``bf16_extension``
    gives None.
    What ``bf16_extension`` gives on a CPU whose best vector code is AVX2; tests build it on any AVX2 CPU."""
    if not avx2_cpu():
        return None
    return load_extension(BF16_AVX2_EXTENSION_NAME, "bf16_linear_avx2.cpp", "the AVX2 bf16 kernel",
                          "--cpu-prepack auto packs for fbgemm's fp16 kernel or oneDNN instead", BF16_AVX2_FLAGS,
                          ("-fopenmp",), switch="EAGLE_DROPMATCH_BF16_EXTENSION", check=bf16_extension_matches,
                          reference="the fp32 product")


def bf16_screen(module) -> bool:
    """Whether a bf16 kernel module has the int8 screen (both builds have it since stop 56)."""
    return hasattr(getattr(module, "PackedBF16Linear", None), "screened_argmax_rivals")


def bf16_extension_matches(module, shapes=((1, 96, 200), (4, 576, 192), (7, 33, 40), (13, 576, 1536))) -> bool:
    """Whether ``module``'s layer gives the fp32 product of bf16 weights and inputs within the bound on summing
    in another order (``within_summation_bound``), with and without a bias, on odd and even widths (rows, in,
    out), the same for each row alone as in the batch."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows, inputs, outputs in shapes:
            weight = (torch.randn(outputs, inputs, generator=generator) * 0.05).to(torch.bfloat16)
            bias = torch.randn(outputs, generator=generator).to(torch.bfloat16)
            x = torch.randn(rows, inputs, generator=generator).to(torch.bfloat16)
            ours = module.PackedBF16Linear(weight)
            for b in (None, bias):
                out = ours.forward(x, b)
                if out.dtype != torch.bfloat16 or not within_summation_bound(out, x, weight.float(), b):
                    return False
                if not torch.equal(ours.forward(x[-1:], b), out[-1:]):
                    return False
    return True


SCREEN_MAX_BLOCKS = 64  # blocks of 16 outputs the screen may leave to compute; more: the row is computed in full


@functools.cache
def screen_works() -> bool:
    """Whether the bf16 kernel's ``screened_argmax`` gives ``first_argmax`` of its full product on a check case
    (random rows; rows whose best outputs tie exactly, from repeated weight rows, where the first must win;
    a zero row; a limit of one block, which leaves rows open), or False (one line on stderr) where it does
    not, or there is no bf16 kernel or it has no screen. Cached per process."""
    module = bf16_extension()
    if module is None or not bf16_screen(module):
        return False
    from .acceptance import first_argmax
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 97, generator=generator) * 0.05).to(torch.bfloat16)
    weight[200:230] = weight[40:70]  # exact ties between outputs 40-69 and 200-229
    x = torch.randn(12, 97, generator=generator).to(torch.bfloat16)
    x[3] = 0  # every output 0: the first wins
    x[4:8] = (weight[40:44].float() * 30).to(torch.bfloat16)  # rows whose maximum is a tied pair
    packed = module.PackedBF16Linear(weight)
    norm = float(torch.linalg.vector_norm(weight.float(), dim=-1).max())
    expected = first_argmax(packed.forward(x, None))
    screened, narrow = packed.screened_argmax(x, norm, 64), packed.screened_argmax(x, norm, 1)
    ok = (torch.equal(screened, expected) and bool(((narrow == expected) | (narrow == -1)).all())
          and bool((narrow == -1).any()))
    if not ok:
        print("eagle_dropmatch: the bf16 kernel's int8 screen differs from its full product here; DropMatch "
              "scores its samples with the full product", file=sys.stderr, flush=True)
    return ok


def within_summation_bound(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a bf16 output is the fp32 product ``x @ weight.T + bias`` up to summing in another order: twice
    the bound on fp32 summation error (in_features x 2^-24 x the sum of |x w| over the row) plus one bf16
    rounding step. ``weight``: the values the kernel multiplies by, in fp32."""
    reference = F.linear(x.float(), weight, None if bias is None else bias.float())
    magnitude = F.linear(x.float().abs(), weight.abs())
    bound = (2 * weight.shape[1] * 2.0 ** -24 * magnitude + reference.abs() * 2.0 ** -7
             + torch.finfo(torch.bfloat16).tiny)
    return bool(((out.float() - reference).abs() <= bound).all())


@contextlib.contextmanager
def stderr_silenced():
    """Discard what C++ code writes to the process's stderr (file descriptor 2) inside the block."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16 or AMX)."""
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return amx_tiles() or (check is not None and check())


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return check is not None and check()


@functools.cache
def packing_kernel() -> str | None:
    """The kernel that serves packed bf16 weights on this CPU under ``auto`` (a fact of the machine and the
    torch build, probed once per process): "onednn" on a CPU with AMX tiles; "bf16" on one with AVX512-BF16,
    or with AVX2 as its best vector code, where this package's kernel (``bf16_extension``) runs; "onednn" where
    it does not, the CPU has native bf16 and the multi-threaded fp16 kernel (``fp16_extension``) is missing;
    else "fp16" where fbgemm's fp16-weight product runs; else "onednn" where oneDNN packs bf16; else None. On a
    Zen 4 (AVX512-BF16, no AMX) fbgemm's kernel
    ran SmolLM2's one-token target forward in 17.8 ms against oneDNN's 28.1, and "bf16" a round's tree forward
    in 19.4 ms against fbgemm's 22.0; on a Xeon with AMX oneDNN's ran 12 tokens in 25.3 ms against fbgemm's
    32.5 (module docstring; "bf16" was not measured there). On a 2-core AVX2 Zen 3 the AVX2 build of "bf16"
    ran plain decoding 1.101x and EAGLE-3 on the 6/3/3 tree 1.063x faster than fbgemm's kernel, and EAGLE-3 on
    4/3/3 (``loading.default_tree``) 1.104x fbgemm's on 6/3/3 (stop 53, MT-Bench first turns 0-24, side by
    side)."""
    if amx_tiles() and onednn_packs_bf16():
        return "onednn"
    if bf16_extension() is not None:  # it probes the CPU itself
        return "bf16"
    onednn = native_bf16() and onednn_packs_bf16()
    if onednn and fp16_extension() is None:
        return "onednn"
    if fbgemm_fp16_works():
        return "fp16"
    return "onednn" if onednn else None


def kernel_available(kernel: str) -> bool:
    """Whether ``kernel`` ("onednn", "fp16" or "bf16") serves bf16 weights on this CPU with this torch build."""
    if kernel == "bf16":
        return bf16_extension() is not None
    return onednn_packs_bf16() if kernel == "onednn" else fbgemm_fp16_works()


def prepack_available() -> bool:
    """Whether some packed kernel serves bf16 weights on this CPU with this torch build."""
    return packing_kernel() is not None


def prepack_wanted(mode: str, dtype: torch.dtype, device: str) -> bool:
    """Whether ``load`` packs the linear layers: for a bf16 model on the CPU with "auto" or "on" (with the
    kernel ``packing_kernel`` picks) or a kernel's name ("onednn", "fp16", "bf16"), never with "off".

    Raises:
        ValueError: an unknown mode, or "on" or a kernel's name where it cannot apply (another dtype or
            device, or that kernel, or any, missing on this CPU and torch build).
    """
    if mode not in PREPACK_MODES:
        raise ValueError(f"cpu-prepack must be one of {', '.join(PREPACK_MODES)}, got {mode!r}")
    if mode == "off":
        return False
    applies = dtype == torch.bfloat16 and str(device) == "cpu"
    if mode != "auto" and not applies:
        raise ValueError(f"cpu-prepack {mode} packs bf16 weights on the CPU: use --dtype bfloat16 --device cpu, "
                         "or --cpu-prepack auto/off")
    if mode in KERNELS:
        if not kernel_available(mode):
            lacks = {"onednn": "oneDNN's bf16 linear ops", "fp16": "fbgemm's fp16 linear ops",
                     "bf16": "AVX512-BF16 or AVX2 and the compiled bf16 kernel"}[mode]
            raise ValueError(f"cpu-prepack {mode} needs {lacks}, which this CPU or torch build lacks: use "
                             "--cpu-prepack auto")
        return True
    available = applies and prepack_available()
    if mode == "on" and not available:
        raise ValueError("cpu-prepack on needs oneDNN's bf16 linear ops, fbgemm's fp16 ones or the compiled bf16 "
                         "kernel, which this CPU or torch build lacks: use --cpu-prepack off")
    return available


def kernel_for(mode: str, dtype: torch.dtype, device: str) -> str | None:
    """The kernel ``load`` packs a model's layers with under these settings (the named one, or
    ``packing_kernel``'s for "auto" and "on"), or None (stock layers); the errors of ``prepack_wanted``."""
    if not prepack_wanted(mode, dtype, device):
        return None
    return mode if mode in KERNELS else packing_kernel()


class PrepackedLinear(nn.Module):
    """An ``nn.Linear`` whose bf16 weight was packed once for a CPU kernel.

    The packed copy is remade when the weight changes after packing (an in-place update or a new tensor:
    its version counter or storage moved), so the layer never computes with a stale copy, and it is left out
    of copies and pickles (a copy packs again on its first call).

    Args:
        linear: the layer to wrap; its ``weight`` [out, in] and ``bias`` [out] or None are shared, not copied.
        kernel: "onednn" (bf16 weight reordered by oneDNN, bit for bit the stock output), "fp16" (fp16
            weight for fbgemm, fp32 arithmetic, the output rounded to bf16) or "bf16" (this package's bf16
            kernel, AVX512-BF16 or AVX2: the bf16 weight, fp32 sums, the output rounded to bf16); see the module
            docstring.
        rows_hint: the row count oneDNN packs for (the engine's calls are 1 to a few dozen rows).
        threads: "fp16" only: run fbgemm on all intra-op threads through ``fp16_extension`` where it is
            available (the same outputs, faster); False: torch's one-thread binding.

    Attributes:
        threads: what was asked for.
        threaded: whether this layer runs on all intra-op threads through a compiled module of this package
            (an "fp16" layer through ``fp16_extension``, always a "bf16" one; never an "onednn" one).
    """

    def __init__(self, linear: nn.Linear, kernel: str = "onednn", rows_hint: int = 8, threads: bool = True):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel == "bf16" and bf16_extension() is None:
            raise ValueError("kernel bf16 needs AVX512-BF16 or AVX2 and the compiled bf16 kernel, which this CPU "
                             "or machine lacks")
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)  # None too, as nn.Linear does: forward reads both there
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel, self.rows_hint, self.threads = kernel, rows_hint, threads
        self.threaded, self.packed, self.packed_from, self.no_bias = False, None, None, None
        self.pack()

    def pack(self) -> None:
        """(Re)make the packed copy of the current weight; ``packed_from`` records which (version, storage).
        An "fp16" layer is ``threaded`` when it asked for ``threads`` and the extension is here (a copy or an
        unpickled layer decides again where it lands)."""
        weight = self.weight.detach()
        self.threaded = self.kernel == "bf16" or (self.kernel == "fp16" and self.threads
                                                  and fp16_extension() is not None)
        with torch.no_grad():
            if self.kernel == "bf16":
                self.packed = bf16_extension().PackedBF16Linear(weight)
            elif self.kernel == "onednn":
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.rows_hint)
            elif self.threaded:
                self.packed = fp16_extension().PackedFP16Linear(weight)
            else:
                fbgemm_fp16_works()  # the ops' first calls, with their deprecation notice, happen in the probe
                self.packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight.float())
                self.no_bias = torch.zeros(self.out_features)  # fbgemm's binding wants a bias tensor
        self.packed_from = (self.weight._version, self.weight.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out], as ``F.linear(x, weight, bias)``. Runs once per layer per forward (a few
        hundred times per decoded token), so its Python is kept short: it reads its parameters from
        ``_parameters`` (not through ``nn.Module.__getattr__``), calls fbgemm through ``torch``'s own binding
        rather than ``torch.ops`` (which also wants a bias tensor: zeros for a layer without one) and hands
        oneDNN the input as it is (it takes any leading dimensions; fbgemm gets it as rows). On the 2-core Zen 3
        this took SmolLM2's target forward of 1 token from 35.95 to 33.80 ms and of 6 from 46.36 to 44.53. A
        threaded "fp16" layer makes one call into the extension, which converts and reshapes in C++."""
        weight, bias = self._parameters["weight"], self._parameters["bias"]
        if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or not x.is_cpu or (
                torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))):
            return F.linear(x, weight, bias)
        if self.packed_from != (weight._version, weight.data_ptr()):  # changed since packing (or a copy)
            self.pack()
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, bias, "none", [], "")
        if self.threaded:  # "bf16", or "fp16" through the extension
            return self.packed.forward(x, bias)
        shape = x.shape  # fbgemm takes rows; the engine also passes [in]
        rows = torch.fbgemm_linear_fp16_weight(x.reshape(-1, shape[-1]).float(), self.packed,
                                               self.no_bias if bias is None else bias.float())
        return rows.to(torch.bfloat16).view(*shape[:-1], self.out_features)

    def screened_argmax(self, x: torch.Tensor, max_row_norm: float) -> torch.Tensor | None:
        """[P, in] -> int64 [P]: the index of each row's first maximum output, as ``first_argmax(self(x))``, from
        the "bf16" kernel's int8 screen (``PackedBF16Linear.screened_argmax``: an int8 copy of the weight, half
        its bytes, bounds which outputs can be the maximum, and only their blocks are computed, by the kernel's
        own sums); -1 for a row the screen leaves open (the caller computes it in full). None where there is no
        screen: another kernel, a bias, inputs that are not bf16 rows on the CPU, autograd, a module that fails
        ``screen_works``, more rows than the build's ``screen_max_rows`` (the AVX2 build's 4: a product in full
        is faster there), or ``EAGLE_DROPMATCH_SCREEN=0`` (read at each call, so a benchmark can switch it).

        Args:
            x: [P, in] rows.
            max_row_norm: the largest |row| of the weight (``verify.TargetLMHead.max_row_norm``), for the
                bound on the kernel's own rounding.
        """
        packed = self._screen(x)
        return None if packed is None else packed.screened_argmax(x, max_row_norm, SCREEN_MAX_BLOCKS)

    def screened_argmax_rivals(self, x: torch.Tensor, max_row_norm: float, rivals: int,
                               rival_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``screened_argmax`` and, from the same bounds, ``rivals`` high-scoring outputs of each row: int64 [P]
        and int64 [P, rivals] (the best output by the screen's bound in each of the ``rivals`` blocks of 16
        whose bounds are highest; -1 on a row that holds a value that is not finite, or that ``rival_rows``,
        bool [P], leaves out). None where ``screened_argmax`` is None."""
        packed = self._screen(x)
        return None if packed is None else packed.screened_argmax_rivals(x, max_row_norm, SCREEN_MAX_BLOCKS, rivals,
                                                                         rival_rows)

    def _screen(self, x: torch.Tensor):
        """The packed bf16 module, repacked if the weight changed, where the int8 screen serves ``x``; else None."""
        weight = self._parameters["weight"]
        grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if (self.kernel != "bf16" or self._parameters["bias"] is not None or x.dtype is not torch.bfloat16
                or not x.is_cpu or x.dim() != 2 or grads or os.environ.get("EAGLE_DROPMATCH_SCREEN", "1") == "0"
                or not screen_works()):
            return None
        if self.packed_from != (weight._version, weight.data_ptr()):
            self.pack()
        most = getattr(self.packed, "screen_max_rows", None)  # the AVX2 build's: more rows are faster in full
        return None if most is not None and x.shape[0] > most else self.packed

    def __getstate__(self):
        return {**self.__dict__, "packed": None, "packed_from": None}  # an opaque packed tensor cannot be copied

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel}" + (", threaded" if self.threaded else ""))


def threaded_layers(*modules: nn.Module) -> int:
    """How many ``PrepackedLinear`` layers in ``modules`` (None skipped) run on all intra-op threads through a
    compiled module (``fp16_extension`` or ``bf16_extension``): what benchmark reports print beside the
    packed count."""
    return sum(getattr(m, "threaded", False) is True for module in modules if module is not None
               for m in module.modules())


def fp16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of a bf16 weight is exactly an fp16 value (the "fp16" kernel computes with it)."""
    weight = weight.detach()
    return bool(torch.equal(weight.half().to(weight.dtype), weight))


def packed_matches(linear: nn.Linear, packed: PrepackedLinear, rows: tuple[int, ...] = (1, 8, 29)) -> bool:
    """Whether the packed layer computes what it stands for, on random bf16 rows.

    "onednn": ``F.linear``'s output bit for bit. "fp16" and "bf16": every output within what summing in
    another order can move it from the same product in fp32 with the weight the kernel holds (fbgemm's fp16
    values, the bf16 weight itself): ``within_summation_bound``.
    """
    generator = torch.Generator().manual_seed(0)
    held = linear.weight.detach().half() if packed.kernel == "fp16" else linear.weight.detach()  # what it holds
    with torch.no_grad():
        for n in rows:
            x = torch.randn(n, linear.in_features, generator=generator).to(torch.bfloat16)
            out = packed(x)
            if packed.kernel == "onednn":
                if not torch.equal(out, F.linear(x, linear.weight, linear.bias)):
                    return False
            elif not within_summation_bound(out, x, held.float(), linear.bias):
                return False
    return True


def prepack_linears(model: nn.Module, kernel: str | None = None, exact: bool = True, threads: bool = True) -> int:
    """Swap every bf16 CPU ``nn.Linear`` in ``model`` for a ``PrepackedLinear``, in place.

    Args:
        model: the module whose layers are swapped.
        kernel: "onednn", "fp16" or "bf16"; None = ``packing_kernel()`` (no kernel here: nothing is swapped).
        exact: under "fp16", pack with fbgemm only weights whose every value is an fp16 value
            (``fp16_exact``), so that the layer computes with the model's own weights: what a target needs;
            the others pack with oneDNN where it packs bf16 (the stock outputs) and stay stock elsewhere. A
            drafter only proposes tokens the target then verifies, so its weights may round (a trained head's
            values below 6e-5 lose bits as fp16 subnormals): ``exact=False``.
        threads: under "fp16", run the layers on all intra-op threads where ``fp16_extension`` is available
            (``PrepackedLinear``'s ``threads``).

    Each distinct (in, out, bias, kernel) is checked once (``packed_matches``); a shape whose packed output
    differs keeps its stock layers. Returns the number of layers swapped.
    """
    kernel = kernel or packing_kernel()
    if kernel is None:
        return 0
    fallback = "onednn" if kernel == "fp16" and exact and onednn_packs_bf16() else None  # for non-fp16 weights
    swapped, verdicts = 0, {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.weight.dtype != torch.bfloat16 or child.weight.device.type != "cpu":
                continue
            layer_kernel = kernel
            if kernel == "fp16" and exact and not fp16_exact(child.weight):
                if fallback is None:
                    continue
                layer_kernel = fallback
            packed = PrepackedLinear(child, layer_kernel, threads=threads)
            shape = (child.in_features, child.out_features, child.bias is not None, layer_kernel)
            if shape not in verdicts:
                verdicts[shape] = packed_matches(child, packed)
            if verdicts[shape]:
                setattr(parent, name, packed)
                swapped += 1
    return swapped
