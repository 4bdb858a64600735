"""`few_rows`: the GEMM for fp32 inputs of few rows, against float64 products, and the AVX2 rule that hands it the
dense layers of short inputs; the int8 GEMM, against exact integer products."""

import dataclasses
import itertools
import logging

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from roformer_hf import few_rows, fused
from roformer_hf.cpu import cpu_has
from roformer_hf.fused import fused_linear, fused_linears
from roformer_hf.quantization import quantize_activations

needs_kernel = pytest.mark.skipif(not few_rows.available(), reason=f"no few-row kernel here: {few_rows.why_not()}")


def reference(x, weight, bias=None, residual=None):
    output = nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return output if residual is None else output + residual.double()


@pytest.fixture
def avx2_rule(monkeypatch):
    monkeypatch.setattr(fused, "RULE", fused.AVX2_RULE)
    return fused.AVX2_RULE


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """`few_rows` as in a new process, building into an empty cache under `tmp_path`."""
    monkeypatch.setattr(few_rows, "_state", {})
    monkeypatch.setenv("ROFORMER_HF_CACHE", str(tmp_path))
    return tmp_path


def counting_kernel_calls(patch: pytest.MonkeyPatch, function: str) -> list[int]:
    """A list that grows by one at each call of `few_rows`' kernel `function` (``"linear"``, ``"bf16_linear"``,
    ``"int8_linear"``), however it is reached (the function itself, or a call bound by `few_rows.bind_linear`)."""
    calls, checked_inputs = [], few_rows._checked_inputs

    def counted(name, *args):
        calls.extend([1] if name == function else [])
        return checked_inputs(name, *args)
    patch.setattr(few_rows, "_checked_inputs", counted)
    return calls


@needs_kernel
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 1, 1), (1, 64, 13), (1, 67, 19), (2, 5, 6), (7, 33, 7), (8, 64, 12), (9, 17, 5), (16, 64, 50), (17, 8, 13),
    (24, 40, 31), (40, 3, 19), (100, 64, 6), (256, 24, 31), (17, 600, 200), (24, 1030, 97)])
