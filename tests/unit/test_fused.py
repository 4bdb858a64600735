"""`fused_linear`: oneDNN's fused kernel in CPU inference, the module's own call everywhere else, the same result.

Each rule here is as it is where `few_rows`' kernels are not available (no compiler): the paths through oneDNN and
MKL. The rules with those kernels are tested in test_few_rows.py."""

import dataclasses
import math

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from roformer_hf import fused
from roformer_hf.fused import fused_linear

pytestmark = pytest.mark.skipif(fused._KERNEL is None, reason="this torch has no oneDNN linear kernel")


class CountingKernel:
    """Stands in for `fused._KERNEL`: counts the calls and runs the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, *args):
        self.calls.append(args[3])  # the activation's name
        return self.kernel(*args)

    def binary(self, *args):
        self.calls.append(args[4])  # "add"
        return self.kernel.binary(*args)


def without_few_rows(rule):
    return dataclasses.replace(rule, few_rows_max_rows=0, bf16_few_rows_max_rows=0)


@pytest.fixture(autouse=True)
def onednn_rule(monkeypatch):
    monkeypatch.setattr(fused, "RULE", without_few_rows(fused.RULE))


@pytest.fixture
def kernel(monkeypatch):
    counting = CountingKernel(fused._KERNEL)
    monkeypatch.setattr(fused, "_KERNEL", counting)
    return counting


# Each CPU kind's rule (`fused.DenseRule`), tested on any CPU: what a rule picks computes the same thing everywhere.
RULES = [pytest.param(without_few_rows(rule), id=rule.cpu) for rule in fused.RULES]
GELU_CALL = "gelu" if fused.RULE.fuses_gelu else "none"  # the name oneDNN's call gets for a GELU on this CPU


def reference(layer, x, activation=None, residual=None):
    output = nn.functional.linear(x.double(), layer.weight.double(),
                                  None if layer.bias is None else layer.bias.double())
    if activation is not None:
        output = activation(output)
    return output if residual is None else residual.double() + output


def layer_and_input(shape=(5, 8), bias=True):
    torch.manual_seed(0)
    return nn.Linear(8, 6, bias=bias), torch.randn(*shape)


@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8), (0, 8)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", ["plain", "gelu", "relu", "residual", "residual after inactive dropout"])
def test_the_kernel_computes_what_the_module_would(kernel, shape, bias, case):
    layer, x = layer_and_input(shape, bias)
    activation = {"gelu": ACT2FN["gelu"], "relu": ACT2FN["relu"],
                  "residual after inactive dropout": nn.Dropout(0.1).eval()}.get(case)
    residual = torch.randn(*shape[:-1], 6) if case.startswith("residual") else None
    with torch.inference_mode():
        actual = fused_linear(layer, x, activation, residual)
    expected = reference(layer, x, None if case.startswith("residual") else activation, residual)
    torch.testing.assert_close(actual, expected.float(), atol=1e-5, rtol=1e-5)
    assert kernel.calls == [{"gelu": GELU_CALL, "relu": "relu"}.get(case, "add" if residual is not None else "none")]


def test_bf16_is_fused_within_bf16_error_where_onednn_has_bf16(kernel):
    layer, x = layer_and_input((64, 8))
    with torch.no_grad():
        actual = fused_linear(layer.bfloat16(), x.bfloat16(), ACT2FN["gelu"])
    torch.testing.assert_close(actual.float(), reference(layer, x, ACT2FN["gelu"]).float(), atol=0.05, rtol=0.02)
    # CPUs without AVX-512 have no oneDNN bf16 GEMM: the module runs instead.
    assert kernel.calls == ([GELU_CALL] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("rows", [1, 16, 600])
def test_gelu_is_applied_by_onednn_or_after_its_product_as_the_rule_says(kernel, monkeypatch, rule, rows):
    """A CPU whose oneDNN computes GELU slowly as a post-op (AVX2 only) applies it after the product: the same
    activation either way."""
    monkeypatch.setattr(fused, "RULE", rule)
    torch.manual_seed(rows)
    layer, x = nn.Linear(32, 48), torch.randn(rows, 32)
    with torch.inference_mode():
        fused_linear(layer, x)  # the packing call, where the rule packs
        kernel.calls.clear()
        actual = fused_linear(layer, x, ACT2FN["gelu"])
    torch.testing.assert_close(actual, reference(layer, x, ACT2FN["gelu"]).float(), atol=1e-5, rtol=1e-5)
    module = rule.one_row == "module" if rows == 1 else rows > rule.packed_max_rows and rule.beyond == "module"
    assert kernel.calls == ([] if module else ["gelu" if rule.fuses_gelu else "none"])


def test_autograd_takes_the_module_where_the_rule_does_not_train_on_onednn(kernel, monkeypatch):
    """The fused kernel has no backward: with autograd the layer's own call, or `_TrainedLinear` (the activation
    applied after it) where the CPU's rule trains on oneDNN."""
    for trains in (False, True):
        least = 0 if trains else math.inf
        monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.RULE, onednn_training_macs=least))
        kernel.calls.clear()
        layer, x = layer_and_input()
        output = fused_linear(layer, x, ACT2FN["gelu"])
        output.sum().backward()
        assert kernel.calls == (["none", "none"] if trains else [])  # the forward, the weight's gradient
        assert layer.weight.grad is not None
        torch.testing.assert_close(output.detach(), reference(layer, x, ACT2FN["gelu"]).float())


