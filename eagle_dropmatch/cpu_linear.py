"""Linear layers with prepacked oneDNN weights, for bf16 decoding on a CPU.

A bf16 ``nn.Linear`` on a CPU hands oneDNN its weight in the plain [out, in] layout at every call. Reordered
once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and passed to
``torch.ops.mkldnn._linear_pointwise`` (the pair torch's own CPU compiler emits for frozen linears), the
weight of SmolLM2-135M's LM head (49152 x 576) serves 1 or 8 rows in 1.2-1.3 ms instead of 1.8-2.3 ms on an
AVX512-BF16 CPU, and the small projections of every layer gain 23-45% the same way. The outputs are the
same oneDNN arithmetic: ``prepack_linears`` checks each layer shape bit for bit against ``F.linear`` (on
random rows) before it swaps anything, and keeps the stock layer where they differ.

``PrepackedLinear`` keeps the module's ``weight`` and ``bias`` parameters (so tied embeddings, state dicts and
every ``.weight`` reader see the same tensors) and holds the packed copy beside them: the weights' memory is
held twice. It is for frozen models (decoding): a weight changed after packing is packed again at the next
call; with gradients enabled, or an input or weight that is not bf16 on the CPU, the layer runs the stock
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

PREPACK_MODES = ("auto", "on", "off")


def prepack_available() -> bool:
    """Whether this torch build has the oneDNN ops that pack and apply a linear weight."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and mkldnn is not None
                and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16 or AMX): where packing was measured to pay."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def prepack_wanted(mode: str, dtype: torch.dtype, device: str) -> bool:
    """Whether ``load`` packs the linear layers: "on" for any bf16 model on the CPU, "auto" there too when
    the CPU has native bf16 (elsewhere oneDNN emulates bf16 and packing is unmeasured), "off" never.

    Raises:
        ValueError: an unknown mode, or "on" where it cannot apply (another dtype or device, or a torch
            build without the oneDNN ops).
    """
    if mode not in PREPACK_MODES:
        raise ValueError(f"cpu-prepack must be one of {', '.join(PREPACK_MODES)}, got {mode!r}")
    if mode == "off":
        return False
    applies, available = dtype == torch.bfloat16 and str(device) == "cpu", prepack_available()
    if mode == "on" and not applies:
        raise ValueError("cpu-prepack on packs bf16 weights on the CPU: use --dtype bfloat16 --device cpu, "
                         "or --cpu-prepack auto/off")
    if mode == "on" and not available:
        raise ValueError("cpu-prepack on needs torch's oneDNN linear ops, which this torch build lacks: use "
                         "--cpu-prepack off")
    return applies and available and (mode == "on" or native_bf16())


class PrepackedLinear(nn.Module):
    """An ``nn.Linear`` whose bf16 weight oneDNN reordered once.

    The packed copy is remade when the weight changes after packing (an in-place update or a new tensor:
    its version counter or storage moved), so the layer never computes with a stale copy, and it is left out
    of copies and pickles (a copy packs again on its first call).

    Args:
        linear: the layer to wrap; its ``weight`` [out, in] and ``bias`` [out] or None are shared, not copied.
        rows_hint: the row count oneDNN packs for (the engine's calls are 1 to a few dozen rows).
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 8):
        super().__init__()
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)  # None too, as nn.Linear does: forward reads both there
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows_hint = rows_hint
        self.packed, self.packed_from = None, None
        self.pack()

    def pack(self) -> None:
        """(Re)make the packed copy of the current weight; ``packed_from`` records which (version, storage)."""
        weight = self.weight
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.rows_hint)
        self.packed_from = (weight._version, weight.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out], as ``F.linear(x, weight, bias)``. Runs once per layer per forward, so it
        reads its parameters from ``_parameters`` (not through ``nn.Module.__getattr__``) and hands oneDNN the
        input as it is (the op takes any leading dimensions)."""
        weight, bias = self._parameters["weight"], self._parameters["bias"]
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))):
            return F.linear(x, weight, bias)
        if self.packed_from != (weight._version, weight.data_ptr()):  # changed since packing (or a copy)
            self.pack()
        return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, bias, "none", [], "")

    def __getstate__(self):
        return {**self.__dict__, "packed": None, "packed_from": None}  # an opaque oneDNN tensor cannot be copied

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_matches(linear: nn.Linear, packed: PrepackedLinear, rows: tuple[int, ...] = (1, 8, 29)) -> bool:
    """Whether the packed layer returns ``F.linear``'s output bit for bit on random bf16 rows."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in rows:
            x = torch.randn(n, linear.in_features, generator=generator).to(torch.bfloat16)
            if not torch.equal(packed(x), F.linear(x, linear.weight, linear.bias)):
                return False
    return True


def prepack_linears(model: nn.Module) -> int:
    """Swap every bf16 CPU ``nn.Linear`` in ``model`` for a ``PrepackedLinear``, in place.

    Each distinct (in, out, bias) shape is checked once (``packed_matches``); a shape whose packed output
    differs from ``F.linear``'s keeps its stock layers. Returns the number of layers swapped.
    """
    if not prepack_available():
        return 0
    swapped, verdicts = 0, {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.weight.dtype != torch.bfloat16 or child.weight.device.type != "cpu":
                continue
            packed = PrepackedLinear(child)
            shape = (child.in_features, child.out_features, child.bias is not None)
            if shape not in verdicts:
                verdicts[shape] = packed_matches(child, packed)
            if verdicts[shape]:
                setattr(parent, name, packed)
                swapped += 1
    return swapped