@pytest.mark.parametrize(("bias", "residual"), [(True, False), (False, False), (True, True), (False, True)])
def test_the_product_is_the_float64_products_at_any_shape(rows, in_features, out_features, bias, residual):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    leading = (rows,) if rows % 2 else (2, rows // 2)  # 2-d and 3-d inputs
    x = torch.randn(*leading, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if bias else None
    residual = torch.randn(*leading, out_features, generator=generator) if residual else None
    given = x.clone()
    output = few_rows.linear(x, few_rows.pack(weight), bias, residual)
    assert output.shape == (*leading, out_features) and torch.equal(x, given)
    torch.testing.assert_close(output.double(), reference(x, weight, bias, residual),
                               atol=1e-5 * in_features ** 0.5, rtol=1e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads():
    """Each output is summed in the same order for one vector's lanes and two, and the threads share out whole output
    features: the same bits for a row in any batch of 2 to 72 rows, on one thread, two or three. One row alone is
    summed in an order of its own (interleaved sums), the same on any number of threads."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(72, 99, generator=generator), torch.randn(70, 99, generator=generator)
    packed = few_rows.pack(weight)
    whole, alone = few_rows.linear(x, packed, None), few_rows.linear(x[:1], packed, None)
    assert all(torch.equal(few_rows.linear(x[:rows], packed, None), whole[:rows]) for rows in range(2, 72))
    torch.testing.assert_close(alone.double(), reference(x[:1], weight), atol=1e-5, rtol=1e-5)
    assert not torch.equal(alone, whole[:1])  # the other order: this test would not see a change of path otherwise
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(few_rows.linear(x, packed, None), whole)
            assert torch.equal(few_rows.linear(x[:1], packed, None), alone)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.skipif(few_rows.isa() != "AVX-512", reason="no AVX-512 here: row_panels is the AVX-512 kernel's")
@pytest.mark.parametrize("out_features", [48, 70, 200, 500])
def test_one_row_against_four_panels_at_once_gets_the_bits_it_has_beside_other_rows(out_features):
    """With `row_panels` one row goes against up to four panels at once (four streams of the weight), each output summed
    over the input features in order: the bits it has in a batch of two, whatever the panels a thread holds (1 at 48
    output features, 2 at 70 on two threads, 3 at 500 on three) and the threads; without it, the interleaved runs' own
    order."""
    generator = torch.Generator().manual_seed(out_features)
    x, weight = torch.randn(2, 777, generator=generator), torch.randn(out_features, 777, generator=generator)
    bias, residual = torch.randn(out_features, generator=generator), torch.randn(2, out_features, generator=generator)
    packed = few_rows.pack(weight)
    beside = few_rows.linear(x[[0, 0]], packed, bias, residual[[0, 0]], "gelu")[:1]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            alone = few_rows.linear(x[:1], packed, bias, residual[:1], "gelu", row_panels=True)
            assert torch.equal(alone, beside)
    finally:
        torch.set_num_threads(threads)
    runs = few_rows.linear(x[:1], packed, bias, residual[:1], "gelu")
    assert not torch.equal(runs, beside)  # the interleaved runs: this test would not see a change of path otherwise
    torch.testing.assert_close(runs, beside, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_rows_in_several_passes_give_the_bits_of_one_pass(kind):
    """More than 8 rows go in several passes: over the whole panel, or (fp32, from 12 rows) over blocks of its steps,
    each pass carrying its float32 sums to the next block. Either way each output is summed in order, as by 2 to 8
    rows in one pass: the same bits for every row, whatever the number of rows, with a block of steps left over (1100
    fp32 inputs, 550 bf16 pairs) and several panels a thread (the next panel's first block fetched by the last
    passes)."""
    if not (few_rows.available() if kind == "fp32" else few_rows.bf16_available()):
        pytest.skip(f"the {kind} kernel is not available here: {few_rows.why_not(kind)}")
    generator = torch.Generator().manual_seed(2)
    x, weight = torch.randn(40, 1100, generator=generator), torch.randn(500, 1100, generator=generator)
    bias, residual = torch.randn(500, generator=generator), torch.randn(40, 500, generator=generator)
    if kind == "bf16":
        x, weight, bias, residual = x.bfloat16(), weight.bfloat16(), bias.bfloat16(), residual.bfloat16()
        linear, packed = few_rows.bf16_linear, few_rows.pack_bf16(weight)
    else:
        linear, packed = few_rows.linear, few_rows.pack(weight)
    # Each row in one pass: beside a copy of itself (one row alone is summed in an order of its own).
    one_pass = torch.cat([linear(x[[row, row]], packed, bias, residual[[row, row]], "gelu")[:1] for row in range(40)])
    for rows in (9, 12, 17, 40):
        whole = linear(x[:rows], packed, bias, residual[:rows], "gelu")
        assert torch.equal(whole, one_pass[:rows])
    torch.testing.assert_close(whole.double()[:, :5],
                               nn.functional.gelu(reference(x, weight, bias, residual))[:, :5],
                               atol=1e-4 if kind == "fp32" else 0.05, rtol=1e-4 if kind == "fp32" else 0.02)


@needs_kernel
@pytest.mark.parametrize(("rows", "in_features"), [(72, 3100), (100, 700), (41, 3100)])
def test_many_rows_in_groups_give_each_row_the_bits_it_has_alone(rows, in_features):
    """Many rows go in groups that a core's L2 cache holds (the AVX2 build: as many blocks of 16 rows as 192 KiB of
    transposed rows hold, one at 3100 input features, four at 700; the last rows, in 8 lanes, with the last group),
    each group's outputs activated once written: every row gets the bits it has beside a copy of itself, on one thread
    or two, and the float64 product's value."""
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, in_features, generator=generator), torch.randn(30, in_features, generator=generator)
    bias, residual = torch.randn(30, generator=generator), torch.randn(rows, 30, generator=generator)
    packed = few_rows.pack(weight)
    one_pass = torch.cat([few_rows.linear(x[[row, row]], packed, bias, residual[[row, row]], "gelu")[:1]
                          for row in range(rows)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(few_rows.linear(x, packed, bias, residual, "gelu"), one_pass)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one_pass.double(), nn.functional.gelu(reference(x, weight, bias, residual)),
                               atol=1e-5 * in_features ** 0.5, rtol=1e-5)


@needs_kernel
@pytest.mark.skipif(few_rows.isa() != "AVX-512", reason="no AVX-512 here: the kernel's one build is AVX2's")
def test_the_avx512_kernel_gives_the_avx2_kernels_bits_from_two_rows(fresh_build, monkeypatch):
    """With oneDNN held below AVX-512 the kernel is AVX2's, as on a CPU without it, on a layout of its own. From two
    rows up each output is summed in the same order in either (the rows in the lanes or the weight): the same bits.
    One row alone is summed in an order of its own in each."""
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(72, 99, generator=generator), torch.randn(70, 99, generator=generator)
    bias, residual = torch.randn(70, generator=generator), torch.randn(72, 70, generator=generator)
    outputs = {}
    for limit in ("", "AVX2"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
        few_rows._state.clear()
        packed = few_rows.pack(weight)
        assert few_rows.available() and packed.tiles.shape[2] == few_rows.TILES[few_rows.isa()]
        outputs[few_rows.isa()] = [few_rows.linear(x[:rows], packed, bias, residual[:rows]) for rows in range(1, 73)]
    with pytest.raises(ValueError, match="tiles of 48 features, this kernel's are 6 wide: pack the weight again"):
        few_rows.linear(x, few_rows.Packed(torch.zeros(2, 99, 48), 70), None)
    wide, narrow = outputs["AVX-512"], outputs["AVX2"]
    assert all(torch.equal(a, b) for a, b in zip(wide[1:], narrow[1:]))
    for output in (wide[0], narrow[0]):
        torch.testing.assert_close(output.double(), reference(x[:1], weight, bias, residual[:1]), atol=1e-5,
                                   rtol=1e-5)
    assert len(list((fresh_build / "kernels").glob("few_rows-*.so"))) == 2


@needs_kernel
@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize("rows", [1, 2, 16, 128, 129, 600])
@pytest.mark.parametrize("after", ["none", "gelu", "relu", "residual"])
def test_the_avx2_rule_takes_it_up_to_its_rows_and_the_packed_weight_beyond(avx2_rule, rows, after):
    torch.manual_seed(rows)
    layer, x = nn.Linear(32, 48), torch.randn(rows, 32)
    activation = {"gelu": ACT2FN["gelu"], "relu": nn.ReLU()}.get(after)
    residual = torch.randn(rows, 48) if after == "residual" else None
    takes_it = rows <= avx2_rule.few_rows_max_rows
    with torch.inference_mode():
        output = fused_linear(layer, x, activation, residual)
        if takes_it:
            expected_bits = few_rows.linear(x, few_rows.pack(layer.weight), layer.bias, residual,
                                            after if activation is not None else "none")
        else:  # oneDNN's kernel on the packed weight, the residual added by it, GELU or ReLU after it
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight, fused.PACKING_HINT)
            expected_bits = fused._KERNEL(x, packed, layer.bias, "none", [], "")
            expected_bits = residual + expected_bits if residual is not None else expected_bits
            expected_bits = activation(expected_bits) if activation is not None else expected_bits
    assert set(fused._PACKED[layer].weights) == {"few_rows" if takes_it else "packed"}
    expected = reference(x, layer.weight, layer.bias, residual)
    torch.testing.assert_close(output.double(), activation(expected) if activation is not None else expected,
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(output, expected_bits)


@needs_kernel
@pytest.mark.skipif(few_rows.isa() != "AVX-512", reason="no AVX-512 here: row_panels is the AVX-512 kernel's")
@pytest.mark.parametrize("row_panels", [True, False])
def test_a_rules_row_panels_reach_the_kernel_in_a_models_forward(monkeypatch, row_panels):
    """`DenseRule.few_rows_row_panels` (the AMX Xeon's) reaches the kernel, called alone and bound at a model's forward:
    a one-token forward's output is the kernel's on one panel or four, as the rule says."""
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.INTEL_AMX_RULE, few_rows_row_panels=row_panels))
    torch.manual_seed(0)
    layer, x, model = nn.Linear(64, 300), torch.randn(1, 64), tiny_model()
    with torch.inference_mode():
        expected = few_rows.linear(x, few_rows.pack(layer.weight), layer.bias, row_panels=row_panels)
        assert torch.equal(fused_linear(layer, x), expected)
        with pytest.MonkeyPatch.context() as patch:
            calls = []
            bind = few_rows.bind_linear
            patch.setattr(few_rows, "bind_linear", lambda *args: calls.append(args[-1]) or bind(*args))
            model(torch.randint(1, 50, (1, 1)))
            model(torch.randint(1, 50, (1, 1)))
    assert calls and set(calls) == {row_panels}


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
def test_layers_side_by_side_give_the_bits_of_each_alone_and_follow_their_weights(avx2_rule, bias):
    torch.manual_seed(0)
    layers, x = tuple(nn.Linear(32, out, bias=bias) for out in (32, 16, 20)), torch.randn(16, 32)
    with torch.inference_mode():
        alone = [fused_linear(layer, x) for layer in layers]
        together = fused_linears(layers, x)
        assert all(torch.equal(a, b) for a, b in zip(alone, together))
        assert set(fused._PACKED_SIDE_BY_SIDE[layers[0]].weights) == {"few_rows"}
    layers[2].weight.data.mul_(-1)  # uncounted, as an adapter merged through .data
    with torch.no_grad():
        layers[0].weight.add_(1.0)
    with torch.inference_mode():
        for output, layer in zip(fused_linears(layers, x), layers):
            torch.testing.assert_close(output.double(), reference(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_tiles_follow_the_weight_and_sit_beside_another_kernels_packing(avx2_rule, monkeypatch):
    """The packed tiles are made again when the weight changes (in place, through ``.data``, replaced); a layer whose
    rows move to oneDNN's packed kernel (the rule without the kernel) keeps its tiles beside that kernel's copy, so that
    moving back packs nothing, and a change of the weight drops both."""
    torch.manual_seed(0)
    layer, x = nn.Linear(24, 18), torch.randn(16, 24)
    other = "packed" if fused._PACK is not None else "few_rows"

    def check():
        with torch.inference_mode():
            output = fused_linear(layer, x)
        torch.testing.assert_close(output.double(), reference(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)

    check()
    tiles = fused._PACKED[layer].weights["few_rows"]
    check()
    assert fused._PACKED[layer].weights["few_rows"] is tiles  # packed once, reused
    with torch.no_grad():
        layer.weight.mul_(-2)
    check()
    layer.weight.data.copy_(torch.randn(18, 24))
    check()
    layer.weight = nn.Parameter(torch.randn(18, 24))
    check()
    tiles = fused._PACKED[layer].weights["few_rows"]
    without = dataclasses.replace(fused.AVX2_RULE, few_rows_max_rows=0)
    monkeypatch.setattr(fused, "RULE", without)
    check()
    assert set(fused._PACKED[layer].weights) == {"few_rows", other}
    monkeypatch.setattr(fused, "RULE", fused.AVX2_RULE)
    check()
    assert fused._PACKED[layer].weights["few_rows"] is tiles  # back to the kernel: its copy was kept
    with torch.no_grad():
        layer.weight.add_(1.0)
    check()
    assert set(fused._PACKED[layer].weights) == {"few_rows"}  # the other kernel's copy went with the old weight
    monkeypatch.setattr(fused, "RULE", without)
    check()


def tiny_model():
    import roformer_hf

    config = roformer_hf.RoFormerConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=40)
    torch.manual_seed(0)
    return roformer_hf.RoFormerModel(config).eval()


@needs_kernel
@pytest.mark.skipif(fused._PACK is None, reason="this torch cannot pack weights for oneDNN")
def test_a_model_that_alternates_short_and_long_inputs_packs_each_weight_once_per_kernel(monkeypatch):
    """A server runs single sentences and batches in turn: under a rule with the kernel for few rows and oneDNN's
    packed weight beyond (a Zen 4's), each weight is packed once for each kernel, however often the rows move between
    them, and each forward gives the bits of a model that only ever ran its kind of input."""
    rule = dataclasses.replace(fused.AVX512_RULE, few_rows_max_rows=8)
    monkeypatch.setattr(fused, "RULE", rule)
    packs = []
    monkeypatch.setattr(fused, "_pack", lambda weight, kernel, pack=fused._pack: packs.append(kernel) or
                        pack(weight, kernel))
    model, short, long = tiny_model(), torch.randint(1, 50, (1, 6)), torch.randint(1, 50, (2, 9))
    with torch.inference_mode():
        outputs = [model(input_ids=ids).last_hidden_state for ids in (short, long, short, long, short)]
    kernels = ("few_rows", "packed")
    # per layer: query, key and value side by side, then the attention's output and the feed-forward's two
    assert sorted(packs) == sorted(kernel for kernel in kernels for _ in range(4 * model.config.num_hidden_layers))
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[0], outputs[4])
    assert torch.equal(outputs[1], outputs[3])
    with torch.inference_mode():
        assert torch.equal(tiny_model()(input_ids=long).last_hidden_state, outputs[1])


@needs_kernel
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_models_forwards_agree_with_the_module_path_and_with_themselves(avx2_rule, padding_side):
    """Short batches of a model under the AVX2 rule: every dense call takes the kernel (checked at each forward's
    start from the second on), the output is the module path's within fp32 error, later forwards give the same bits,
    and a padded batch's rows each sentence alone."""
    model = tiny_model()
    torch.manual_seed(1)
    input_ids = torch.randint(1, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    for row, length in enumerate((9, 5, 2)):
        padding = slice(length, None) if padding_side == "right" else slice(None, 9 - length)
        mask[row, padding] = 0
    with torch.inference_mode():
        with pytest.MonkeyPatch.context() as patch:
            calls = counting_kernel_calls(patch, "linear")
            first = model(input_ids, attention_mask=mask).last_hidden_state
            assert len(calls) == 2 * 4  # per layer: q/k/v side by side, attention output, FFN up, FFN down
            second = model(input_ids, attention_mask=mask).last_hidden_state
            assert len(calls) == 2 * 2 * 4
        alone = [model(input_ids[row:row + 1][mask[row:row + 1].bool()].view(1, -1)).last_hidden_state[0]
                 for row in range(3)]
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        module = model(input_ids, attention_mask=mask).last_hidden_state
    assert torch.equal(first, second)
    real = mask.bool()
    torch.testing.assert_close(first[real], module[real], atol=1e-5, rtol=1e-5)
    for row in range(3):
        torch.testing.assert_close(first[row][real[row]], alone[row], atol=1e-6, rtol=1e-6)


def test_without_a_compiler_dense_layers_take_onednn_and_say_why(fresh_build, avx2_rule, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=few_rows.__name__):
        assert not few_rows.available()
    assert "no-such-compiler" in few_rows.why_not() and "few-row GEMM is not available" in caplog.text
    x = torch.randn(16, 8)
    expected = "packed" if fused._PACK is not None else "onednn"
    assert fused._dense_kernel(x) == expected
    layer = nn.Linear(8, 4)
    with torch.inference_mode():
        torch.testing.assert_close(fused_linear(layer, x).double(), reference(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="not available here"):
        few_rows.linear(x, few_rows.pack(layer.weight.detach()), None)


def test_it_can_be_turned_off_without_a_warning(fresh_build, avx2_rule, monkeypatch, caplog):
    monkeypatch.setenv("ROFORMER_HF_FEW_ROWS", "0")
    with caplog.at_level(logging.WARNING, logger=few_rows.__name__):
        assert not few_rows.available() and "ROFORMER_HF_FEW_ROWS=0" in few_rows.why_not()
    assert caplog.text == ""
    assert fused._dense_kernel(torch.randn(16, 8)) != "few_rows"
    assert not (fresh_build / "kernels").exists()  # nothing built


@needs_kernel
def test_it_is_built_once_into_the_cache_and_shares_torchs_openmp_runtime(fresh_build):
    assert few_rows.available()
    built = list((fresh_build / "kernels").glob("few_rows-*.so"))
    assert len(built) == 1 and not list((fresh_build / "kernels").glob("*.partial"))
    modified = built[0].stat().st_mtime_ns
    few_rows._state.clear()
    assert few_rows.available() and built[0].stat().st_mtime_ns == modified  # loaded, not built again
    assert len(few_rows._openmp_runtimes()) == 1


@needs_kernel
def test_wrong_inputs_are_named():
    weight, x = torch.randn(7, 5), torch.randn(3, 5)
    packed = few_rows.pack(weight)
    with pytest.raises(ValueError, match="pack: weight must be a 2-d float32"):
        few_rows.pack(weight.double())
    for args, match in [((x.double(), packed, None), "x must be float32 on CPU with 5 features"),
                        ((torch.randn(3, 4), packed, None), "with 5 features"),
                        ((x, packed, torch.randn(6)), "bias must be float32 \\(7,\\)"),
                        ((x, packed, torch.randn(7, device="meta")), "on CPU, got"),
                        ((x, packed, None, torch.randn(3, 6)), "residual must be float32 \\(3, 7\\)")]:
        with pytest.raises(ValueError, match=match):
            few_rows.linear(*args)
    assert few_rows.linear(x, packed, None).shape == (3, 7)
    with pytest.raises(RuntimeError, match="no backward"):
        few_rows.linear(x.requires_grad_(), packed, None)
    empty = few_rows.pack(torch.randn(7, 0))  # no input features: the bias alone, whatever the number of rows
    bias = torch.randn(7)
    for rows in (3, 20):
        assert torch.equal(few_rows.linear(torch.randn(rows, 0), empty, bias), bias.expand(rows, 7))


@needs_kernel
def test_a_bound_kernel_checks_its_operands_when_bound_and_each_input_when_called():
    """`bind_linear` refuses a wrong bias at once; its call refuses a wrong input or residual, and, where autograd
    records, the bias it holds that requires grad; otherwise it gives the unbound call's bits, with its bias as it is
    at the call."""
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(7, 5, generator=generator), torch.randn(2, 3, 5, generator=generator)
    bias, residual = torch.randn(7, generator=generator, requires_grad=True), torch.randn(2, 3, 7, generator=generator)
    packed = few_rows.pack(weight)
    with pytest.raises(ValueError, match="bias must be float32 \\(7,\\)"):
        few_rows.bind_linear(packed, torch.randn(6))
    run = few_rows.bind_linear(packed, bias, "gelu")
    with pytest.raises(ValueError, match="with 5 features"):
        run(torch.randn(3, 4))
    with pytest.raises(ValueError, match="residual must be float32 \\(2, 3, 7\\)"):
        run(x, torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="no backward"):
        run(x)
    with torch.no_grad():
        for args in [(x,), (x, residual), (x[0],)]:
            assert torch.equal(run(*args), few_rows.linear(args[0], packed, bias, args[1] if len(args) > 1 else None,
                                                           "gelu"))
        strided = torch.randn(14, generator=generator)[::2]  # read at each call, as it is then, even when not contiguous
        run = few_rows.bind_linear(packed, strided)
        before = run(x)
        strided.add_(1.0)
        assert torch.equal(run(x), few_rows.linear(x, packed, strided.clone()))
        torch.testing.assert_close(run(x), before + 1.0)


needs_int8_kernel = pytest.mark.skipif(not few_rows.int8_available(),
                                       reason=f"no few-row int8 kernel here: {few_rows.why_not('int8')}")


def exact_int8(x, weight, scale, bias=None, residual=None, activation="none"):
    """The integer product of `x` quantized as `quantize_activations` does and the int8 `weight`, in int64,
    rescaled in float64, then the bias, the residual and the activation."""
    rows = x.reshape(-1, x.shape[-1])
    quantized, input_scale, zero_point = quantize_activations(rows)
    output = ((quantized.long() - zero_point) @ weight.long().T).double() * input_scale * scale.double()
    output = output.view(*x.shape[:-1], weight.shape[0])
    output = output if bias is None else output + bias.double()
    output = output if residual is None else output + residual.double()
    return {"none": output, "relu": output.clamp(min=0), "gelu": nn.functional.gelu(output)}[activation]


def random_int8_layer(out_features, in_features, generator):
    """Random int8 weights and their scales. Without VNNI the kernel takes only weights whose neighbours of one sign
    add to at most 128 in magnitude (`few_rows.int8_exact`): there each row keeps the first half of each pair of
    features (up to 127) and gives the second what is left of 128."""
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    if few_rows.int8_isa() == "AVX2":
        pairs = weight[:, :in_features // 2 * 2].view(out_features, -1, 2).short()
        room = 128 - pairs[..., 0].abs()  # what the second of a pair may take with the first's sign
        second = pairs[..., 1]
        limited = torch.where(second * pairs[..., 0] > 0, second.sign() * torch.minimum(second.abs(), room), second)
        weight[:, 1:in_features // 2 * 2:2] = limited.to(torch.int8)
    return weight, torch.rand(out_features, generator=generator) / 100 + 1e-4


@needs_int8_kernel
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 1, 1), (1, 67, 19), (1, 768, 100), (2, 5, 50), (7, 33, 7), (8, 64, 48), (9, 17, 97), (16, 130, 13),
    (17, 8, 49), (40, 301, 31), (100, 3, 6), (17, 2053, 200), (24, 1100, 97), (250, 130, 97)])
@pytest.mark.parametrize("after", ["bias", "nothing", "residual", "relu", "gelu"])
def test_the_int8_product_is_the_exact_integer_product_at_any_shape(rows, in_features, out_features, after):
    """Any count of rows (one alone sums in runs of its own), input features not a multiple of 4 (the last group is
    padded), output features not a multiple of 48 (the last panel's lanes masked): the integer product of the
    quantized input, exact, then rescaled, and the activation; an input quantized one step off anywhere would be far
    outside the tolerance."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    leading = (rows,) if rows % 2 else (2, rows // 2)
    x = torch.randn(*leading, in_features, generator=generator) * 3 + 0.5
    weight, scale = random_int8_layer(out_features, in_features, generator)
    bias = torch.randn(out_features, generator=generator) if after != "nothing" else None
    residual = torch.randn(*leading, out_features, generator=generator) if after == "residual" else None
    given = x.clone()
    activation = after if after in ("relu", "gelu") else "none"
    output = few_rows.int8_linear(x, few_rows.pack_int8(weight), scale, bias, residual, activation)
    expected = exact_int8(x, weight, scale, bias, residual, activation)
    assert output.shape == (*leading, out_features) and torch.equal(x, given)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_int8_kernel
@pytest.mark.skipif(few_rows.build("int8") != "int8 AMX", reason="no AMX int8 tiles here")
def test_the_int8_kernel_on_amxs_tiles_gives_the_vnni_kernels_bits(monkeypatch):
    """On a CPU with AMX's int8 tiles, inputs of 16 rows and more take them (the rest `vpdpbusd`): integer sums, so
    the same outputs as the VNNI build alone (oneDNN held below AMX), bit for bit, at every row count around a tile's
    16 and input features past a tile's 64."""
    generator = torch.Generator().manual_seed(3)
    cases = [(rows, in_features) for rows in (1, 8, 15, 16, 17, 32, 33, 70) for in_features in (64, 67, 130, 768)]
    layers = {in_features: random_int8_layer(100, in_features, generator) for in_features in (64, 67, 130, 768)}
    inputs = [(torch.randn(rows, in_features, generator=generator) * 2 + 0.3,
               torch.randn(rows, 100, generator=generator)) for rows, in_features in cases]
    outputs = {}
    for limit in ("", "AVX512_CORE_VNNI"):
        monkeypatch.setattr(few_rows, "_state", {})
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
        outputs[few_rows.build("int8")] = [
            few_rows.int8_linear(x, few_rows.pack_int8(layers[x.shape[1]][0]), layers[x.shape[1]][1], None, residual,
                                 activation) for x, residual in inputs for activation in ("none", "gelu")]
    assert set(outputs) == {"int8 AMX", "int8 VNNI"}
    assert all(torch.equal(amx, vnni) for amx, vnni in zip(outputs["int8 AMX"], outputs["int8 VNNI"]))


def pairs_at_the_limit(out_features, in_features):
    """int8 weights whose neighbouring entries (2i, 2i + 1) of one sign add to exactly 128 in magnitude, or -128 alone
    beside 0: the most `few_rows.int8_exact` takes without VNNI, where 255 times a pair is 32640 of an int16's 32767."""
    patterns = torch.tensor([[127, 1], [64, 64], [-128, 0], [-100, -28], [1, 127], [0, -128], [-127, 127]])
    rows = [patterns[(torch.arange(in_features // 2) + row) % len(patterns)].reshape(-1)
            for row in range(out_features)]
    return torch.stack(rows).to(torch.int8)


@needs_int8_kernel
def test_the_int8_product_is_exact_with_pairs_at_the_int16_limit():
    """Inputs at both ends of the uint8 range against pairs of weights that add to 128 (the AVX2 kernel's int16 sums
    at their largest): still the exact integer product; one step more and the kernel refuses the weight without VNNI
    (it would saturate), where VNNI's int32 sums take it."""
    generator = torch.Generator().manual_seed(5)
    weight = pairs_at_the_limit(50, 64)
    x = torch.where(torch.rand(9, 64, generator=generator) < 0.5, -1.0, 3.0)  # quantized to 0 and 255
    x[:, 1::2] = x[:, ::2]  # both of a pair at the same end: the largest pair sums
    scale = torch.rand(50, generator=generator) / 100 + 1e-4
    packed = few_rows.pack_int8(weight)
    assert packed.pairs_fit_int16 and few_rows.int8_exact(packed)
    output = few_rows.int8_linear(x, packed, scale, None)
    torch.testing.assert_close(output.double(), exact_int8(x, weight, scale), rtol=1e-6, atol=0)
    over = weight.clone()
    over[3, 2:4] = torch.tensor([127, 2], dtype=torch.int8)  # 129
    packed = few_rows.pack_int8(over)
    assert not packed.pairs_fit_int16 and few_rows.int8_exact(packed) == (few_rows.int8_isa() == "VNNI")
    if few_rows.int8_isa() == "AVX2":
        with pytest.raises(ValueError, match="neighbours of one sign adding to more than 128"):
            few_rows.int8_linear(x, packed, scale, None)
    else:
        torch.testing.assert_close(few_rows.int8_linear(x, packed, scale, None).double(), exact_int8(x, over, scale),
                                   rtol=1e-6, atol=0)


@pytest.mark.skipif(few_rows.int8_isa() != "VNNI", reason="no AVX-512 VNNI here: the int8 kernel's one build is AVX2's")
def test_the_avx2_int8_build_is_the_exact_product_too(monkeypatch, tmp_path):
    """With oneDNN held below AVX-512 the int8 kernel is built for AVX2 (``vpmaddubsw``, as on a CPU without VNNI):
    the exact integer product on the weights it takes, the activations applied, and the weights it cannot take
    refused."""
    monkeypatch.setattr(few_rows, "_state", {})
    monkeypatch.setenv("ROFORMER_HF_CACHE", str(tmp_path))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert few_rows.int8_isa() == "AVX2" and few_rows.int8_available()
    test_the_int8_product_is_exact_with_pairs_at_the_int16_limit()
    for rows, in_features, out_features in [(1, 67, 19), (3, 768, 100), (17, 301, 97)]:
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, in_features, generator=generator) * 3 + 0.5
        weight, scale = random_int8_layer(out_features, in_features, generator)
        bias, residual = torch.randn(out_features, generator=generator), torch.randn(rows, out_features)
        packed = few_rows.pack_int8(weight)
        for extra, activation in [(None, "gelu"), (residual, "none"), (None, "relu")]:
            output = few_rows.int8_linear(x, packed, scale, bias, extra, activation)
            expected = exact_int8(x, weight, scale, bias, extra, activation)
            torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_int8_kernel
def test_the_int8_input_is_quantized_as_torch_quantizes_it_ties_included():
    """Through an identity weight each output is ``(q - zero_point) * scale`` of its own input: the bytes
    `quantize_activations` (`torch.quantize_per_tensor`) gives, on random values and on values at half steps, where
    the rounding decides."""
    generator = torch.Generator().manual_seed(0)
    features = 512
    x = torch.randn(8, features, generator=generator) * 2 + 0.3
    _, scale, zero_point = quantize_activations(x)
    halves = ((torch.arange(8 * features) % 255 - zero_point + 0.5) * scale).float()  # between two steps, in range
    near = [halves]  # and the floats within 16 ulps of them, which round either way
    for direction in (float("inf"), -float("inf")):
        value = halves
        for _ in range(16):
            near.append(value := torch.nextafter(value, torch.tensor(direction)))
    ties = torch.cat(near).view(-1, features)
    ties[:, 0], ties[:, 1] = x.min(), x.max()  # the same range, so the same scale and zero point
    identity = torch.eye(features, dtype=torch.int8)
    packed = few_rows.pack_int8(identity)
    for inputs in (x, ties):
        quantized, input_scale, point = quantize_activations(inputs)
        expected = (quantized.int() - point).float() * torch.tensor(input_scale, dtype=torch.float32)
        output = few_rows.int8_linear(inputs, packed, torch.ones(features), None)
        assert torch.equal(output, expected)


@needs_int8_kernel
def test_the_int8_product_does_not_depend_on_the_threads():
    """Integer sums: the same bits on one thread, two or three, for one row and many."""
    generator = torch.Generator().manual_seed(1)
    x, (weight, scale) = torch.randn(37, 200, generator=generator), random_int8_layer(150, 200, generator)
    packed = few_rows.pack_int8(weight)
    outputs = {}
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs[count] = few_rows.int8_linear(x, packed, scale, None), few_rows.int8_linear(x[:1], packed, scale, None)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for count in (2, 3) for a, b in zip(outputs[count], outputs[1]))


@needs_int8_kernel
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_int8_input_is_refused(value):
    x = torch.randn(3, 8)
    x[1, 6] = value
    with pytest.raises(ValueError, match="non-finite values"):
        few_rows.int8_linear(x, few_rows.pack_int8(torch.ones(4, 8, dtype=torch.int8)), torch.ones(4), None)


@needs_int8_kernel
def test_wrong_int8_inputs_are_named():
    weight, x, scale = torch.ones(7, 5, dtype=torch.int8), torch.randn(3, 5), torch.ones(7)
    packed = few_rows.pack_int8(weight)
    with pytest.raises(ValueError, match="pack_int8: weight must be a 2-d int8"):
        few_rows.pack_int8(weight.float())
    for args, match in [((x.double(), packed, scale, None), "x must be float32 on CPU with 5 features"),
                        ((torch.randn(3, 4), packed, scale, None), "with 5 features"),
                        ((x, packed, torch.ones(6), None), "weight_scale must be float32 \\(7,\\)"),
                        ((x, packed, scale, torch.randn(7).double()), "bias must be float32 \\(7,\\)"),
                        ((x, packed, scale, None, torch.randn(3, 6)), "residual must be float32 \\(3, 7\\)")]:
        with pytest.raises(ValueError, match=match):
            few_rows.int8_linear(*args)
    with pytest.raises(RuntimeError, match="no backward"):
        few_rows.int8_linear(x.requires_grad_(), packed, scale, None)
    bias = torch.randn(7)
    no_features = few_rows.int8_linear(torch.randn(3, 0), few_rows.pack_int8(torch.ones(7, 0, dtype=torch.int8)),
                                       scale, bias)
    assert torch.equal(no_features, bias.expand(3, 7))
    assert few_rows.int8_linear(torch.randn(0, 5), packed, scale, bias).shape == (0, 7)


needs_bf16_kernel = pytest.mark.skipif(not few_rows.bf16_available(),
                                       reason=f"no few-row bf16 kernel here: {few_rows.why_not('bf16')}")


@pytest.fixture(params=["AMX", "AVX-512"])
def bf16_kind(request, monkeypatch):
    """`few_rows`' bf16 kernel built for each instruction set this CPU runs (`few_rows.bf16_isa`): AMX's tiles where it
    has them, and AVX-512's ``vdpbf16ps`` (with oneDNN held below AMX, as on a CPU without it)."""
    monkeypatch.setattr(few_rows, "_state", {})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "" if request.param == "AMX" else "AVX512_CORE_BF16")
    if not few_rows.bf16_available() or few_rows.bf16_isa() != request.param:
        pytest.skip(f"no {request.param} bf16 kernel here: {few_rows.why_not('bf16') or few_rows.bf16_isa()}")
    return request.param


@pytest.fixture
def bf16_rule(monkeypatch):
    """A rule that gives bf16 inputs of up to 8 rows to the bf16 kernel, whatever this CPU's."""
    rule = dataclasses.replace(fused.RULE, bf16_few_rows_max_rows=8)
    monkeypatch.setattr(fused, "RULE", rule)
    return rule


@needs_bf16_kernel
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 1, 1), (1, 67, 19), (1, 768, 100), (2, 5, 50), (7, 33, 7), (8, 64, 48), (9, 17, 97), (16, 130, 13),
    (17, 8, 49), (40, 301, 31), (17, 1101, 200), (24, 600, 97), (250, 130, 97), (33, 96, 50), (48, 768, 144)])