def test_a_bias_that_is_not_a_parameter_leaves_the_layer_its_own_call(kernel):
    layer, x = layer_and_input()
    bias = torch.randn(layer.out_features)
    del layer.bias
    layer.bias = bias  # a plain attribute, which `nn.Linear.forward` reads
    with torch.no_grad():
        assert torch.equal(fused_linear(layer, x), nn.functional.linear(x, layer.weight, bias))
    del layer.bias  # no bias at all: the module's own error
    with torch.no_grad(), pytest.raises(AttributeError, match="bias"):
        fused_linear(layer, x)
    assert kernel.calls == []


def test_hooks_see_their_calls(kernel):
    layer, x = layer_and_input()
    activation, seen = ACT2FN["gelu"], []
    handle = activation.register_forward_hook(lambda module, args, output: seen.append("activation"))
    with torch.no_grad():
        fused_linear(layer, x, activation)
    handle.remove()
    layer.register_forward_pre_hook(lambda module, args: seen.append("layer"))
    with torch.no_grad():
        fused_linear(layer, x)
    assert seen == ["activation", "layer"] and kernel.calls == []


def test_global_hooks_and_replaced_forwards_see_their_calls(kernel):
    layer, x = layer_and_input()
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: seen.append(type(module)))
    try:
        with torch.no_grad():
            fused_linear(layer, x)
    finally:
        handle.remove()
    layer.forward = lambda inputs: seen.append("replaced forward") or nn.Linear.forward(layer, inputs)
    with torch.no_grad():
        fused_linear(layer, x)
    assert seen == [nn.Linear, "replaced forward"] and kernel.calls == []


