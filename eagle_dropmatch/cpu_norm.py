"""The target's RMSNorms in one compiled call each, for decoding on a CPU, with torch's values bit for bit.

A transformers RMSNorm of the Llama form (Llama, Qwen2, Qwen3 and its per-head q/k norms, Mistral, SmolLM2)

    weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)

is about eight small tensor ops, and on a CPU each costs microseconds to start whatever its rows: on a 2-core
Zen 4 one norm of SmolLM2 (576 wide, 1 to 4 rows, bf16) took 21-26 us, and a forward of its 30 layers runs 61
of them (two a layer and the final one): with them compiled, a one-token forward took 15.13 instead of 17.41 ms
(side by side, medians). ``CompiledRMSNorm`` makes one call
instead (``extensions.draft_ops``'s ``rms_norm``: 2-3 us) that computes the same operations in the same order:
the squares summed in the order of torch's CPU sum (its cascade of four accumulators over 8-float vectors,
``extensions.TORCH_SUM_LANES``), divided by the width, the reciprocal square root as ``1 / sqrt``, the product
rounded to x's dtype, then scaled in that dtype. So its outputs are the stock module's bit for bit (measured:
all 2.95 M outputs of SmolLM2's norms over a 32-token answer; tested on random rows of many widths): the
target's tokens do not change, in any dtype, so plain decoding, EAGLE-3 and the exactness tests are unaffected.

``compile_rms_norms`` swaps a norm only where its own forward gives the compiled output bit for bit on random
rows of its width at three scales (checked once per class, width, eps and dtype): another formula (Gemma's
``1 + weight``, a norm that scales in fp32 before rounding once) or a torch that sums in another order keeps
the stock module. The swapped module keeps the norm's ``weight`` parameter (state dicts and tied readers see the
same tensor) and runs torch's ops (the same values) for more than ``MAX_COMPILED_ROWS`` rows (a prefill, which
torch splits between threads), in fp16, off the CPU, in another dtype than its weight, or under autograd.
"""

from __future__ import annotations

import torch
from torch import nn

from .extensions import TORCH_SUM_LANES, draft_ops

COMPILED_DTYPES = (torch.bfloat16, torch.float32)
MAX_COMPILED_ROWS = 32  # longer inputs (a prefill) run torch's ops, which split rows between threads


class CompiledRMSNorm(nn.Module):
    """A Llama-form RMSNorm computed in one compiled call on the CPU (module docstring).

    Args:
        norm: the module it stands for; its ``weight`` [H] is shared, not copied.
        eps: the norm's epsilon.
    """

    def __init__(self, norm: nn.Module, eps: float):
        super().__init__()
        self.register_parameter("weight", norm.weight)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H], in x's dtype: the compiled call for a few bf16 or fp32 rows on the CPU outside
        autograd (a round's verification, a decoding step), torch's ops otherwise (a prefill, which they
        split between threads; fp16, whose compiled conversions are slower): the same values either way.
        Runs twice per layer per forward, so it reads its weight from ``_parameters``."""
        weight = self._parameters["weight"]
        if (x.is_cpu and x.dtype == weight.dtype and x.dtype in COMPILED_DTYPES
                and x.numel() <= MAX_COMPILED_ROWS * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            ops = draft_ops()
            if ops is not None:
                return ops.rms_norm(x.contiguous(), weight, self.eps, TORCH_SUM_LANES)
        return llama_rms_norm(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, compiled"


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama form in torch's ops: normalised in fp32, rounded to x's dtype, then scaled in that dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_epsilon(module: nn.Module) -> float | None:
    """The epsilon of a transformers RMSNorm (``variance_epsilon``, or ``eps``), or None where ``module`` is not
    one this swap considers: a class named ``...RMSNorm`` with one 1-D ``weight`` parameter and no children."""
    if not type(module).__name__.endswith("RMSNorm") or any(True for _ in module.children()):
        return None
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 1 or set(module._parameters) != {"weight"}:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def same_as_compiled(module: nn.Module, eps: float, rows: int = 8) -> bool:
    """Whether ``module``'s own forward gives ``CompiledRMSNorm``'s output bit for bit on random rows of its
    width and dtype (tiny, unit and large scales)."""
    weight = module.weight.detach()
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 1.0, 40.0])[:, None, None]
    x = (torch.randn(3, rows, weight.shape[0], generator=generator) * scales).to(weight.dtype)
    with torch.no_grad():
        expected = module(x)
        ours = draft_ops().rms_norm(x, weight, eps, TORCH_SUM_LANES)
    return expected.dtype == ours.dtype and torch.equal(expected, ours)


def compile_rms_norms(model: nn.Module) -> int:
    """Swap each RMSNorm of ``model`` on the CPU that ``same_as_compiled`` accepts for a ``CompiledRMSNorm``, in
    place. Nothing is swapped where ``extensions.draft_ops`` is missing (switched off, or cannot be built); a
    model without such norms on the CPU (a GPU target) does not build it.

    Returns:
        the number of norms swapped.
    """
    candidates = [(parent, name, child, eps) for parent in model.modules()
                  for name, child in parent.named_children()
                  if (eps := norm_epsilon(child)) is not None and child.weight.device.type == "cpu"]
    if not candidates or draft_ops() is None:
        return 0
    swapped, verdicts = 0, {}
    for parent, name, child, eps in candidates:
        key = (type(child), child.weight.shape[0], eps, child.weight.dtype)
        if key not in verdicts:
            verdicts[key] = same_as_compiled(child, eps)
        if verdicts[key]:
            setattr(parent, name, CompiledRMSNorm(child, eps))
            swapped += 1
    return swapped
