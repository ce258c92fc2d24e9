"""A model onnx.checker refuses is refused by the passes up front, with the problem named.

Before, quantize_weights and palettize copied a damaged input into their output: with nothing to
rewrite the output was the input as it was, and the command wrote it without a word (a node
reading an undefined name, two nodes writing one name, a graph output nothing writes, a weight
shorter than its dims). A pass's output must pass the checker's full check, so such an input is
the user's problem to hear about. What the passes repair (unsorted nodes, sparse initializers) is
not refused: tests/unit/test_graph.py and the corpus tests keep those.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from conftest import MODELS
from tools.surgeon_compress import main


def _valid(opset=17) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.RandomState(0).randn(64, 32).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _undefined_input():
    m = _valid()
    m.graph.node.append(helper.make_node("Relu", ["nowhere"], ["z"], name="r"))
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 64]))
    return m


def _duplicate_output():
    m = _valid()
    m.graph.node.append(helper.make_node("Relu", ["x"], ["y"], name="r"))
    return m


def _short_raw_data():
    m = _valid()
    m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]
    return m


def _future_opset():
    m = _valid()
    m.opset_import[0].version = onnx.defs.onnx_opset_version() + 50
    return m


def _no_opset_import():
    m = _valid()
    del m.opset_import[:]
    return m


def _dangling_output():
    m = _valid()
    m.graph.output.append(helper.make_tensor_value_info("ghost", TensorProto.FLOAT, [1]))
    return m


# damaged model -> words the refusal must contain
DAMAGED = {
    "undefined input": (_undefined_input, "nowhere"),
    "duplicate output": (_duplicate_output, "'y'"),
    "short raw_data": (_short_raw_data, "'W' holds 8,188 bytes"),
    "future opset": (_future_opset, "opset"),
    "no opset import": (_no_opset_import, "opset"),
    "dangling output": (_dangling_output, "ghost"),
}
PASSES = {
    "quantize": lambda m: passes.quantize_weights(m),
    "quantize nothing": lambda m: passes.quantize_weights(m, min_elements=10 ** 9),
    "quantize 4-bit blocks": lambda m: passes.quantize_weights(m, bits=4, granularity="block", block_size=32),
    "palette": lambda m: passes.palettize(m),
    "fold": lambda m: passes.fold_dequantize(m),
    "auto": lambda m: passes.compress(m, target="snr>=20")[0],
}


@pytest.mark.parametrize("damage", DAMAGED)
@pytest.mark.parametrize("run", PASSES)
def test_a_pass_refuses_an_invalid_model_naming_the_problem(damage, run):
    build, words = DAMAGED[damage]
    model = build()
    before = model.SerializeToString()
    with pytest.raises(passes.InvalidModelError) as caught:
        PASSES[run](model)
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)
    assert model.SerializeToString() == before  # the input is never modified


@pytest.mark.parametrize("damage", ["undefined input", "short raw_data", "dangling output"])
def test_the_command_refuses_it_in_one_line(damage, tmp_path, capsys):
    build, words = DAMAGED[damage]
    src, out = tmp_path / "bad.onnx", tmp_path / "out.onnx"
    onnx.save(build(), str(src))
    assert main(["compress", str(src), "-o", str(out), "--min-elements", "100000"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("surgeon-compress: error: ") and words in err and err.count("\n") == 1
    assert not out.exists()


def test_the_valid_model_and_the_repaired_forms_still_pass():
    """The undamaged model, and one whose nodes are out of order (which every pass sorts, as
    onnxruntime runs such graphs), are rewritten and come out valid."""
    unsorted = _valid()
    unsorted.graph.node.insert(0, helper.make_node("Identity", ["y"], ["y2"], name="late"))
    unsorted.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 32]))
    for model in (_valid(), unsorted):
        for run in PASSES.values():
            onnx.checker.check_model(run(model), full_check=True)


@pytest.mark.parametrize("name", ["rapidocr_cls.onnx", "rapidocr_cls_fp16.onnx", "silero_vad_v6.onnx"])
def test_the_sample_models_are_not_refused(name):
    onnx.checker.check_model(passes.quantize_weights(str(MODELS / name)), full_check=True)
    onnx.checker.check_model(passes.palettize(str(MODELS / name)), full_check=True)


def test_a_weight_checked_outside_the_view_is_still_length_checked():
    """Large weights are checked as typed inputs (no copy of their bytes): their raw_data length is
    checked on its own, also for the ones the quantizer copies without payload."""
    from passes import graph

    m = _valid()
    m.graph.initializer[0].raw_data += b"\0\0\0\0"
    with pytest.raises(passes.InvalidModelError, match="8,196 bytes"):
        graph.refuse_invalid(m)
    with pytest.raises(passes.InvalidModelError, match="8,196 bytes"):
        passes.quantize_weights(m)


def _declared_output(kind: str) -> onnx.ModelProto:
    m = _valid()
    o = m.graph.output[0]
    if kind == "no shape":
        o.type.tensor_type.ClearField("shape")
    elif kind == "no type":
        o.ClearField("type")
    elif kind == "wrong rank":
        o.type.tensor_type.shape.ClearField("dim")  # a scalar, where MatMul makes [1, 32]
    return m


@pytest.mark.parametrize("kind", ["no shape", "no type", "wrong rank"])
@pytest.mark.parametrize("run", PASSES)
def test_an_output_declaration_onnxruntime_ignores_is_completed_not_refused(kind, run):
    """A graph output declared without a type or shape, or with a shape the graph does not make:
    onnxruntime runs the model (it reads declarations as hints), the checker refuses it. Not refused
    (tests and exporters alike write them); the pass's output takes the inferred declaration,
    with a note, and passes the full check."""
    model = _declared_output(kind)
    report = passes.Report()
    call = {"quantize": lambda m: passes.quantize_weights(m, report=report),
            "quantize nothing": lambda m: passes.quantize_weights(m, min_elements=10 ** 9, report=report),
            "quantize 4-bit blocks": lambda m: passes.quantize_weights(m, bits=4, granularity="block", block_size=32,
                                                                       report=report),
            "palette": lambda m: passes.palettize(m, report=report),
            "fold": lambda m: passes.fold_dequantize(m, report=report),
            "auto": lambda m: passes.compress(m, target="snr>=20", report=report)[0]}[run]
    out = call(model)
    onnx.checker.check_model(out, full_check=True)
    declared = out.graph.output[0].type.tensor_type
    assert declared.elem_type == TensorProto.FLOAT and [d.dim_value for d in declared.shape.dim] == [1, 32]
    if run != "auto":  # (the auto mode's own notes are its record's)
        assert any("output declaration(s) completed" in n and "'y'" in n for n in report.notes)


@pytest.mark.parametrize("damage", ["undefined input", "duplicate output", "short raw_data", "dangling output"])
def test_the_fold_command_writes_no_invalid_model(damage, tmp_path, capsys):
    """fold_dequantize refuses a damaged input (bfad17d): the command writes nothing, one line naming
    the problem, exit 1."""
    build, words = DAMAGED[damage]
    src, out = tmp_path / "bad.onnx", tmp_path / "out.onnx"
    onnx.save(build(), str(src))
    assert main(["fold", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("surgeon-compress: error: ") and err.count("\n") == 1
    assert not out.exists()


def test_a_contrib_domain_used_without_its_import_is_imported_not_refused():
    """A com.microsoft node in a model that imports only the default domain: onnxruntime runs it
    (contrib ops are version 1), the checker refuses it ('No opset import for domain'). Refusing
    it would refuse a model that runs: the pass adds the import, with a note. A missing import of
    the default domain is still refused (DAMAGED's 'no opset import')."""
    from passes.fidelity import run_outputs

    m = _valid()
    m.graph.node[0].output[0] = "mm"
    m.graph.node.append(helper.make_node("Gelu", ["mm"], ["y"], domain="com.microsoft"))
    feeds = [{"x": np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)}]
    run_outputs(m, feeds)  # onnxruntime runs it as it is
    for run in ("quantize", "palette", "fold"):
        report = passes.Report()
        out = {"quantize": passes.quantize_weights, "palette": passes.palettize,
               "fold": passes.fold_dequantize}[run](m, report=report)
        onnx.checker.check_model(out, full_check=True)
        assert {o.domain: o.version for o in out.opset_import}["com.microsoft"] == 1
        assert any("opset import added for domain(s) 'com.microsoft'" in n for n in report.notes), run
    assert [o.domain for o in m.opset_import] == [""]  # the input untouched
    auto, _ = passes.compress(m, target="snr>=20", feeds=feeds)  # (checks its input before any pass)
    onnx.checker.check_model(auto, full_check=True)
