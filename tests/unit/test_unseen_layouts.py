"""Storage layouts and graph shapes an unseen model may have, through the public paths.

External data spread over several files (one in a subfolder); an initializer that is also a graph
output; Constants inside a model-local function's body; a training-mode export (Dropout drawing
masks, BatchNormalization with its running statistics as outputs); models other tools quantized
(onnxruntime's static QDQ with int16 activations, MatMulNBits); subgraph weights named like outer
tensors. For each: what the command and the library give is valid and runs, or says clearly why not.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

import passes
from passes.inspect import random_nodes
from tools.surgeon_compress import main

ort.set_default_logger_severity(3)


def _w(rng, *shape, scale=0.1):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _mlp(opset=17) -> onnx.ModelProto:
    """x [4, 64] -> MatMul w1 + b1 -> Relu -> MatMul w2 -> Tanh -> MatMul w3 -> y [4, 16]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(_w(rng, 64, 96), "w1"), numpy_helper.from_array(_w(rng, 96), "b1"),
             numpy_helper.from_array(_w(rng, 96, 80), "w2"), numpy_helper.from_array(_w(rng, 80, 16), "w3")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"]), helper.make_node("Add", ["h1", "b1"], ["h1b"]),
             helper.make_node("Relu", ["h1b"], ["h1r"]), helper.make_node("MatMul", ["h1r", "w2"], ["h2"]),
             helper.make_node("Tanh", ["h2"], ["h2t"]), helper.make_node("MatMul", ["h2t", "w3"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "mlp", [_vi("x", [4, 64])], [_vi("y", [4, 16])], inits),
                             opset_imports=[helper.make_opsetid("", opset)])


def _feeds(shape=(4, 64), n=3):
    rng = np.random.default_rng(5)
    return [{"x": rng.normal(size=shape).astype(np.float32)} for _ in range(n)]


def _run(model, feeds):
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return [session.run(None, f) for f in feeds]


def _snr(ref, got) -> float:
    """Worst output's SNR (dB) over the feeds; inf where equal."""
    worst = np.inf
    for j in range(len(ref[0])):
        r = np.concatenate([np.asarray(o[j], np.float64).ravel() for o in ref])
        c = np.concatenate([np.asarray(o[j], np.float64).ravel() for o in got])
        noise = float(np.sum((r - c) ** 2))
        if noise:
            worst = min(worst, 10 * np.log10(float(np.sum(r ** 2)) / noise))
    return worst


