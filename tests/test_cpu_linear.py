"""Linear layers on prepacked oneDNN weights (``cpu_linear``): the stock layers' outputs, bit for bit."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from eagle_dropmatch import cpu_linear
from eagle_dropmatch.cpu_linear import PrepackedLinear, prepack_available, prepack_linears, prepack_wanted
from eagle_dropmatch.loading import LoadError, load

from conftest import tiny_target

needs_ops = pytest.mark.skipif(not prepack_available(), reason="this torch build lacks the oneDNN linear ops")


def bf16_linear(inputs: int, outputs: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(inputs, outputs, bias=bias).to(torch.bfloat16).eval()


@needs_ops
@pytest.mark.parametrize("inputs,outputs,bias", [(64, 96, False), (64, 96, True), (576, 1536, False),
                                                 (96, 7, True)])
@pytest.mark.parametrize("shape", [(1,), (8,), (29,), (2, 5)])
def test_a_prepacked_linear_gives_the_stock_output_bit_for_bit(inputs, outputs, bias, shape):
    linear = bf16_linear(inputs, outputs, bias)
    packed = PrepackedLinear(linear)
    x = torch.randn(*shape, inputs, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(x)
        assert out.shape == (*shape, outputs) and out.dtype == torch.bfloat16
        assert torch.equal(out, F.linear(x, linear.weight, linear.bias))


@needs_ops
def test_a_prepacked_linear_off_its_path_runs_the_stock_layer():
    converted = PrepackedLinear(bf16_linear(32, 16, True)).float()  # e.g. model.float() after loading
    x32 = torch.randn(3, 32)
    assert torch.equal(converted(x32), F.linear(x32, converted.weight, converted.bias))
    linear = bf16_linear(32, 16, True)
    packed = PrepackedLinear(linear)
    x = torch.randn(3, 32).to(torch.bfloat16).requires_grad_()
    packed(x).float().sum().backward()  # with gradients it is F.linear, so they flow to input and weight
    reference = x.detach().clone().requires_grad_()
    F.linear(reference, linear.weight.detach(), linear.bias.detach()).float().sum().backward()
    assert torch.equal(x.grad, reference.grad) and linear.weight.grad is not None


@needs_ops
def test_a_weight_changed_after_packing_is_packed_again():
    linear = bf16_linear(48, 40, True)
    packed = PrepackedLinear(linear)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        before = packed(x)
        linear.weight.mul_(-2)  # in place: the version counter moves
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias)) and not torch.equal(packed(x), before)
        linear.weight.data = torch.randn(40, 48).to(torch.bfloat16)  # a new storage
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        linear.bias.add_(1)  # the bias is read at every call
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


@needs_ops
def test_a_prepacked_linear_survives_a_deep_copy_and_a_pickle(tmp_path):
    import copy
    packed = PrepackedLinear(bf16_linear(48, 40, False))
    x = torch.randn(3, 48).to(torch.bfloat16)
    torch.save(packed, tmp_path / "layer.pt")
    with torch.no_grad():
        for other in (copy.deepcopy(packed), torch.load(tmp_path / "layer.pt", weights_only=False)):
            assert other.weight is not packed.weight and torch.equal(other(x), packed(x))


@needs_ops
def test_prepacking_a_target_keeps_its_parameters_tied_and_named():
    target = tiny_target()
    target.config.tie_word_embeddings = True
    target.lm_head.weight = target.model.embed_tokens.weight
    target = target.to(torch.bfloat16)
    keys = sorted(target.state_dict())
    stock = sum(type(m) is nn.Linear for m in target.modules())
    assert prepack_linears(target) == stock > 0
    assert not any(type(m) is nn.Linear for m in target.modules())
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert sorted(target.state_dict()) == keys


@needs_ops
def test_a_shape_whose_packed_output_differs_keeps_its_stock_layers(monkeypatch):
    target = tiny_target().to(torch.bfloat16)
    mlp = target.model.layers[0].mlp
    gate_shape = (mlp.gate_proj.in_features, mlp.gate_proj.out_features)
    monkeypatch.setattr(cpu_linear, "packed_matches",
                        lambda linear, packed: (linear.in_features, linear.out_features) != gate_shape)
    swapped = prepack_linears(target)
    kinds = {name: type(m) for name, m in target.named_modules() if name.endswith(("gate_proj", "up_proj", "q_proj"))}
    assert all(kind is nn.Linear for name, kind in kinds.items() if not name.endswith("q_proj"))
    assert all(kind is PrepackedLinear for name, kind in kinds.items() if name.endswith("q_proj"))
    assert swapped == sum(type(m) is PrepackedLinear for m in target.modules()) > 0


def test_prepack_wanted_by_mode(monkeypatch):
    monkeypatch.setattr(cpu_linear, "prepack_available", lambda: True)
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    assert not prepack_wanted("off", torch.bfloat16, "cpu")
    assert not prepack_wanted("auto", torch.bfloat16, "cpu")  # emulated bf16: unmeasured, left stock
    assert prepack_wanted("on", torch.bfloat16, "cpu")
    assert not prepack_wanted("auto", torch.float32, "cpu") and not prepack_wanted("auto", torch.bfloat16, "cuda")
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    assert prepack_wanted("auto", torch.bfloat16, "cpu")
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cuda"), (torch.bfloat16, "auto")):
        with pytest.raises(ValueError, match="cpu-prepack on packs bf16 weights on the CPU"):
            prepack_wanted("on", dtype, device)
    with pytest.raises(ValueError, match="cpu-prepack must be one of auto, on, off"):
        prepack_wanted("always", torch.bfloat16, "cpu")
    from eagle_dropmatch import gen
    choices = next(a.choices for a in gen.build_parser()._actions if a.dest == "cpu_prepack")
    assert tuple(choices) == cpu_linear.PREPACK_MODES  # gen spells them out so that parsing imports no torch
    monkeypatch.setattr(cpu_linear, "prepack_available", lambda: False)
    assert not prepack_wanted("auto", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="lacks"):
        prepack_wanted("on", torch.bfloat16, "cpu")


@needs_ops
def test_a_prepacked_model_decodes_the_same_tokens(tiny_model_dir):
    d = tiny_model_dir
    packed = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="on")
    stock = load(d / "target", d / "head", dtype="bfloat16", cpu_prepack="off")
    assert packed.prepacked == sum(type(m) is PrepackedLinear for m in (*packed.target.modules(), *packed.head.modules()))
    assert packed.prepacked > 0 and stock.prepacked == 0
    assert type(stock.target.lm_head) is nn.Linear
    prompt = packed.chat_ids([{"role": "user", "content": "Say something long."}])
    for settings in ({"baseline": True}, {}, {"dropmatch_k": 5, "dropout_p": 0.3}, {"temperature": 0.8, "seed": 3}):
        a, b = packed.generate(prompt, max_new_tokens=24, **settings), stock.generate(prompt, max_new_tokens=24, **settings)
        assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths, settings
    other = packed.with_head(d / "head")
    assert other.prepacked > packed.prepacked and type(other.head.lm_head) is PrepackedLinear


def test_load_refuses_prepacking_an_fp32_model_in_one_line(tiny_model_dir):
    with pytest.raises(LoadError, match="cpu-prepack on packs bf16 weights on the CPU"):
        load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", cpu_prepack="on")
