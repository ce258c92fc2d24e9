"""bench/unseen_edges.py's models (one corner of the format or the operator set each) and two
more decoders of bench/unseen_shapes.py (GroupQueryAttention on one packed q|k|v MatMul, and
MultiHeadAttention through onnxruntime's float16 converter), small and with random weights.
Every public path runs on each and gives a model that checks and runs close to the original, or
one clear error; packs restore every file byte for byte; inputs are never modified.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import passes
from unseen_helpers import check_packed_sessions, folder_digest, restored_digest, run_outputs as _run, same_outputs
from unseen_helpers import worst_output_snr

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import unseen_edges as edges  # noqa: E402
import unseen_shapes as shapes  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16




def _snr(ref, out) -> float:
    """Worst float output's SNR; every other output (bool masks, strings, ints) must be equal, and
    an output that is all zeros (values' zero weight) must stay within 1e-30 of zero."""
    floats = []
    for j, o in enumerate(ref[0]):
        if o.dtype.kind != "f":
            assert all(np.array_equal(r[j], c[j]) for r, c in zip(ref, out)), j
        elif not any(np.any(r[j]) for r in ref):
            assert all(np.abs(np.asarray(c[j], np.float64)).max(initial=0) < 1e-30 for c in out), j
        else:
            floats.append(j)
    return worst_output_snr([[r[j] for j in floats] for r in ref], [[o[j] for j in floats] for o in out])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (model path, feeds), each model in a folder of its own."""
    root = tmp_path_factory.mktemp("edges")
    out = {}
    for name in edges.NAMES:
        out[name] = (edges.write(name, root / name / f"{name}.onnx"), edges.feeds_for(name, np.random.default_rng(0), 2))
    w = shapes.random_weights(seed=0, hidden=64, ffn=128, vocab=256, layers=2)
    rng = np.random.default_rng(0)
    for name, model, feeds in (
            ("dec_gqa_packed", shapes.contrib_decoder(w, heads=HEADS, kv_heads=KV_HEADS, max_pos=160, packed_qkv=True),
             shapes.contrib_feeds(rng, "gqa", 2, vocab=256, layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM)),
            ("dec_mha16", shapes.float16_keep_io(shapes.contrib_decoder(w, heads=HEADS, kv_heads=HEADS, attention="mha",
                                                                        max_pos=160)),
             shapes.contrib_feeds(rng, "mha", 2, vocab=256, layers=2, kv_heads=HEADS, head_dim=HEAD_DIM))):
        path = root / name / f"{name}.onnx"
        path.parent.mkdir()
        onnx.save(model, str(path))
        out[name] = (path, feeds)
    return out


ALL = [*edges.NAMES, "dec_gqa_packed", "dec_mha16"]
# where a 4-bit block form is fine enough to compare; the decoders' figures are test_unseen_contrib's
Q4_FLOOR = {"dec_gqa_packed": 8, "dec_mha16": 8}


def test_the_shapes_are_what_they_claim(made):
    def load(name):
        return onnx.load(str(made[name][0]), load_external_data=False)

    m = load("fn_nested")
    assert {(f.name, f.overload) for f in m.functions} >= {("Block", ""), ("Proj", "v1"), ("Proj", "v2")}
    assert any(n.op_type == "Dense" for f in m.functions for n in f.node)  # a function calling a function
    assert any(a.ref_attr_name for f in m.functions for n in f.node for a in n.attribute)
    assert {"W", "W_quantized", "W_scale"} <= {t.name for t in load("names").graph.initializer}
    assert not any(t.raw_data for t in load("values").graph.initializer if t.name == "float_data")
    ops = {n.op_type for n in load("recurrent_full").graph.node}
    assert {"LSTM", "GRU", "RNN"} <= ops
    lstm = next(n for n in load("recurrent_full").graph.node if n.op_type == "LSTM")
    assert len(lstm.input) == 8 and all(lstm.input)  # every optional input given
    convs = load("convs").graph
    assert {n.op_type for n in convs.node} >= {"Conv", "ConvTranspose", "Einsum"}
    assert any(len(t.dims) == 5 for t in convs.initializer)
    deg = load("degenerate").graph
    dims = {t.name: list(t.dims) for t in deg.initializer}
    assert dims["empty_w"] == [0, 64] and dims["scalar_w"] == [] and dims["row_w"][0] == 1 and dims["col_w"][1] == 1
    assert "over_w" in {i.name for i in deg.input}
    types = {t.data_type for t in deg.initializer}
    assert {onnx.TensorProto.BOOL, onnx.TensorProto.STRING} <= types
    for name, n_files in (("ext_spread", 8), ("ext_handmade", 2)):
        locs = {e.value for t in load(name).graph.initializer for e in t.external_data if e.key == "location"}
        assert len(locs) == n_files, name
    assert (made["ext_handmade"][0].parent / "weights a.bin").exists()
    m = load("ext_attribute")
    from onnx.external_data_helper import _get_all_tensors
    outside = [t.name for t in _get_all_tensors(m) if t.data_location == onnx.TensorProto.EXTERNAL
               and t.name not in {i.name for i in m.graph.initializer}]
    assert sorted(outside) == ["cw", "else_w", "then_w"]  # a Constant node's and the If branches' tensors
    m = load("metadata")
    assert m.training_info and m.graph.metadata_props and m.graph.quantization_annotation
    m = load("dec_gqa_packed")
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(n.input[1] == "" and n.input[2] == "" for n in gqa)
    m = load("dec_mha16")
    assert any(n.op_type == "MultiHeadAttention" for n in m.graph.node)
    assert onnx.TensorProto.FLOAT16 in {t.data_type for t in m.graph.initializer}


@pytest.mark.parametrize("name", ALL)
def test_every_path(made, name, tmp_path):
    src, feeds = made[name]
    before = folder_digest(src.parent)
    ref = _run(src, feeds)
    q8 = passes.quantize_weights(str(src), min_elements=0)
    onnx.checker.check_model(q8, full_check=True)
    assert _snr(ref, _run(q8, feeds)) >= 27
    q4 = passes.quantize_weights(str(src), bits=4, granularity="block", block_size=32, min_elements=0)
    onnx.checker.check_model(q4, full_check=True)
    assert _snr(ref, _run(q4, feeds)) >= Q4_FLOOR.get(name, 12)
    pal = passes.palettize(str(src), bits=4)
    onnx.checker.check_model(pal, full_check=True)
    pal_fold = passes.fold_dequantize(pal)
    onnx.checker.check_model(pal_fold, full_check=True)
    assert same_outputs(_run(pal, feeds), _run(pal_fold, feeds))
    for dtype in (None, "float16", "float32"):
        f = passes.fold_dequantize(q8, dtype=dtype)
        onnx.checker.check_model(f, full_check=True)
        if not (name == "values" and dtype == "float16"):  # test_fold_to_float16_keeps_a_weight_float16_cannot_hold
            assert _snr(ref, _run(f, feeds)) >= 27, dtype
    assert restored_digest(src, tmp_path) == before  # every file back byte for byte
    check_packed_sessions(q8, ref, feeds, tmp_path, 27, snr=_snr)
    assert passes.evaluate(str(src), q8, feeds=feeds).metrics["snr"] >= _snr(ref, _run(q8, feeds)) - 0.01
    assert folder_digest(src.parent) == before  # inputs never modified, nothing left beside them


@pytest.mark.parametrize("name", [n for n in ALL if n != "ext_attribute"])
def test_a_float_pack_runs_in_every_session_mode(made, name, tmp_path):
    src, feeds = made[name]
    ref = _run(src, feeds)
    z = tmp_path / "f.onnxz"
    passes.pack(str(src), str(z))
    assert _snr(ref, _run(passes.InferenceSession(str(z), mode="fold"), feeds)) == np.inf
    assert _snr(ref, _run(passes.InferenceSession(str(z), mode="int8"), feeds)) >= 27


def test_a_float_pack_with_external_attribute_tensors_runs(made, tmp_path):
    src, feeds = made["ext_attribute"]
    z = tmp_path / "f.onnxz"
    passes.pack(str(src), str(z))
    assert _snr(_run(src, feeds), _run(passes.InferenceSession(str(z), mode="fold"), feeds)) == np.inf


@pytest.mark.parametrize("name", ["fn_nested", "ext_handmade"])  # (bench/unseen.py runs it on every model)
def test_compress_to_a_target(made, name):
    src, feeds = made[name]
    model, _ = passes.compress(str(src), target="snr>=25", feeds=feeds)
    onnx.checker.check_model(model, full_check=True)
    assert passes.evaluate(str(src), model, feeds=feeds).metrics["snr"] >= 25 - 1e-9


def test_a_function_attribute_reference_survives_the_opset_raise(made):
    """Scale(x; alpha) reads alpha through Constant(value_float=@alpha). The 4-bit block form raises
    the opset, and the converter wrote the reference as a plain value_float 0: every output was 0
    (0.0 dB). Each call's value is kept; the weights inside the bodies are quantized there."""
    src, feeds = made["fn_nested"]
    rep = passes.Report()
    q4 = passes.quantize_weights(str(src), bits=4, granularity="block", block_size=32, min_elements=0, report=rep)
    assert q4.opset_import[0].version == 21
    scale = next(f for f in q4.functions if f.name == "Scale")
    assert [a.ref_attr_name for n in scale.node for a in n.attribute if a.ref_attr_name] == ["alpha"]
    assert {(f.name, f.overload) for f in q4.functions} == {(f.name, f.overload) for f in onnx.load(str(src)).functions}
    assert _snr(_run(src, feeds), _run(q4, feeds)) >= 15
    assert sorted(t.location for t in rep.tensors if t.scheme == "int4/block(axis=0,size=32)/sym") == [
        "function local:Dense: Constant node", "function local:Proj (v1): Constant node",
        "function local:Proj (v2): Constant node", "initializer"]


def test_the_report_names_each_function_weight_quantized_in_its_body(made):
    """fn_nested holds 50 kB of its 55 kB in function bodies: each weight is quantized in its body
    (a row for each, where it is); the 1-D scale and the Constant whose value the call gives
    (ref_attr_name) are no weights. With include patterns (they name graph weights) the bodies
    stay float, a row and a note saying why."""
    src, feeds = made["fn_nested"]
    rep = passes.Report()
    q8 = passes.quantize_weights(str(src), report=rep)
    rows = sorted((t.name, t.location, t.scheme) for t in rep.tensors if t.location.startswith("function"))
    assert rows == [("P", "function local:Proj (v1): Constant node", "int8/channel(axis=1)/sym"),
                    ("P", "function local:Proj (v2): Constant node", "int8/channel(axis=1)/sym"),
                    ("W", "function local:Dense: Constant node", "int8/channel(axis=1)/sym")]
    assert not any("inside model-local functions" in n for n in rep.notes)
    originals = {(f.name, f.overload): f for f in onnx.load(str(src)).functions}
    for f in q8.functions:
        dq = [n.output[0] for n in f.node if n.op_type == "DequantizeLinear"]
        assert dq == {"Dense": ["W"], "Proj": ["P"]}.get(f.name, []), f.name
        if not dq:  # (Block, Scale: no weight; Scale's alpha from the call)
            assert f.SerializeToString() == originals[(f.name, f.overload)].SerializeToString()
    assert worst_output_snr(_run(src, feeds), _run(q8, feeds)) >= 27
    named = passes.Report()
    kept = passes.quantize_weights(str(src), include=["Wout"], report=named)
    assert [f.SerializeToString() for f in kept.functions] == [f.SerializeToString() for f in originals.values()]
    assert any(n.startswith("3 float weight(s) inside model-local functions stay float (3 not included")
               for n in named.notes)


def test_info_counts_the_weights_inside_functions(made):
    """fn_nested holds 50 kB of its 55 kB in function bodies: info said "1 tensors, 4.10 kB".
    Each function is a scope of its own (two overloads both call their weight P); a Constant whose
    value comes from the call (ref_attr_name) holds nothing."""
    src, _ = made["fn_nested"]
    rows = passes.describe_model(str(src)).rows
    where = sorted((r.name, r.location) for r in rows)
    assert ("P", "function local:Proj (v1): Constant node") in where and ("P", "function local:Proj (v2): Constant node") in where
    assert ("W", "function local:Dense: Constant node") in where and ("Wout", "initializer") in where
    assert "alpha_t" not in {r.name for r in rows}
    assert sum(r.bytes for r in rows) > 0.95 * src.stat().st_size


def test_a_reference_the_newer_opset_moved_into_an_input_is_refused():
    """ReduceSum's axes became an input at opset 13: a body whose axes come from the call cannot
    be raised (the converter would bake in a value); one clear error, not a wrong model."""
    from onnx import helper

    from passes.errors import UnsupportedFormError

    body = helper.make_node("ReduceSum", ["x"], ["y"], keepdims=1)
    body.attribute.append(onnx.AttributeProto(name="axes", type=onnx.AttributeProto.INTS, ref_attr_name="ax"))
    fn = helper.make_function("local", "RS", ["x"], ["y"], [body], [helper.make_opsetid("", 11)], attributes=["ax"])
    g = helper.make_graph([helper.make_node("RS", ["x"], ["y"], domain="local", ax=[0]),
                           helper.make_node("MatMul", ["y", "W"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", 1, [4, 64])], [helper.make_tensor_value_info("z", 1, [1, 64])],
                          [onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("local", 1)], functions=[fn])
    m.ir_version = 8
    with pytest.raises(UnsupportedFormError, match="local:RS.*'axes' takes the call's 'ax'"):
        passes.quantize_weights(m, min_elements=0)


def test_weight_values_at_the_corners(made):
    """All zeros, one value, an outlier, denormals, signed zeros, float16, float_data: every
    quantized weight dequantizes close (an all-zero weight to exact zeros)."""
    src, feeds = made["values"]
    rep = passes.Report()
    q = passes.quantize_weights(str(src), min_elements=0, report=rep)
    by_name = {t.name: t for t in rep.tensors}
    assert all(by_name[n].scheme.startswith("int8") for n in ("zero", "const", "outlier", "denormal", "float_data"))
    assert min(t.snr_db for t in rep.tensors if t.snr_db is not None) > 40
    f = passes.fold_dequantize(q)
    zero = next(t for t in f.graph.initializer if t.name == "zero")
    assert not np.any(onnx.numpy_helper.to_array(zero))
    assert _snr(_run(src, feeds), _run(f, feeds)) >= 40


def test_fold_to_float16_keeps_a_weight_float16_cannot_hold(made):
    """A weight of denormals (~1e-40) stored as float16 was all zeros (that output 44 -> 0 dB); it
    stays in its own type, with a note (ae3a75d)."""
    src, feeds = made["values"]
    rep = passes.Report()
    f = passes.fold_dequantize(passes.quantize_weights(str(src), min_elements=0), dtype="float16", report=rep)
    assert _snr(_run(src, feeds), _run(f, feeds)) >= 27
    assert any("denormal" in n for n in rep.notes)


def test_names_the_writers_would_take_are_left_alone(made):
    """The model holds W, W_quantized and W_scale: each writer names its parts around them, and
    no weight's values end up under another's name."""
    src, feeds = made["names"]
    ref = _run(src, feeds)
    for out in (passes.quantize_weights(str(src), min_elements=0), passes.palettize(str(src), min_elements=0),
                passes.quantize_weights(str(src), bits=4, granularity="block", block_size=32, min_elements=0)):
        onnx.checker.check_model(out, full_check=True)
        names = [t.name for t in out.graph.initializer]
        assert len(names) == len(set(names))
        assert _snr(ref, _run(out, feeds)) >= 12


def _annotations(m: onnx.ModelProto) -> dict:
    g = m.graph
    return {"model": (m.doc_string, m.producer_name, m.domain, m.model_version, list(m.metadata_props)),
            "graph": (g.doc_string, list(g.metadata_props), list(g.quantization_annotation)),
            "nodes": sorted((tuple(n.output), n.doc_string, tuple(n.metadata_props)) for n in g.node
                            if n.doc_string or n.metadata_props),
            "io": [(v.name, v.doc_string, tuple(v.metadata_props)) for v in (*g.input, *g.output)],
            "training": len(m.training_info)}


def test_metadata_doc_strings_and_training_info_survive_every_writer(made):
    """The opset raise of the 4-bit block form dropped the graph's and the nodes' metadata_props,
    the quantization annotations, the input's metadata and training_info (onnx's converter keeps
    none of them); every writer keeps them now. training_info goes only where its update_binding
    names a weight the pass rewrote (graph.drop_stale_training_info says why), with a note; with
    that weight excluded it stays, binding the float initializer it names."""
    src, feeds = made["metadata"]
    m = onnx.load(str(src))
    want = _annotations(m)
    assert want["training"] == 1
    reports = {name: passes.Report() for name in ("q8", "q4", "palette", "q8_trainable")}
    outs = {"q8": passes.quantize_weights(m, min_elements=0, report=reports["q8"]),
            "q4": passes.quantize_weights(m, bits=4, granularity="block", block_size=32, min_elements=0,
                                          report=reports["q4"]),
            "palette": passes.palettize(m, min_elements=0, report=reports["palette"]),
            "q8_trainable": passes.quantize_weights(m, min_elements=0, exclude=["fc2.weight"],
                                                    report=reports["q8_trainable"])}
    outs["fold"] = passes.fold_dequantize(outs["q4"])
    for name, out in outs.items():
        onnx.checker.check_model(out, full_check=True)
        trainable = name == "q8_trainable"
        assert _annotations(out) == {**want, "training": 1 if trainable else 0}, name
        if name in reports:
            said = [n for n in reports[name].notes if "training_info" in n]
            assert (said == []) if trainable else ("'fc2.weight'" in said[0]), name
    # the weight docs follow the weights that stay float
    q4 = outs["q4"]
    assert {t.name: t.doc_string for t in q4.graph.initializer if t.name.endswith("bias")} == \
        {t.name: t.doc_string for t in m.graph.initializer if t.name.endswith("bias")}
    kept = outs["q8_trainable"]
    assert kept.training_info[0].update_binding[0].key == "fc2.weight"
    assert "fc2.weight" in {t.name for t in kept.graph.initializer}


def test_degenerate_shapes(made, tmp_path):
    """An empty weight, 1-long axes, a scalar, an overridable weight, bool and string tensors:
    compress leaves what cannot be quantized (the overridable one by name) and keeps the rest's values."""
    from tools.surgeon_compress import main

    src, feeds = made["degenerate"]
    rep = passes.Report()
    q = passes.quantize_weights(str(src), min_elements=0, report=rep)
    onnx.checker.check_model(q, full_check=True)
    inits = {t.name: t for t in q.graph.initializer}
    assert inits["over_w"].data_type == onnx.TensorProto.FLOAT and list(inits["empty_w"].dims) == [0, 64]
    assert "w4d_quantized" in inits
    # each weight left float says why in the report (the command prints it)
    kept = {t.name: t.scheme for t in rep.tensors if t.scheme.startswith("kept")}
    assert kept["over_w"] == "kept: also a graph input (overridable)"
    assert kept["empty_w"] == "kept: empty" and kept["scalar_w"] == "kept: scalar"
    assert {kept["row_w"], kept["col_w"], kept["one_w"]} == {"kept: 1-D"}  # [1, N], [N, 1]: vectors
    out = tmp_path / "q.onnx"
    assert main(["compress", str(src), "-o", str(out), "--min-elements", "0"]) == 0
    onnx.checker.check_model(str(out), full_check=True)
    assert _snr(_run(src, feeds), _run(out, feeds)) >= 27


def test_palettize_an_empty_weight(made):
    """palette_array crashed on a [0, 64] weight at min_elements=0 (2e8646b keeps it float)."""
    src, feeds = made["degenerate"]
    out = passes.palettize(str(src), bits=4, min_elements=0)
    onnx.checker.check_model(out, full_check=True)
    assert [list(t.dims) for t in out.graph.initializer if t.name == "empty_w"] == [[0, 64]]
    assert _snr(_run(src, feeds), _run(out, feeds)) >= 12


def test_synthesised_feeds_keep_a_zero_long_axis(made):
    """A declared 0 was fed 1 and the auto mode refused the model on its own feeds (fixed in 4c210c0)."""
    from passes.fidelity import synthesize_feeds

    src, _ = made["degenerate"]
    assert synthesize_feeds(str(src), n=1)[0]["zero_rows"].shape == (0, 64)
    model, _ = passes.compress(str(src), target="snr>=25")
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("name", ["ext_handmade", "ext_attribute", "ext_spread"])
def test_cli_on_external_layouts(made, name, tmp_path, capsys):
    """The command on the external layouts, into a folder with a space in its name: compress, pack
    --verify, verify --against, unpack --verify, fold; every file of the source back byte for byte."""
    from tools.surgeon_compress import main

    src, feeds = made[name]
    before = folder_digest(src.parent)
    dst = tmp_path / "out dir"
    dst.mkdir()
    q = dst / "q.onnx"
    assert main(["compress", str(src), "-o", str(q)]) == 0
    assert main(["fold", str(q), "-o", str(dst / "f.onnx")]) == 0
    assert _snr(_run(src, feeds), _run(dst / "f.onnx", feeds)) >= 27
    z = dst / "m.onnxz"
    assert main(["pack", str(src), "-o", str(z), "--verify"]) == 0
    assert main(["verify", str(z), "--against", str(src)]) == 0
    back = dst / "back" / src.name
    back.parent.mkdir()
    assert main(["unpack", str(z), "-o", str(back), "--verify"]) == 0
    capsys.readouterr()
    assert folder_digest(back.parent) == before
    assert folder_digest(src.parent) == before