@pytest.mark.parametrize(("bias", "residual", "activation"), [
    (True, False, "none"), (False, False, "none"), (True, True, "none"), (True, False, "gelu"), (False, False, "relu")])
def test_the_bf16_product_is_the_float64_product_rounded_once(bf16_kind, rows, in_features, out_features, bias,
                                                              residual, activation):
    """Any count of rows (one alone sums in runs of its own; AMX's in tiles of 16 rows), an odd count of input features
    (the last pairs with 0), input features past a multiple of 32 (AMX's tiles take 32), output features not a multiple
    of 48: within one bf16 rounding of the float64 product of the same bf16 operands (plus float32's summing error), the
    bias, the residual and the activation applied before that rounding."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    leading = (rows,) if rows % 2 else (2, rows // 2)
    x = torch.randn(*leading, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    residual = torch.randn(*leading, out_features, generator=generator).bfloat16() if residual else None
    given = x.clone()
    output = few_rows.bf16_linear(x, few_rows.pack_bf16(weight), bias, residual, activation)
    expected = reference(x, weight, bias, residual)
    expected = {"none": expected, "relu": expected.clamp(min=0), "gelu": nn.functional.gelu(expected)}[activation]
    assert output.dtype == torch.bfloat16 and output.shape == (*leading, out_features) and torch.equal(x, given)
    error = (output.double() - expected).abs()
    assert (error <= expected.abs() * 2 ** -8 + 1e-5 * in_features ** 0.5).all()  # half a bf16 step, and summing
    assert (output == expected.bfloat16()).double().mean() > 0.75  # most entries the float64 result's rounding


@needs_bf16_kernel
def test_the_bf16_kernel_is_amxs_where_the_cpu_has_its_tiles_and_avx512s_below_it(monkeypatch):
    monkeypatch.setattr(few_rows, "_state", {})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")
    assert few_rows.bf16_isa() == ("AMX" if cpu_has("amx_tile", "amx_bf16") else "AVX-512")
    monkeypatch.setattr(few_rows, "_state", {})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert few_rows.bf16_isa() == "AVX-512" and few_rows.bf16_available()


def test_the_bf16_kernel_reads_nothing_past_a_row_of_odd_length(bf16_kind):
    """The last input of a row of odd length pairs with 0: a NaN right after the row (the next row's first input, or
    whatever follows the tensor) must not reach the output."""
    weight = torch.randn(16, 3).bfloat16()
    x = torch.tensor([[1.0, 2.0, 3.0, float("nan")]]).bfloat16()[:, :3]  # contiguous; the next entry is a NaN
    assert torch.isfinite(few_rows.bf16_linear(x, few_rows.pack_bf16(weight), None)).all()
    rows = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), 1.0, 1.0]]).bfloat16()
    assert torch.isfinite(few_rows.bf16_linear(rows, few_rows.pack_bf16(weight), None)[0]).all()


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 8, 9])
@pytest.mark.parametrize("after", ["none", "gelu", "residual"])
def test_the_rule_takes_the_bf16_kernel_up_to_its_rows_and_the_packed_weight_beyond(bf16_rule, rows, after):
    torch.manual_seed(rows)
    layer, x = nn.Linear(32, 48).bfloat16(), torch.randn(rows, 32).bfloat16()
    activation = ACT2FN["gelu"] if after == "gelu" else None
    residual = torch.randn(rows, 48).bfloat16() if after == "residual" else None
    with torch.inference_mode():
        output = fused_linear(layer, x, activation, residual)
        packed = few_rows.pack_bf16(layer.weight)
        # GELU applied by the kernel, before rounding
        product = few_rows.bf16_linear(x, packed, layer.bias, residual, "gelu" if activation is not None else "none")
    takes_it = rows <= bf16_rule.bf16_few_rows_max_rows
    assert set(fused._PACKED[layer].weights) == {"few_rows_bf16" if takes_it else "packed"}
    if takes_it:
        assert torch.equal(output, product)
    expected = reference(x, layer.weight, layer.bias, residual)
    expected = activation(expected) if activation is not None else expected
    torch.testing.assert_close(output.double(), expected, atol=0.02, rtol=0.02)


@needs_bf16_kernel
def test_a_bf16_models_forwards_take_the_kernel_and_agree_with_the_packed_path(bf16_rule, monkeypatch):
    """A short bf16 input: every dense call takes the bf16 kernel (query, key and value side by side), later forwards
    give the same bits, and the output is oneDNN's packed path's within bf16's error."""
    model = tiny_model().bfloat16()
    input_ids = torch.randint(1, 50, (1, 7))
    with torch.inference_mode():
        with pytest.MonkeyPatch.context() as patch:
            calls = counting_kernel_calls(patch, "bf16_linear")
            first = model(input_ids).last_hidden_state
            second = model(input_ids).last_hidden_state
        assert len(calls) == 2 * 2 * 4 and torch.equal(first, second)
        monkeypatch.setattr(fused, "RULE", dataclasses.replace(bf16_rule, bf16_few_rows_max_rows=0))
        packed = model(input_ids).last_hidden_state
    torch.testing.assert_close(first.float(), packed.float(), atol=0.05, rtol=0.05)
    assert torch.nn.functional.cosine_similarity(first.float().flatten(), packed.float().flatten(), dim=0) > 0.999