def test_what_the_kernel_cannot_compute_takes_the_module(kernel):
    class Adapter(nn.Linear):  # e.g. LoRA's layer: a subclass with a forward of its own
        def forward(self, inputs):
            return super().forward(inputs) + 1

    layer, x = layer_and_input()
    adapter = Adapter(8, 6)
    adapter.load_state_dict(layer.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fused_linear(adapter, x), reference(layer, x).float() + 1)
        torch.testing.assert_close(fused_linear(layer.double(), x.double()), reference(layer, x))  # float64
        torch.testing.assert_close(fused_linear(layer.float(), x, ACT2FN["silu"]),  # no fused form
                                   reference(layer, x, ACT2FN["silu"]).float())
        residual = torch.randn(5, 6)  # an activation and a residual: one fused step only
        torch.testing.assert_close(fused_linear(layer, x, ACT2FN["gelu"], residual),
                                   reference(layer, x, ACT2FN["gelu"], residual).float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fused_linear(layer, x).dtype == torch.bfloat16
    assert kernel.calls == []


def test_dropout_in_training_is_applied_not_fused(kernel):
    layer, x = layer_and_input((200, 8))
    residual = torch.zeros(200, 6)
    with torch.no_grad():
        output = fused_linear(layer, x, nn.Dropout(0.5).train(), residual)
    dropped = output == 0
    assert 0.3 < dropped.float().mean() < 0.7 and kernel.calls == []
    torch.testing.assert_close(output[~dropped], 2 * reference(layer, x).float()[~dropped])


PACKED_CASES = [("fp32", rows) for rows in (2, 5, 16, 37, 130, min(fused.RULE.packed_max_rows, 300))] + [
    pytest.param("bf16", rows, marks=pytest.mark.skipif(not fused._BF16_GEMMS, reason="no oneDNN bf16 GEMM here"))
    for rows in (1, 2, 16, 300)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize(("dtype", "rows"), PACKED_CASES)
@pytest.mark.parametrize("case", ["none", "gelu", "relu", "residual"])
def test_a_packed_weight_gives_the_bits_of_the_layers_own(dtype, rows, case):
    torch.manual_seed(rows)
    layer, x = nn.Linear(48, 80).to(DTYPES[dtype]), torch.randn(rows, 48, dtype=DTYPES[dtype])
    activation = {"none": None, "gelu": ACT2FN["gelu"], "relu": nn.ReLU(), "residual": None}[case]
    residual = torch.randn(rows, 80, dtype=x.dtype) if case == "residual" else None
    name, algorithm = {"none": ("none", ""), "gelu": ("gelu", "none"), "relu": ("relu", "")}.get(case, ("none", ""))
    with torch.inference_mode():
        if residual is not None:
            unpacked = fused._KERNEL.binary(x, residual, layer.weight, layer.bias, "add")
        elif name == "gelu" and not fused.RULE.fuses_gelu:
            unpacked = nn.functional.gelu(fused._KERNEL(x, layer.weight, layer.bias, "none", [], ""))
        else:
            unpacked = fused._KERNEL(x, layer.weight, layer.bias, name, [], algorithm)
        assert torch.equal(fused_linear(layer, x, activation, residual), unpacked)
    assert fused._PACKED[layer].weights["packed"].is_mkldnn  # it ran on the packed copy


@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
def test_the_packed_weight_follows_the_weight_it_was_packed_from(monkeypatch):
    monkeypatch.setattr(fused, "RULE", without_few_rows(fused.AVX512_RULE))  # one fp32 row: oneDNN's kernel on the layer's own weight
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 8), torch.randn(4, 16)
    with torch.inference_mode():
        fused_linear(layer, x)
        packed = fused._PACKED[layer].weights["packed"]
        fused_linear(layer, x)
        assert fused._PACKED[layer].weights["packed"] is packed  # packed once, reused
        with torch.no_grad():
            layer.weight.mul_(-2)  # an in-place update (an optimizer step, load_state_dict)
        torch.testing.assert_close(fused_linear(layer, x), reference(layer, x).float(), atol=1e-5, rtol=1e-5)
        one_row = fused_linear(layer, x[:1])  # a matrix-vector product: the layer's own weight
        assert torch.equal(one_row, fused._KERNEL(x[:1], layer.weight, layer.bias, "none", [], ""))
    layer.weight = nn.Parameter(torch.randn(8, 16))  # a new tensor
    with torch.inference_mode():
        torch.testing.assert_close(fused_linear(layer, x), reference(layer, x).float(), atol=1e-5, rtol=1e-5)
        layer.weight = nn.Parameter(torch.randn(8, 16))  # made in inference mode: changes in place go uncounted
        assert torch.equal(fused_linear(layer, x), fused._KERNEL(x, layer.weight, layer.bias, "none", [], ""))
    packs = len(fused._PACKED)
    del layer
    assert len(fused._PACKED) == packs - 1  # dropped with its layer


@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
def test_an_in_place_edit_of_rows_the_samples_miss_is_followed():
    """A weight edited in place under `torch.no_grad()` (the documented way to edit one) counts the change, so the
    packed copy follows it even where the sampled entries cannot see it."""
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 64), torch.randn(16, 64)
    with torch.inference_mode():
        fused_linear(layer, x)  # packed
    sampled = torch.zeros(64 * 64, dtype=torch.bool)
    sampled[fused._sample(torch.arange(64 * 64)).flatten()] = True
    assert not sampled.view(64, 64)[1].any()  # row 1 lies between the sampled runs
    with torch.no_grad():
        layer.weight[1] = 3.0
    with torch.inference_mode():
        torch.testing.assert_close(fused_linear(layer, x), reference(layer, x).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize("change", ["fused AdamW step", "a write through .data", "an adapter merged through .data"])
@pytest.mark.parametrize("side_by_side", [False, True])
def test_the_packed_weight_follows_changes_that_leave_the_version_count_alone(change, side_by_side):
    """torch's fused AdamW (Trainer's default) and writes through ``.data`` do not count as in-place changes of the
    weight; the packed copy must follow them anyway, or inference after training would run on the old weights."""
    torch.manual_seed(0)
    layers, x = (nn.Linear(64, 48), nn.Linear(64, 48)), torch.randn(16, 64)

    def outputs():
        with torch.inference_mode():
            return fused.fused_linears(layers, x) if side_by_side else (fused_linear(layers[0], x),)

    outputs()  # packed
    assert (layers[0] in fused._PACKED_SIDE_BY_SIDE) if side_by_side else (layers[0] in fused._PACKED)
    versions = [layer.weight._version for layer in layers]
    if change == "fused AdamW step":
        optimizer = torch.optim.AdamW([p for layer in layers for p in layer.parameters()], lr=0.1, fused=True)
        sum(layer(x).sum() for layer in layers).backward()
        optimizer.step()
    elif change == "a write through .data":
        layers[-1 if side_by_side else 0].weight.data.copy_(torch.randn(48, 64))
    else:
        layers[0].weight.data += 0.01 * torch.randn(48, 4) @ torch.randn(4, 64)
    assert [layer.weight._version for layer in layers] == versions  # the count did not see it
    for output, layer in zip(outputs(), layers):
        torch.testing.assert_close(output, reference(layer, x).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES)
def test_one_fp32_row_takes_the_rules_kernel(kernel, monkeypatch, rule):
    """MKL's matrix-vector product on Intel CPUs, oneDNN's on the layer's own weight elsewhere."""
    monkeypatch.setattr(fused, "RULE", rule)
    torch.manual_seed(0)
    layer, x, activation = nn.Linear(16, 8), torch.randn(1, 1, 16), ACT2FN["gelu"]
    residual = torch.randn(1, 1, 8)
    with torch.inference_mode():
        activated, added = fused_linear(layer, x, activation), fused_linear(layer, x, None, residual)
    onednn = ["gelu" if rule.fuses_gelu else "none", "add"]
    assert kernel.calls == ([] if rule.one_row == "module" else onednn) and layer not in fused._PACKED
    torch.testing.assert_close(activated, reference(layer, x, activation).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(added, reference(layer, x, None, residual).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize("rule", RULES)
def test_long_fp32_inputs_take_the_rules_kernel(monkeypatch, rule):
    """Past the rows a rule packs for: the packed weight on Intel CPUs, oneDNN on the layer's own weight on AMD's
    with AVX-512 (no second copy of the weight for bulk inference), MKL's GEMM (the module's call) with AVX2 only."""
    monkeypatch.setattr(fused, "RULE", rule)
    layer, x = nn.Linear(16, 8), torch.randn(513, 16)
    with torch.inference_mode():
        output = fused_linear(layer, x)
    assert (layer in fused._PACKED) == (rule.packed_max_rows >= 513)
    if rule.packed_max_rows >= 513 or rule.beyond == "onednn":  # the packed weight gives the unpacked one's bits
        assert torch.equal(output, fused._KERNEL(x, layer.weight, layer.bias, "none", [], ""))
    else:
        assert torch.equal(output, nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("after", ["gelu", "relu", "residual"])
def test_rows_the_rule_hands_to_the_module_get_its_bits_and_leave_the_inputs_alone(monkeypatch, after):
    """Past a rule's packed rows, where it names the layer's own call (MKL's GEMM), that call runs and the activation
    or residual is applied to its output in place: the bits of the module path, and neither the input nor the residual
    changes."""
    rule = dataclasses.replace(without_few_rows(fused.AVX2_RULE), packed_max_rows=512, beyond="module")
    monkeypatch.setattr(fused, "RULE", rule)
    torch.manual_seed(0)
    layer, x = nn.Linear(32, 48), torch.randn(600, 32)
    residual = torch.randn(600, 48) if after == "residual" else None
    activation = {"gelu": ACT2FN["gelu"], "relu": nn.ReLU(), "residual": None}[after]
    given = (x.clone(), None if residual is None else residual.clone())
    with torch.inference_mode():
        output = fused_linear(layer, x, activation, residual)
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        expected = activation(expected) if activation is not None else residual + expected
    assert torch.equal(output, expected)
    assert torch.equal(x, given[0]) and (residual is None or torch.equal(residual, given[1]))
    assert layer not in fused._PACKED


@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize(("dtype", "rows"), [("fp32", rows) for rows in (1, 2, 16, 256, 257, 513)]
                         + [pytest.param("bf16", rows, marks=pytest.mark.skipif(not fused._BF16_GEMMS,
                                                                                reason="no oneDNN bf16 GEMM here"))
                            for rows in (1, 16, 257)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rule", RULES)
def test_layers_on_one_input_give_the_bits_of_each_alone(monkeypatch, rule, dtype, rows, bias):
    monkeypatch.setattr(fused, "RULE", rule)
    torch.manual_seed(rows)
    layers = tuple(nn.Linear(32, out, bias=bias).to(DTYPES[dtype]) for out in (32, 16, 16))
    x = torch.randn(rows, 32, dtype=DTYPES[dtype])
    with torch.inference_mode():
        alone = [fused_linear(layer, x) for layer in layers]
        together = fused.fused_linears(layers, x)
        assert all(torch.equal(a, b) for a, b in zip(alone, together))
        packed = dtype == "bf16" or 1 < rows <= rule.packed_max_rows
        assert (layers[0] in fused._PACKED_SIDE_BY_SIDE) == packed
        with torch.no_grad():
            layers[2].weight.add_(1.0)  # the side-by-side copy follows each layer's weight
            if bias:
                layers[1].bias.sub_(1.0)
        expected = [reference(layer, x).float() for layer in layers]
        tolerance = 1e-5 if dtype == "fp32" else 0.1
        for output, want in zip(fused.fused_linears(layers, x), expected):
            torch.testing.assert_close(output.float(), want, atol=tolerance, rtol=tolerance)


def test_layers_with_and_without_bias_are_not_packed_together(kernel):
    layers, x = (nn.Linear(8, 8), nn.Linear(8, 4, bias=False)), torch.randn(5, 8)
    with torch.inference_mode():
        outputs = fused.fused_linears(layers, x)
    for output, layer in zip(outputs, layers):
        torch.testing.assert_close(output, reference(layer, x).float(), atol=1e-5, rtol=1e-5)
    assert layers[0] not in fused._PACKED_SIDE_BY_SIDE and kernel.calls == ["none", "none"]


def test_each_layer_of_a_forward_decides_for_itself(kernel):
    """In inference every dense layer of the model takes the kernel, except one with a hook of its own, which is
    called (the hook runs), and the output is the module path's."""
    import roformer_hf

    config = roformer_hf.RoFormerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=24)
    torch.manual_seed(0)
    model = roformer_hf.RoFormerModel(config).eval()
    input_ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        expected = model(input_ids).last_hidden_state
    assert len(kernel.calls) == 2 * 4  # per layer: q/k/v side by side, attention output, FFN up, FFN down
    seen = []
    model.encoder.layer[1].intermediate.dense.register_forward_hook(lambda *args: seen.append("hooked layer"))
    calls = len(kernel.calls)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids).last_hidden_state, expected, atol=1e-5, rtol=1e-5)
    assert seen == ["hooked layer"] and len(kernel.calls) == 2 * calls - 1  # all but the hooked one fused


def tiny_model():
    import roformer_hf

    config = roformer_hf.RoFormerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=24)
    torch.manual_seed(0)
    return roformer_hf.RoFormerModel(config).eval(), torch.randint(0, 50, (2, 7))


def module_path(model, input_ids):
    """The model's output with oneDNN off: every dense layer's own call."""
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        return model(input_ids).last_hidden_state


def test_a_models_later_forwards_take_the_calls_checked_at_their_start(kernel, monkeypatch):
    """The dense calls that took the packed kernel in a model's forward are checked together at the start of its
    next forward, which decides `fusion_applies` once for all of them, and they give the bits they gave before."""
    model, input_ids = tiny_model()
    with torch.inference_mode():
        first = model(input_ids).last_hidden_state  # each call decides for itself, and is noted
        decisions = []
        decide = fused.fusion_applies
        monkeypatch.setattr(fused, "fusion_applies", lambda *args: decisions.append(args) or decide(*args))
        second = model(input_ids).last_hidden_state
    assert torch.equal(first, second)
    assert len(decisions) == 1 and len(kernel.calls) == 2 * 2 * 4  # per layer: q/k/v, output, FFN up, FFN down
    torch.testing.assert_close(second, module_path(model, input_ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change", ["fused AdamW step", "a write through .data", "a hook on a dense layer",
                                    "a dense layer replaced", "the value layer replaced", "the dropout trained",
                                    "a bias replaced", "a bias side by side written through .data"])
def test_what_changes_between_forwards_is_followed(kernel, change):
    """Whatever changed since a model's last forward (weights written without a count, hooks, layers, modes), its
    next forward computes what the layers compute now."""
    model, input_ids = tiny_model()
    with torch.inference_mode():
        model(input_ids)  # the calls noted
        model(input_ids)  # and checked at the forward's start
    seen = []
    replaced = []  # kept alive: the calls noted with them still check, but are not the calls made now
    layer = model.encoder.layer[0]
    if change == "fused AdamW step":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        model.train()
        model(input_ids).last_hidden_state.sum().backward()
        optimizer.step()
        model.eval()
    elif change == "a write through .data":
        layer.intermediate.dense.weight.data.copy_(torch.randn(24, 16))
    elif change == "a bias replaced":
        layer.output.dense.bias = nn.Parameter(torch.randn(16))
    elif change == "a bias side by side written through .data":
        layer.attention.self.key.bias.data.copy_(torch.randn(16))
    elif change == "a hook on a dense layer":
        layer.output.dense.register_forward_hook(lambda *args: seen.append("hooked"))
    elif change == "a dense layer replaced":
        replaced.append(layer.output.dense)
        layer.output.dense = nn.Linear(24, 16)
    elif change == "the value layer replaced":
        replaced.append(layer.attention.self.value)
        layer.attention.self.value = nn.Linear(16, 16)
    else:  # its residual add can no longer be fused: dropout applies, at p=1 all of the sublayer's output
        replaced.append(layer.attention.output.dropout)
        layer.attention.output.dropout = nn.Dropout(1.0).train()
    with torch.inference_mode():
        output = model(input_ids).last_hidden_state
    assert seen == (["hooked"] if change == "a hook on a dense layer" else [])
    torch.testing.assert_close(output, module_path(model, input_ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("avx512", "vendor", "family", "amx", "limit", "expected"), [
    (True, "GenuineIntel", 6, False, "", fused.INTEL_RULE), (True, "GenuineIntel", 6, True, "", fused.INTEL_AMX_RULE),
    (True, "AuthenticAMD", 25, False, "", fused.AVX512_RULE), (True, "AuthenticAMD", 26, False, "", fused.ZEN5_RULE),
    (False, "AuthenticAMD", 25, False, "", fused.AVX2_RULE), (False, "GenuineIntel", 6, False, "", fused.AVX2_RULE),
    (True, "GenuineIntel", 6, True, "avx2", fused.AVX2_RULE), (True, "AuthenticAMD", 26, False, "AVX2", fused.AVX2_RULE),
    (True, "AuthenticAMD", 25, False, "AVX512_CORE", fused.AVX512_RULE)])
def test_the_rule_follows_the_cpus_vendor_and_what_onednn_may_run(monkeypatch, avx512, vendor, family, amx, limit,
                                                                 expected):
    """A CPU without AVX-512, or oneDNN held below it (``ONEDNN_MAX_CPU_ISA``), takes the AVX2 rule whatever its
    vendor; with AVX-512 the vendor picks Intel's or AMD's, Intel's whether the CPU has AMX, and AMD's family Zen 4's
    or Zen 5's."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512, raising=False)
    monkeypatch.setattr(fused, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(fused, "cpu_family", lambda: family)
    monkeypatch.setattr(fused, "cpu_has", lambda *flags: amx and set(flags) <= {"amx_bf16", "amx_int8", "amx_tile"})
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert fused.dense_rule() is expected


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_compiler_sees_gelu_written_out_where_the_rule_applies_it_after_the_product(rule, grad, monkeypatch):
    """Traced for CPU inference (`torch.export`, as the server's compiled encoder and `torch.compile` trace it), a model
    on a CPU kind whose rule applies GELU after oneDNN's product (AVX2 only) holds GELU written out (erf), which
    inductor does not fuse into the GEMM before it; elsewhere, and with autograd on, ``aten.gelu``. Every graph
    answers as the eager model, whose GELU modules stay as they were."""
    from transformers.activations import GELUActivation

    from roformer_hf import RoFormerConfig, RoFormerForMaskedLM

    monkeypatch.setattr(fused, "RULE", rule)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=48,
                                               max_position_embeddings=64)).eval()
    ids = torch.randint(5, 97, (1, 7))
    with torch.set_grad_enabled(grad):
        expected = model(input_ids=ids).logits
        program = torch.export.export(model, (), {"input_ids": ids})
        got = program.module()(input_ids=ids).logits
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    written_out = not rule.fuses_gelu and not grad
    # both layers' FFN and the MLM head's transform: GELU written out, or none of them
    assert ("aten.gelu.default" in ops, "aten.erf.default" in ops) == (not written_out, written_out), ops
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    gelus = [layer for layer in model.modules() if isinstance(layer, GELUActivation)]
    assert len(gelus) == 3 and all(gelu.act is nn.functional.gelu for gelu in gelus)



@pytest.fixture
def trains_on_onednn(monkeypatch):
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.RULE, onednn_training_macs=0))


@pytest.mark.parametrize("leading", [(7,), (2, 9), (1, 1)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("needs", ["all", "frozen weight", "input without grad"])
def test_training_through_onednn_gives_the_float64_gradients(trains_on_onednn, leading, bias, needs):
    """Where the rule trains on oneDNN, a plain layer's call records `_TrainedLinear`, whose output and gradients
    (input, weight, bias, as far as each is asked for) are float64 autograd's through `nn.Linear`."""
    torch.manual_seed(len(leading) * 10 + bias)
    layer = nn.Linear(24, 13, bias=bias)
    layer.weight.requires_grad_(needs != "frozen weight")
    x = torch.randn(*leading, 24, requires_grad=needs != "input without grad")
    output = fused_linear(layer, x, ACT2FN["gelu"], None)
    assert type(output.grad_fn.next_functions[0][0]).__name__ == "_TrainedLinearBackward"
    grad = torch.randn_like(output)
    output.backward(grad)
    reference = nn.Linear(24, 13, bias=bias).double()
    reference.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_()
    expected = ACT2FN["gelu"](reference(x64))
    expected.backward(grad.double())
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    pairs = [(x.grad, x64.grad), (layer.weight.grad, reference.weight.grad)]
    if bias:
        pairs.append((layer.bias.grad, reference.bias.grad))
    for actual, wanted in pairs:
        if wanted is not None and (actual is not None or needs == "all"):
            torch.testing.assert_close(actual.double(), wanted, atol=1e-5, rtol=1e-5)
    assert (x.grad is None) == (needs == "input without grad")
    assert (layer.weight.grad is None) == (needs == "frozen weight")


def test_gradients_of_gradients_through_onednn_are_autograds(trains_on_onednn):
    """A recorded backward pass (``create_graph=True``) goes through differentiable ops: a gradient penalty's own
    gradient is the module path's."""
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 5), torch.randn(3, 8, requires_grad=True)
    penalties = []
    for rule in (fused.RULE, dataclasses.replace(fused.RULE, onednn_training_macs=math.inf)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused, "RULE", rule)
            (grad,) = torch.autograd.grad(fused_linear(layer, x, ACT2FN["gelu"]).pow(2).sum(), x, create_graph=True)
            penalties.append(torch.autograd.grad(grad.pow(2).sum(), layer.weight)[0])
    torch.testing.assert_close(penalties[0], penalties[1], atol=1e-5, rtol=1e-5)


def test_training_through_onednn_only_where_the_module_would_compute_the_same(trains_on_onednn, monkeypatch):
    """Inference, other dtypes, autocast, hooked layers, calls smaller than the rule's least, and rules without it
    take the layer's own call."""
    layer, x = nn.Linear(8, 4), torch.randn(3, 8, requires_grad=True)

    def recorded(call=lambda: fused_linear(layer, x)):
        output = call()
        return output.grad_fn is not None and type(output.grad_fn).__name__ == "_TrainedLinearBackward"

    assert recorded()
    with torch.no_grad():
        assert not recorded()
    assert not recorded(lambda: fused_linear(layer.double(), x.double()))
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not recorded()
    handle = layer.register_forward_hook(lambda *args: None)
    assert not recorded()
    handle.remove()
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.RULE, onednn_training_macs=3 * 8 * 4 + 1))
    assert not recorded()  # fewer multiply-adds than the rule's least
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.RULE, onednn_training_macs=3 * 8 * 4))
    assert recorded()
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.RULE, onednn_training_macs=math.inf))
    assert not recorded()