def _digests(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------ external data


@pytest.fixture
def spread(tmp_path):
    """The MLP with w1 and b1 in a.bin, w2 in b.bin and w3 in sub/dir/c.bin (offsets aligned to 64)."""
    src = tmp_path / "src"
    (src / "sub" / "dir").mkdir(parents=True)
    model = _mlp()
    where = {"w1": "a.bin", "b1": "a.bin", "w2": "b.bin", "w3": "sub/dir/c.bin"}
    for t in model.graph.initializer:
        path = src / where[t.name]
        offset = path.stat().st_size if path.exists() else 0
        offset += (-offset) % 64
        with open(path, "ab") as f:
            f.truncate(offset)
            f.write(t.raw_data)
        set_external_data(t, where[t.name], offset=offset, length=len(t.raw_data))
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
    onnx.save(model, str(src / "model.onnx"))
    return src / "model.onnx"


def test_external_data_in_several_files_packs_and_unpacks_every_file(spread, tmp_path):
    before = _digests(spread.parent)
    packed = tmp_path / "m.onnxz"
    passes.pack(str(spread), str(packed))
    out = tmp_path / "back"
    out.mkdir()
    passes.unpack(str(packed), str(out / "model.onnx"))
    assert _digests(out) == before  # model.onnx, a.bin, b.bin, sub/dir/c.bin: byte for byte
    assert passes.verify(str(packed), str(spread)).ok
    assert passes.load(str(packed)).SerializeToString() == onnx.load(str(spread)).SerializeToString()
    reference = {t.name: numpy_helper.to_array(t, base_dir=str(spread.parent)) for t in onnx.load(str(spread)).graph.initializer}
    with passes.open_packed(str(packed)) as p:
        assert sorted(p.keys()) == sorted(reference)
        for name, array in reference.items():
            assert np.array_equal(p.get_tensor(name), array)
    assert _digests(spread.parent) == before


def test_external_data_in_several_files_compresses_and_runs(spread, tmp_path, capsys):
    before = _digests(spread.parent)
    feeds = _feeds()
    ref = _run(spread, feeds)
    for out in (tmp_path / "q.onnx", tmp_path / "q.onnxz"):
        rc, _, err = _cli(capsys, "compress", spread, "-o", out, "--min-elements", "0")
        assert rc == 0, err
        model = passes.load(str(out)) if out.suffix == ".onnxz" else onnx.load(str(out))
        onnx.checker.check_model(model, full_check=True)
        assert _snr(ref, _run(model, feeds)) > 35
    session = passes.InferenceSession(str(tmp_path / "q.onnxz"), mode="int8")
    assert _snr(ref, [session.run(None, f) for f in feeds]) > 35
    assert _digests(spread.parent) == before


# ------------------------------------------------------------------------------ graph shapes


def test_an_initializer_that_is_also_a_graph_output_stays_an_output(tmp_path, capsys):
    model = _mlp()
    model.graph.output.extend([_vi("w2", [96, 80]), _vi("b1", [96])])
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    feeds = _feeds()
    ref = _run(src, feeds)
    out = tmp_path / "q.onnx"
    rc, _, err = _cli(capsys, "compress", src, "-o", out, "--min-elements", "0")
    assert rc == 0, err
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    assert [o.name for o in q.graph.output] == ["y", "w2", "b1"]
    got = _run(q, feeds)
    assert _snr(ref, got) > 35  # w2 given back as its int8 dequantization
    assert np.array_equal(got[0][2], ref[0][2])  # b1 (1-D) kept as it was
    folded = passes.fold_dequantize(q)
    onnx.checker.check_model(folded, full_check=True)
    assert [o.name for o in folded.graph.output] == ["y", "w2", "b1"]


def _function_model() -> onnx.ModelProto:
    """A model-local function Dense(inp) = inp @ Constant w + Constant b, called twice."""
    rng = np.random.default_rng(1)
    body = [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(_w(rng, 64, 64), "wc")),
            helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(_w(rng, 64), "bc")),
            helper.make_node("MatMul", ["inp", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["out"])]
    dense = helper.make_function("local", "Dense", ["inp"], ["out"], body, opset_imports=[helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Dense", ["x"], ["h"], domain="local"), helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Dense", ["hr"], ["h2"], domain="local"), helper.make_node("MatMul", ["h2", "wo"], ["y"])]
    g = helper.make_graph(nodes, "fn", [_vi("x", [4, 64])], [_vi("y", [4, 16])],
                          [numpy_helper.from_array(_w(rng, 64, 16), "wo")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                             functions=[dense])


def test_constants_in_a_function_body_are_quantized_inside_it(tmp_path, capsys):
    """A function body's Constant weight becomes Constant levels + DequantizeLinear in the body (the
    same value at every call); its 1-D bias stays. With include patterns (which name graph weights)
    the body stays float, and the note says why."""
    model = _function_model()
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    feeds = _feeds()
    ref = _run(src, feeds)
    out = tmp_path / "q.onnx"
    rc, stdout, err = _cli(capsys, "compress", src, "-o", out, "--min-elements", "0")
    assert rc == 0, err
    assert "stay float" not in stdout
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    body = q.functions[0].node
    dq = [n for n in body if n.op_type == "DequantizeLinear"]
    assert [n.output[0] for n in dq] == ["w"]
    levels = {n.output[0]: n.attribute[0].t for n in body if n.op_type == "Constant"}
    assert levels[dq[0].input[0]].data_type == TensorProto.INT8 and levels["b"].data_type == TensorProto.FLOAT
    assert _snr(ref, _run(q, feeds)) > 35
    rep = passes.Report()
    named = passes.quantize_weights(model, min_elements=0, include=["wo"], report=rep)
    assert [f.SerializeToString() for f in named.functions] == [f.SerializeToString() for f in model.functions]
    assert any("1 float weight(s) inside model-local functions stay float (1 not included" in n for n in rep.notes)
    packed = tmp_path / "q.onnxz"
    passes.pack(str(out), str(packed))
    session = passes.InferenceSession(str(packed), mode="fold")  # = the folded model in onnxruntime
    assert _snr(_run(passes.fold_dequantize(q), feeds), [session.run(None, f) for f in feeds]) > 100


def _training_model(dropout_training=True) -> onnx.ModelProto:
    """Conv -> BatchNormalization(training_mode=1: batch statistics, running mean/var outputs) ->
    Dropout(training_mode) -> Flatten -> MatMul, as a PyTorch export in train() mode."""
    rng = np.random.default_rng(2)
    c = 8
    inits = [numpy_helper.from_array(_w(rng, c, 3, 3, 3), "cw"), numpy_helper.from_array(_w(rng, c), "cb"),
             numpy_helper.from_array(np.abs(_w(rng, c)) + 1, "scale"), numpy_helper.from_array(_w(rng, c), "bias"),
             numpy_helper.from_array(_w(rng, c), "mean"), numpy_helper.from_array(np.abs(_w(rng, c)) + 1, "var"),
             numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
             numpy_helper.from_array(np.array(dropout_training), "train"),
             numpy_helper.from_array(_w(rng, c * 64, 10), "fc")]
    nodes = [helper.make_node("Conv", ["x", "cw", "cb"], ["cv"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["cv", "scale", "bias", "mean", "var"], ["bn", "rmean", "rvar"],
                              training_mode=1),
             helper.make_node("Dropout", ["bn", "ratio", "train"], ["dr", "mask"], seed=1),
             helper.make_node("Flatten", ["dr"], ["fl"]), helper.make_node("MatMul", ["fl", "fc"], ["y"])]
    g = helper.make_graph(nodes, "train", [_vi("x", [2, 3, 8, 8])],
                          [_vi("y", [2, 10]), _vi("rmean", [c]), _vi("rvar", [c]), _vi("mask", [2, c, 8, 8], TensorProto.BOOL)],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])


def test_a_training_mode_export_compresses_and_its_random_outputs_are_named(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_training_model(), str(src))
    feeds_path = tmp_path / "f.npz"
    np.savez(feeds_path, **{f"{i}/x": f["x"] for i, f in enumerate(_feeds((2, 3, 8, 8)))})
    out = tmp_path / "q.onnx"
    rc, stdout, err = _cli(capsys, "compress", src, "-o", out, "--min-elements", "0")
    assert rc == 0, err
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    assert [o.name for o in q.graph.output] == ["y", "rmean", "rvar", "mask"]
    _run(q, _feeds((2, 3, 8, 8)))
    rc, stdout, err = _cli(capsys, "eval", src, src, "--feeds", feeds_path, "--json")
    assert rc == 0, err
    [note] = [n for n in json.loads(stdout)["fidelity"]["notes"] if "draws random values" in n]
    assert "1 Dropout (training_mode true)" in note and "model.eval()" in note
    rc, stdout, _ = _cli(capsys, "compress", src, "-o", tmp_path / "t.onnx", "--feeds", feeds_path, "--target", "snr>=25")
    assert "draws random values" in stdout


@pytest.mark.parametrize("model, expected", [
    (_training_model(dropout_training=False), {}),  # batch statistics are not random draws
    (_training_model(), {"Dropout (training_mode true)": 1}),
])
def test_random_nodes(model, expected):
    assert random_nodes(model) == expected


def test_random_nodes_of_other_kinds():
    g = helper.make_graph(
        [helper.make_node("RandomNormalLike", ["x"], ["n"]), helper.make_node("Add", ["x", "n"], ["a"]),
         helper.make_node("Dropout", ["a", "", "t"], ["y"])], "r",
        [_vi("x", [4]), _vi("t", [], TensorProto.BOOL)], [_vi("y", [4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert random_nodes(model) == {"RandomNormalLike": 1, "Dropout (training_mode from input 't')": 1}


# ------------------------------------------------------------------------------ quantized by others


def test_a_qdq_model_with_int16_activations_is_left_and_folds(tmp_path, capsys):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    float_path, qdq = tmp_path / "f.onnx", tmp_path / "qdq.onnx"
    onnx.save(_mlp(21), str(float_path))
    feeds = _feeds(n=4)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.left = list(feeds)

        def get_next(self):
            return self.left.pop() if self.left else None

    quantize_static(str(float_path), str(qdq), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt16, weight_type=QuantType.QInt8)
    ref = _run(qdq, feeds)
    out = tmp_path / "q.onnx"
    rc, stdout, err = _cli(capsys, "compress", qdq, "-o", out, "--min-elements", "0")
    assert rc == 0, err
    assert "already quantized" in stdout and "DequantizeLinear" in stdout
    assert _snr(ref, _run(out, feeds)) == np.inf
    folded = tmp_path / "fold.onnx"
    rc, stdout, err = _cli(capsys, "fold", qdq, "-o", folded)
    assert rc == 0, err
    f = onnx.load(str(folded))
    onnx.checker.check_model(f, full_check=True)
    # the weights' DequantizeLinear folded; the int16 activations' QuantizeLinear/DequantizeLinear stay
    assert {n.op_type for n in f.graph.node} >= {"QuantizeLinear", "DequantizeLinear", "MatMul"}
    assert all(t.data_type != TensorProto.INT8 for t in f.graph.initializer)
    assert _snr(ref, _run(f, feeds)) > 35


def _matmulnbits_model() -> onnx.ModelProto:
    """x [4, 64] -> com.microsoft MatMulNBits (4 bits, blocks of 32, N 16) -> y, built by hand:
    the form onnxruntime's matmul_nbits_quantizer writes."""
    rng = np.random.default_rng(4)
    n, k, block = 16, 64, 32
    levels = rng.integers(0, 16, size=(n, k)).astype(np.uint8)
    packed = (levels[:, 0::2] | (levels[:, 1::2] << 4)).reshape(n, k // block, block // 2)
    scales = (rng.random(n * (k // block)) * 0.05 + 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "B", "scales"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=block)
    g = helper.make_graph([node], "nbits", [_vi("x", [4, k])], [_vi("y", [4, n])],
                          [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def test_a_matmulnbits_model_is_left_as_it_is_and_fold_says_so(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_matmulnbits_model(), str(src))
    feeds = _feeds()
    ref = _run(src, feeds)
    out = tmp_path / "q.onnx"
    rc, stdout, err = _cli(capsys, "compress", src, "-o", out, "--min-elements", "0")
    assert rc == 0, err
    assert "already quantized: 1 integer weight(s)" in stdout and "MatMulNBits" in stdout
    assert _snr(ref, _run(out, feeds)) == np.inf
    folded = tmp_path / "f.onnx"
    rc, stdout, err = _cli(capsys, "fold", src, "-o", folded, "--json")
    assert rc == 0, err
    [note] = [n for n in json.loads(stdout)["report"]["notes"] if "integer weights left as they are" in n]
    assert "1 read by MatMulNBits (512 bytes)" in note
    assert _snr(ref, _run(folded, feeds)) == np.inf
    packed = tmp_path / "m.onnxz"
    passes.pack(str(src), str(packed))
    back = tmp_path / "back.onnx"
    passes.unpack(str(packed), str(back))
    assert back.read_bytes() == src.read_bytes()
    for mode in ("fold", "int8"):
        session = passes.InferenceSession(str(packed), mode=mode)
        assert _snr(ref, [session.run(None, f) for f in feeds]) == np.inf


def test_fold_of_an_int8_model_has_no_such_note(tmp_path, capsys):
    src, q = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(_mlp(), str(src))
    assert main(["compress", str(src), "-o", str(q), "--min-elements", "0"]) == 0
    capsys.readouterr()
    rc, stdout, _ = _cli(capsys, "fold", q, "-o", tmp_path / "f.onnx")
    assert rc == 0 and "left as they are" not in stdout and "3 weight(s) folded to float" in stdout


# ------------------------------------------------------------------------------ shadowing


def _shadowing_model() -> onnx.ModelProto:
    """Main graph W [64, 16] (MatMul, ReduceSum) and an If whose branches hold their own W."""
    rng = np.random.default_rng(6)
    then_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [], [_vi("t", [4, 16])],
                               [numpy_helper.from_array(_w(rng, 64, 16, scale=0.3), "W")])
    else_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["e"]), helper.make_node("Add", ["e", "Wsum"], ["e2"])],
                               "else", [], [_vi("e2", [4, 16])], [numpy_helper.from_array(_w(rng, 64, 16, scale=-0.2), "W")])
    g = helper.make_graph(
        [helper.make_node("ReduceSum", ["W", "ax"], ["Wsum"], keepdims=1),
         helper.make_node("If", ["cond"], ["z"], then_branch=then_g, else_branch=else_g),
         helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["z", "m"], ["y"])],
        "shadow", [_vi("x", [4, 64]), _vi("cond", [], TensorProto.BOOL)], [_vi("y", [4, 16])],
        [numpy_helper.from_array(_w(rng, 64, 16), "W"), numpy_helper.from_array(np.array([0], np.int64), "ax")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_shadowing_weights_compress_to_a_valid_model(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_shadowing_model(), str(src))
    rng = np.random.default_rng(7)
    feeds = [{"x": rng.normal(size=(4, 64)).astype(np.float32), "cond": np.array(c)} for c in (True, False)]
    ref = _run(src, feeds)
    for args in ((), ("--bits", "4", "--block-size", "32")):
        out = tmp_path / f"q{len(args)}.onnx"
        rc, _, err = _cli(capsys, "compress", src, "-o", out, "--min-elements", "0", *args)
        assert rc == 0, err
        onnx.checker.check_model(str(out), full_check=True)
        assert _snr(ref, _run(out, feeds)) > (35 if not args else 10)
    pal = passes.palettize(str(src), bits=4, min_elements=0)
    onnx.checker.check_model(pal, full_check=True)


# ------------------------------------------------------------------------------ a branch returning its weight


def _branch_returns_weight() -> onnx.ModelProto:
    """An If whose then-branch returns its own initializer Wt [4, 16] as its output (no node), the
    else-branch x @ W; and an output that passes x through."""
    rng = np.random.default_rng(8)
    then_g = helper.make_graph([], "then", [], [_vi("Wt", [4, 16])], [numpy_helper.from_array(_w(rng, 4, 16), "Wt")])
    else_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["e"])], "else", [], [_vi("e", [4, 16])])
    g = helper.make_graph([helper.make_node("If", ["cond"], ["z"], then_branch=then_g, else_branch=else_g),
                           helper.make_node("Identity", ["x"], ["xpass"])], "branch_weight",
                          [_vi("x", [4, 64]), _vi("cond", [], TensorProto.BOOL)], [_vi("z", [4, 16]), _vi("xpass", [4, 64])],
                          [numpy_helper.from_array(_w(rng, 64, 16), "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_branch_returning_its_own_weight_compresses(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_branch_returns_weight(), str(src))
    rng = np.random.default_rng(9)
    feeds = [{"x": rng.normal(size=(4, 64)).astype(np.float32), "cond": np.array(c)} for c in (True, False)]
    ref = _run(src, feeds)
    out = tmp_path / "q.onnx"
    rc, _, err = _cli(capsys, "compress", src, "-o", out, "--min-elements", "0")
    assert rc == 0, err
    onnx.checker.check_model(str(out), full_check=True)
    assert _snr(ref, _run(out, feeds)) > 35


def test_a_branch_returning_its_own_weight_is_searched(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_branch_returns_weight(), str(src))
    rng = np.random.default_rng(9)
    feeds_path = tmp_path / "f.npz"
    np.savez(feeds_path, **{f"{i}/x": rng.normal(size=(4, 64)).astype(np.float32) for i in range(2)},
             **{f"{i}/cond": np.array(c) for i, c in enumerate((True, False))})
    out = tmp_path / "t.onnx"
    rc, _, err = _cli(capsys, "compress", src, "-o", out, "--feeds", feeds_path, "--target", "snr>=25")
    assert rc == 0, err
    onnx.checker.check_model(str(out), full_check=True)