@needs_bf16_kernel
def test_wrong_bf16_inputs_are_named():
    weight, x = torch.randn(7, 5).bfloat16(), torch.randn(3, 5).bfloat16()
    packed = few_rows.pack_bf16(weight)
    with pytest.raises(ValueError, match="pack_bf16: weight must be a 2-d bfloat16"):
        few_rows.pack_bf16(weight.float())
    for args, match in [((x.float(), packed, None), "x must be bfloat16 on CPU with 5 features"),
                        ((torch.randn(3, 4).bfloat16(), packed, None), "with 5 features"),
                        ((x, packed, torch.randn(7)), "bias must be bfloat16 \\(7,\\)"),
                        ((x, packed, None, torch.randn(3, 6).bfloat16()), "residual must be bfloat16 \\(3, 7\\)")]:
        with pytest.raises(ValueError, match=match):
            few_rows.bf16_linear(*args)
    with pytest.raises(RuntimeError, match="no backward"):
        few_rows.bf16_linear(x.requires_grad_(), packed, None)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_the_kernels_gelu_is_within_float32s_rounding_of_the_exact_one(kind):
    """GELU's erf form as the kernels apply it (`csrc/gelu_avx512.h`, `csrc/gelu_avx2.h`), through an identity weight:
    within 4e-7 |x| of the exact value (float64) on values from -12 to 12 (2.9e-7 |x| measured over 4M values on
    AVX-512; torch's tanh form is up to 4.7e-4 off), x itself far above 0 and a zero far below it, where exp
    underflows; and an unknown activation is named."""
    if not (few_rows.available() if kind == "fp32" else few_rows.int8_available()):
        pytest.skip(f"no {kind} few-row kernel here")
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([-300.0, -40.0, -14.0, 14.0, 40.0, 300.0])])
    if kind == "fp32":
        exact_input = x.double().view(-1, 1)
        output = few_rows.linear(x.view(-1, 1), few_rows.pack(torch.ones(1, 1)), None, activation="gelu")
    else:
        _, scale, zero_point = quantize_activations(x.view(-1, 1))
        quantized = (torch.round(x.view(-1, 1) / scale) * scale).float()  # on the quantization grid: exact
        one = few_rows.pack_int8(torch.ones(1, 1, dtype=torch.int8))
        output = few_rows.int8_linear(quantized, one, torch.ones(1), None, activation="gelu")
        exact_input = exact_int8(quantized, torch.ones(1, 1, dtype=torch.int8), torch.ones(1))
    expected = nn.functional.gelu(exact_input)
    assert ((output.double() - expected).abs() <= 4e-7 * exact_input.abs() + 1e-30).all()
    with pytest.raises(ValueError, match="activation='swish'; expected one of"):
        few_rows.linear(x.view(-1, 1), few_rows.pack(torch.ones(1, 1)), None, activation="swish")


