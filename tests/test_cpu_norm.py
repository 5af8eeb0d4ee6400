"""The target's RMSNorms in one compiled call (eagle_dropmatch.cpu_norm): torch's values bit for bit, swapped only
where that holds, and the engine's tokens unchanged."""

from __future__ import annotations

import platform

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from eagle_dropmatch.cpu_norm import (MAX_COMPILED_ROWS, CompiledRMSNorm, compile_rms_norms, llama_rms_norm,
                                      norm_epsilon)
from eagle_dropmatch.extensions import TORCH_SUM_LANES, draft_ops
from eagle_dropmatch.loading import load

from conftest import greedy_reference, tiny_target

X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_x86 = pytest.mark.skipif(not X86, reason="torch's summation order is measured on x86 only")


@pytest.fixture
def module():
    compiled = draft_ops()
    assert compiled is not None, "the compiled drafting ops should build here"
    return compiled


def rows_with_outliers(shape, dtype, seed=0):
    """Random rows at six scales, their first dimensions 50 times larger (as a residual stream's)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-3, 0.1, 1.0, 10.0, 40.0, 300.0])[:, None, None]
    x = torch.randn(6, *shape, generator=gen) * scales
    x[..., :3] *= 50
    return x.to(dtype)


@needs_x86
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 5, 8, 17, 63, 576, 577, 2048, 4096, 5120])
def test_the_sum_in_torchs_order_gives_torchs_norm_bit_for_bit(module, dtype, width):
    weight = (torch.rand(width, generator=torch.Generator().manual_seed(width)) + 0.5).to(dtype)
    x = rows_with_outliers((20, width), dtype, seed=width)
    expected = llama_rms_norm(x, weight, 1e-5)
    assert torch.equal(module.rms_norm(x, weight, 1e-5, TORCH_SUM_LANES), expected)


@needs_x86
def test_another_summation_order_is_not_torchs(module):
    """The check has teeth: summed over 4- or 16-float vectors instead of torch's 8, some fp32 norms differ from
    torch's."""
    weight = torch.rand(576, generator=torch.Generator().manual_seed(3)) + 0.5
    x = rows_with_outliers((50, 576), torch.float32)
    expected = llama_rms_norm(x, weight, 1e-5)
    for lanes in (4, 16):
        assert not torch.equal(module.rms_norm(x, weight, 1e-5, lanes), expected)


def test_bad_lanes_raise_one_error(module):
    with pytest.raises(RuntimeError, match="lanes"):
        module.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5, 17)


@needs_x86
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llamas_norms_are_swapped_and_its_logits_stay_bit_for_bit(dtype):
    target = tiny_target(layers=4).to(dtype)
    state = {name: t.data_ptr() for name, t in target.state_dict().items()}
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = target(ids).logits
        step_before = target(ids[:, :1]).logits
    assert compile_rms_norms(target) == 2 * 4 + 1
    assert sum(isinstance(m, CompiledRMSNorm) for m in target.modules()) == 9
    assert {name: t.data_ptr() for name, t in target.state_dict().items()} == state  # the same tensors, same keys
    with torch.no_grad():
        assert torch.equal(target(ids).logits, before)
        assert torch.equal(target(ids[:, :1]).logits, step_before)


@needs_x86
def test_qwen3s_per_head_norms_are_swapped_too():
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)).eval()
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = target(ids).logits
    assert compile_rms_norms(target) == 4 * 2 + 1  # input, post-attention, q and k norms per layer; the final one
    with torch.no_grad():
        assert torch.equal(target(ids).logits, before)


class OnePlusWeightRMSNorm(nn.Module):
    """Gemma's form: scaled by 1 + weight, in fp32, rounded once."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size) * 0.1)
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.float())).to(x.dtype)


class BiasedRMSNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.variance_epsilon = 1e-6


def test_norms_of_other_forms_keep_their_modules():
    model = nn.Sequential(OnePlusWeightRMSNorm(32), BiasedRMSNorm(32), nn.LayerNorm(32))
    assert norm_epsilon(model[0]) == 1e-6 and norm_epsilon(model[1]) is None and norm_epsilon(model[2]) is None
    assert compile_rms_norms(model) == 0
    assert [type(m) for m in model] == [OnePlusWeightRMSNorm, BiasedRMSNorm, nn.LayerNorm]


@needs_x86
def test_the_swapped_norm_runs_torchs_ops_where_it_does_not_compile(module):
    target = tiny_target(layers=1)
    compile_rms_norms(target)
    norm = target.model.norm
    assert isinstance(norm, CompiledRMSNorm)
    long = rows_with_outliers((MAX_COMPILED_ROWS + 7, 64), torch.float32)[2:3]  # a prefill's rows: torch's ops
    assert torch.equal(norm(long), llama_rms_norm(long, norm.weight.detach(), norm.eps))
    x = torch.randn(3, 64, requires_grad=True)  # autograd: torch's ops, and gradients reach the weight
    norm(x).sum().backward()
    reference_weight = norm.weight.detach().clone().requires_grad_(True)
    llama_rms_norm(x.detach(), reference_weight, norm.eps).sum().backward()
    assert norm.weight.grad is not None and torch.equal(norm.weight.grad, reference_weight.grad)
    with torch.no_grad():
        assert torch.equal(norm(x), module.rms_norm(x.detach(), norm.weight, norm.eps, TORCH_SUM_LANES))


def test_nothing_is_swapped_when_the_ops_are_switched_off(monkeypatch, fresh_extension_probes):
    monkeypatch.setenv("EAGLE_DROPMATCH_DRAFT_OPS_EXTENSION", "0")
    target = tiny_target(layers=2)
    assert compile_rms_norms(target) == 0
    assert not any(isinstance(m, CompiledRMSNorm) for m in target.modules())


@needs_x86
def test_load_compiles_the_targets_norms_and_decodes_as_the_stock_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", progress=False)
    assert model.compiled_norms == 2 * 8 + 1
    stock = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir / "target")).eval()
    prompt = model.chat_ids([{"role": "user", "content": "Say hi."}])
    expected = greedy_reference(stock, prompt, 24)
    eos = set(model.decoder.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
    for kwargs in ({"baseline": True}, {}):
        assert model.generate(prompt, max_new_tokens=24, **kwargs).token_ids == expected[:cut]