@needs_kernel
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_activation_is_the_products_whichever_build_applies_it(activation):
    """Either build applies the activation itself (GELU: `csrc/gelu_avx512.h`, `csrc/gelu_avx2.h`), the AVX2 build
    to each thread's columns once written: within float32's rounding of the exact activation of the float64 product
    in every column, for one row and many, on one thread and two."""
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(20, 70, generator=generator), torch.randn(50, 70, generator=generator) / 4
    bias = torch.randn(50, generator=generator)
    residual = torch.randn(20, 50, generator=generator)
    packed = few_rows.pack(weight)
    apply = (lambda y: y.clamp(min=0)) if activation == "relu" else nn.functional.gelu
    exact, exact_with_residual = apply(reference(x, weight, bias)), apply(reference(x, weight, bias, residual))
    threads = torch.get_num_threads()
    try:
        for count, rows in itertools.product((1, 2, 3), (1, 20)):
            torch.set_num_threads(count)
            output = few_rows.linear(x[:rows], packed, bias, None, activation)
            torch.testing.assert_close(output.double(), exact[:rows], atol=1e-5, rtol=1e-5)
            output = few_rows.linear(x[:rows], packed, bias, residual[:rows], activation)
            torch.testing.assert_close(output.double(), exact_with_residual[:rows], atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
    plain = few_rows.linear(x, packed, bias)
    assert torch.equal(few_rows.linear(x, packed, bias, None, "relu"), plain.relu())
    with pytest.raises(ValueError, match="activation='tanh'"):
        few_rows.linear(x, packed, bias, None, "tanh")
