"""passes.InferenceSession: sessions from compressed .onnx and packed .onnxz in every mode.

Small generated models (Conv, MatMul, Gemm with transB and bias, Gather, a Constant-node weight,
If/Loop subgraphs), quantized with passes.quantize_weights, packed with passes.pack.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import CorruptFileError, FileAccessError, InvalidArgumentError, SurgeonError

import modelgen as mg

CPU = ["CPUExecutionProvider"]


def _w(shape, seed, scale=None):
    rng = np.random.default_rng(seed)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    return (rng.standard_normal(shape) * (scale or 1 / np.sqrt(fan_in))).astype(np.float32)


def _model(nodes, inputs, outputs, inits, opset=17):
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def dense_model():
    """MatMul, Gemm (bias, transB=0), Gemm (bias, transB=1): weights big enough to be fed."""
    inits = [numpy_helper.from_array(_w((256, 384), 1), "W1"), numpy_helper.from_array(_w((384, 128), 2), "W2"),
             numpy_helper.from_array(_w((128,), 3, 0.1), "C2"), numpy_helper.from_array(_w((96, 128), 4), "W3"),
             numpy_helper.from_array(_w((96,), 5, 0.1), "C3")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Gemm", ["r1", "W2", "C2"], ["h2"]),
             helper.make_node("Gemm", ["h2", "W3", "C3"], ["y"], transB=1)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 96])], inits)


def conv_model():
    inits = [numpy_helper.from_array(_w((64, 32, 3, 3), 6), "W"), numpy_helper.from_array(_w((64,), 7, 0.1), "B")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 12, 12])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 12, 12])], inits)


def gather_constant_model():
    """Embedding Gather, then a MatMul whose weight is a Constant node of the main graph."""
    const = numpy_helper.from_array(_w((64, 128), 9), "Wc")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"], axis=0),
             helper.make_node("Constant", [], ["Wc"], value=const),
             helper.make_node("MatMul", ["e", "Wc"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 7])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7, 128])],
                  [numpy_helper.from_array(_w((500, 64), 8, 1.0), "E")])


BUILDERS = {"dense": dense_model, "conv": conv_model, "gather": gather_constant_model,
            "subgraph": lambda: mg.subgraph_model("float32", 17)}


def feeds_for(model, n=2):
    return mg.feeds(model, seed=1, n=n)


def run_plain(model_or_path, feeds):
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    s = ort.InferenceSession(src, providers=CPU)
    return [s.run(None, f) for f in feeds]


def run(session, feeds):
    return [session.run(None, f) for f in feeds]


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> {"float", "q8", "q8z", "q4", "floatz"} paths, plus the models."""
    root = tmp_path_factory.mktemp("runtime")
    out = {}
    for name, build in BUILDERS.items():
        m = build()
        paths = {"model": m, "float": root / f"{name}.onnx"}
        onnx.save(m, str(paths["float"]))
        q8 = passes.quantize_weights(m, bits=8, min_elements=256)
        paths["q8"] = root / f"{name}.q8.onnx"
        onnx.save(q8, str(paths["q8"]))
        paths["folded"] = passes.fold_dequantize(q8)
        paths["q8z"] = root / f"{name}.q8.onnxz"
        passes.pack(str(paths["q8"]), str(paths["q8z"]))
        paths["floatz"] = root / f"{name}.onnxz"
        passes.pack(str(paths["float"]), str(paths["floatz"]))
        out[name] = paths
    q4 = passes.quantize_weights(dense_model(), bits=4, granularity="block", block_size=32, min_elements=256)
    out["dense"]["q4"] = root / "dense.q4.onnx"
    onnx.save(q4, str(out["dense"]["q4"]))
    out["dense"]["q4_folded"] = passes.fold_dequantize(q4)
    return out


# ---------------------------------------------------------------------- fold mode

@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("source", ["q8", "q8z"])
def test_fold_equals_the_folded_model(files, name, source):
    f = files[name]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f[source], providers=CPU, mode="fold")
    assert isinstance(session, ort.InferenceSession)
    assert session.mode == "fold"
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fold_of_a_lossless_pack_equals_the_original(files, name):
    f = files[name]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["floatz"], mode="fold")
    for got, want in zip(run(session, feeds), run_plain(f["model"], feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_fold_shares_weights_without_a_copy(files):
    session = passes.InferenceSession(files["dense"]["q8z"], mode="fold")
    assert session.shared_names  # MatMul/Gemm weights handed over as the session's own buffers
    for name in session.shared_names:
        assert session.weight_arrays[name].dtype == np.float32
    assert session.skeleton_bytes < 4096  # the protobuf carries no weights
    assert session.fold_route == "here"
    assert passes.InferenceSession(files["dense"]["floatz"], mode="fold").fold_route is None  # nothing to fold


def conv_with_small_matmul_model():
    """Two Conv weights and a small MatMul weight after them (a classifier head, as in ResNet)."""
    inits = [numpy_helper.from_array(_w((64, 32, 3, 3), 41), "W1"), numpy_helper.from_array(_w((64, 64, 3, 3), 42), "W2"),
             numpy_helper.from_array(_w((64, 8), 43), "Wfc"), numpy_helper.from_array(np.array([1, 64], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "W2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"]), helper.make_node("Reshape", ["p", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "Wfc"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)


@pytest.mark.parametrize("packed", [False, True])
def test_fold_of_nearly_all_conv_weights_is_left_to_onnxruntime(tmp_path, packed):
    """float32 weights that are nearly all Conv weights (which onnxruntime folds itself, see
    plan_fold): the whole fold is left to it (route "onnxruntime"), outputs identical to the
    folded model's; mostly MatMul/Gemm weights are still folded here and shared (dense model)."""
    m = conv_with_small_matmul_model()
    q8 = passes.quantize_weights(m, bits=8, min_elements=256)
    path = tmp_path / "convs.q8.onnx"
    onnx.save(q8, str(path))
    if packed:
        passes.pack(str(path), str(tmp_path / "convs.q8.onnxz"))
        path = tmp_path / "convs.q8.onnxz"
    session = passes.InferenceSession(path, mode="fold")
    assert session.fold_route == "onnxruntime" and session.op_counts.get("DequantizeLinear", 0) == 3
    assert not session.shared_names
    feeds = feeds_for(m)
    for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(q8), feeds)):
        np.testing.assert_array_equal(got[0], want[0])


def test_fold_of_blocked_int4(files):
    f = files["dense"]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["q4"], mode="fold")
    for got, want in zip(run(session, feeds), run_plain(f["q4_folded"], feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def _with_external_data(model_path, folder):
    """A copy of the model in `folder` whose every tensor lies in one external data file."""
    path = folder / "ext.onnx"
    onnx.save(onnx.load(str(model_path)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    return path


def test_external_data_model(files, tmp_path):
    f = files["dense"]
    path = _with_external_data(f["q8"], tmp_path)
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(path, mode="fold")
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_packed_external_data_model(files, tmp_path):
    """A packed model whose weights lie in an external data file: decoded from the pack together."""
    f = files["dense"]
    packed = tmp_path / "ext.onnxz"
    passes.pack(str(_with_external_data(f["q8"], tmp_path)), str(packed))
    feeds = feeds_for(f["model"])
    for mode in ("fold", "int8"):
        session = passes.InferenceSession(packed, mode=mode)
        reference = run(passes.InferenceSession(f["q8"], mode=mode), feeds)
        for got, want in zip(run(session, feeds), reference):
            np.testing.assert_array_equal(got[0], want[0])


def test_packed_external_payload_read_as_a_range(files, tmp_path, monkeypatch):
    """An external payload the pack did not cut into a tensor of its own is read as a byte range
    (offsets in that range start at the tensor)."""
    import passes.runtime_source as source

    f = files["dense"]
    packed = tmp_path / "ext.onnxz"
    passes.pack(str(_with_external_data(f["q8"], tmp_path)), str(packed))
    real = source._entries
    monkeypatch.setattr(source, "_entries", lambda pf: {k: t for k, t in real(pf).items() if k[0] == 0})
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(packed, mode="fold")
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_copied_weights_travel_inside_the_model(files, monkeypatch):
    """A Conv weight (onnxruntime reorders it, so it cannot be shared) goes inside the model given to
    onnxruntime, streamed through a pipe or, where that is not available, as bytes: same outputs."""
    import passes.runtime as runtime

    f = files["conv"]
    feeds = feeds_for(f["model"])
    want = run_plain(f["model"], feeds)
    streamed = passes.InferenceSession(f["floatz"], mode="fold")
    assert "W" in streamed.embedded_names and "W" not in streamed.weight_arrays  # our copy is gone
    assert streamed.skeleton_bytes < 4096
    monkeypatch.setattr(runtime, "_streaming_supported", lambda: False)
    joined = passes.InferenceSession(f["floatz"], mode="fold")
    assert joined.embedded_names == streamed.embedded_names
    for a, b, w in zip(run(streamed, feeds), run(joined, feeds), want):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[0], w[0], rtol=1e-6, atol=1e-6)


def damage_biggest_weight(src, dst):
    """A copy of pack `src` at `dst` with one byte flipped in its biggest weight's last chunk."""
    from passes.onnxz import open_packed

    with open_packed(src) as packed:
        entry = max(packed.packed_file.index.tensors, key=lambda t: t.length)
        chunk = entry.stream.chunks[-1]
        offset = chunk.offset + sum(chunk.planes) // 2
    data = bytearray(src.read_bytes())
    data[offset] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


def test_damaged_payload_of_a_pack(files, tmp_path):
    """A weight chunk that fails its checksum: CorruptFileError, not a session."""
    bad = damage_biggest_weight(files["dense"]["floatz"], tmp_path / "bad.onnxz")
    with pytest.raises(CorruptFileError):
        passes.InferenceSession(bad, mode="fold")


def test_no_streaming_where_sigpipe_would_kill():
    import signal

    import passes.runtime as runtime

    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        assert not runtime._streaming_supported()
    finally:
        signal.signal(signal.SIGPIPE, previous)


def test_refused_model_is_reported_after_streaming(tmp_path):
    """onnxruntime refusing a streamed model (a Conv weight of the wrong rank) gives our error, no hang."""
    w = numpy_helper.from_array(_w((64, 32, 3), 6), "W")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(SurgeonError):
        passes.InferenceSession(path, mode="fold")


# ---------------------------------------------------------------------- precision

@pytest.mark.parametrize("name", ["dense", "conv", "gather"])
def test_float32_model_as_float16(files, name):
    f = files[name]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["q8z"], mode="fold", dtype="float16")
    assert session.dtype == np.float16
    assert any(a.dtype == np.float16 for a in session.weight_arrays.values()) or not session.shared_names
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        assert got[0].dtype == np.float32  # graph inputs/outputs keep their type
        assert cosine(got[0], want[0]) > 0.999


def test_float16_model_as_float32(tmp_path):
    m = mg.dense_model("float16", 17)
    path = tmp_path / "fp16.onnx"
    onnx.save(m, str(path))
    feeds = mg.feeds(m)
    want = run_plain(m, feeds)
    session = passes.InferenceSession(path, mode="fold", dtype="float32")
    assert session.dtype == np.float32
    for got, w in zip(run(session, feeds), want):
        assert got[0].dtype == np.float16  # output type kept
        np.testing.assert_allclose(got[0].astype(np.float32), w[0].astype(np.float32), rtol=2e-2, atol=2e-2)
    as32 = passes.InferenceSession(path, mode="fold", dtype="float32", keep_io_types=False)
    assert as32.get_outputs()[0].type == "tensor(float)"


@pytest.mark.parametrize("size", [0, 5, 70_000, 300_001])
def test_float16_weights_converted_as_onnxruntimes_converter_does(size):
    """to_float16_clamped gives the bits of onnxruntime's convert_np_to_float16 (tiny values to
    the smallest subnormal, overflow to the largest finite, inf/NaN/zeros kept), on the small
    (numpy) and big (onnxruntime Cast) paths; cast_array is astype, bit for bit."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    from passes.precision import cast_array, to_float16_clamped

    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 0.05).astype(np.float32)
    edge = np.array([0, -0.0, 1e-9, -1e-9, 3e-8, -3e-8, 2.98e-8, 6e-8, 7e4, -7e4, 65510, 65530, np.inf, -np.inf,
                     np.nan, 1e30, -1e30, 5.96e-8, -5.96e-8, 2.0 ** -25], np.float32)
    for case in ([x], [x, edge[3:4]], [x, edge]):  # clean, one negative tiny value, every edge
        a = np.concatenate(case)
        assert np.array_equal(to_float16_clamped(a).view(np.uint16), convert_np_to_float16(a).view(np.uint16))
    with np.errstate(over="ignore"):  # the edges past 65504 become inf on purpose
        h = np.concatenate([x, edge]).astype(np.float16).reshape(-1, 1)
    got = cast_array(h, np.float32)
    assert got.shape == h.shape and np.array_equal(got.view(np.uint32), h.astype(np.float32).view(np.uint32))


@pytest.fixture(params=["here", "onnxruntime"])
def float16_route(request, monkeypatch):
    """The fold route of float16 weights on a CPU: "here" where the one-pass kernel runs vectorised
    (runtime_fold.fold_kernel_fast), else "onnxruntime"; both forced, whatever this CPU has (the
    numpy path computes the kernel's bits)."""
    import passes.runtime_fold

    monkeypatch.setattr(passes.runtime_fold, "fold_kernel_fast", lambda: request.param == "here")
    return request.param


def test_float16_fold_on_cpu_lets_onnxruntime_fold(tmp_path, float16_route):
    """float16 weights on a CPU: without the vectorised kernel onnxruntime gets the integer levels
    and folds them itself (it casts them to float32 anyway); with it they are folded here as they
    decode; outputs identical to the folded model's either way."""
    inits = [numpy_helper.from_array(_w((256, 384), 21).astype(np.float16), "W1"),
             numpy_helper.from_array(_w((384, 128), 22).astype(np.float16), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 256])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 128])], inits)
    q8 = passes.quantize_weights(m, bits=8, min_elements=256)
    path = tmp_path / "fp16.q8.onnx"
    onnx.save(q8, str(path))
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 256)).astype(np.float16)} for i in range(2)]
    for source in (path, tmp_path / "fp16.q8.onnxz"):
        if source.suffix == ".onnxz":
            passes.pack(str(path), str(source))
        session = passes.InferenceSession(source, mode="fold")
        assert session.dtype == np.float16
        assert session.fold_route == float16_route
        # left to onnxruntime's constant folding, or none left
        assert (session.op_counts.get("DequantizeLinear", 0) >= 1) == (float16_route == "onnxruntime")
        for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(q8), feeds)):
            np.testing.assert_array_equal(got[0], want[0])


def test_float16_fold_on_cpu_small_weights_and_constants_left_to_onnxruntime(tmp_path, float16_route):
    """float16 on a CPU with only DequantizeLinear to fold: without the vectorised kernel the model
    goes to onnxruntime as it is (small weights and a Constant-node scale included), with it every
    one is folded here; outputs identical to the folded model's."""
    big = _w((256, 64), 31)
    big_scale = (np.abs(big).max(axis=0) / 127).astype(np.float16)
    big_q = np.clip(np.round(big / big_scale.astype(np.float32)), -127, 127).astype(np.int8)
    small_q = np.random.default_rng(32).integers(-127, 128, (64,), dtype=np.int8)
    inits = [numpy_helper.from_array(big_q, "Wq"), numpy_helper.from_array(big_scale, "Ws"),
             numpy_helper.from_array(small_q, "Bq")]
    nodes = [helper.make_node("Constant", [], ["Bs"], value=numpy_helper.from_array(np.array(0.01, np.float16))),
             helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"], axis=1),
             helper.make_node("DequantizeLinear", ["Bq", "Bs"], ["B"]),
             helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 256])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 64])], inits, opset=19)
    path = tmp_path / "fp16.q8.onnx"
    onnx.save(m, str(path))
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 256)).astype(np.float16)} for i in range(2)]
    session = passes.InferenceSession(path, mode="fold")
    assert session.dtype == np.float16 and session.fold_route == float16_route
    if float16_route == "onnxruntime":
        assert session.op_counts.get("DequantizeLinear") == 2 and session.op_counts.get("Constant") == 1
    else:
        assert not session.op_counts.get("DequantizeLinear") and not session.op_counts.get("Constant")
    for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(m), feeds)):
        np.testing.assert_array_equal(got[0], want[0])

def test_float16_fold_keeps_constant_nodes_no_dequantize_reads(tmp_path, float16_route):
    """float16 on a CPU, every foldable node a DequantizeLinear: a Constant node none of them reads
    (a Reshape's shape) is not moved into an initializer by the load (onnxruntime does that as it
    loads the graph, as for the plain file); outputs identical to the folded model's."""
    big = _w((256, 64), 33)
    scale = (np.abs(big).max(axis=0) / 127).astype(np.float16)
    levels = np.clip(np.round(big / scale.astype(np.float32)), -127, 127).astype(np.int8)
    nodes = [helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([2, 128], np.int64))),
             helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"], axis=1),
             helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Reshape", ["h", "shape"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 256])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 128])],
               [numpy_helper.from_array(levels, "Wq"), numpy_helper.from_array(scale, "Ws")], opset=19)
    path = tmp_path / "fp16.q8.onnx"
    onnx.save(m, str(path))
    passes.pack(str(path), str(tmp_path / "fp16.q8.onnxz"))
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 256)).astype(np.float16)} for i in range(2)]
    for source in (path, tmp_path / "fp16.q8.onnxz"):
        session = passes.InferenceSession(source, mode="fold")
        assert session.fold_route == float16_route and session.op_counts.get("Constant") == 1
        for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(m), feeds)):
            np.testing.assert_array_equal(got[0], want[0])



def test_onnxruntime_folds_all_only_plain_dequantize_graphs():
    """fold_facts' onnxruntime_folds_all: activations quantized (QuantizeLinear), a palette or a
    subgraph: folded here, not left to onnxruntime."""
    from passes.runtime_feed import split_model
    from passes.runtime_fold import fold_facts

    def onnxruntime_folds_all(split):
        return fold_facts(split)[1]

    q = numpy_helper.from_array(np.ones((64, 64), np.int8), "Wq")
    s = numpy_helper.from_array(np.array(0.5, np.float16), "Ws")
    dq = helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"])
    mm = helper.make_node("MatMul", ["x", "W"], ["y"])
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 64])])
    assert onnxruntime_folds_all(split_model(_model([dq, mm], *io, [q, s], opset=19)))
    quant = [helper.make_node("QuantizeLinear", ["x", "Ws"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "Ws"], ["xd"]), dq,
             helper.make_node("MatMul", ["xd", "W"], ["y"])]
    assert not onnxruntime_folds_all(split_model(_model(quant, *io, [q, s], opset=19)))
    table = numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float16), "T")
    idx = numpy_helper.from_array(np.zeros((64, 64), np.uint8), "I")
    palette = [helper.make_node("Cast", ["I"], ["Ii"], to=TensorProto.INT32),
               helper.make_node("Gather", ["T", "Ii"], ["W"]), mm]
    assert not onnxruntime_folds_all(split_model(_model(palette, *io, [table, idx], opset=19)))
    body = helper.make_graph([helper.make_node("Identity", ["W"], ["z"])], "b", [],
                             [helper.make_tensor_value_info("z", TensorProto.FLOAT16, [64, 64])])
    cond = numpy_helper.from_array(np.array(True), "c")
    branch = [dq, helper.make_node("If", ["c"], ["W2"], then_branch=body, else_branch=body),
              helper.make_node("MatMul", ["x", "W2"], ["y"])]
    assert not onnxruntime_folds_all(split_model(_model(branch, *io, [q, s, cond], opset=19)))


@pytest.mark.parametrize("zero_point", [False, True])
def test_float16_dequantize_bits_match_onnxruntime(zero_point):
    """The arithmetic fold_dequantize uses (passes.forms) gives onnxruntime's DequantizeLinear bits
    for float16 output, at the edges too: subnormal and zero results, overflow to infinity, ties."""
    from passes import forms

    rng = np.random.default_rng(7)
    q = rng.integers(-128, 128, (12, 4096), dtype=np.int8)
    q[:, :256] = np.arange(-128, 128, dtype=np.int8)  # every level in every row
    # per-row scales: subnormal products, products around the smallest normal, ordinary ones,
    # products rounding to ties, and products beyond 65504 (infinity)
    scale = np.array([1e-7, 6e-8, 3e-6, 4.5e-7, 2.3e-4, 0.01, 0.37, 1.0, 255.0, 515.0, 600.0, 65504.0], np.float16)
    zp = rng.integers(-20, 20, (12,), dtype=np.int8) if zero_point else None
    inits = [numpy_helper.from_array(scale, "s")] + ([numpy_helper.from_array(zp, "z")] if zero_point else [])
    node = helper.make_node("DequantizeLinear", ["q", "s"] + (["z"] if zero_point else []), ["y"], axis=0)
    m = _model([node], [helper.make_tensor_value_info("q", TensorProto.INT8, list(q.shape))],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, list(q.shape))], inits, opset=19)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(m.SerializeToString(), options, providers=CPU).run(None, {"q": q})[0]
    with np.errstate(over="ignore"):
        got = forms.dequantize_linear(q, scale, zp, 0, 0)
    assert got.dtype == np.float16
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.isinf(want).any() and (want == 0).any() and (np.abs(want[want != 0]) < 6.1e-5).any()


# ---------------------------------------------------------------------- int8 / int4

@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("source", ["q8", "q8z"])
def test_int8_close_to_float(files, name, source):
    f = files[name]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f[source], mode="int8")
    assert session.mode == "int8"
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        assert cosine(got[0], want[0]) > 0.999


def test_int8_keeps_weights_quantized(files):
    session = passes.InferenceSession(files["dense"]["q8z"], mode="int8")
    assert session.op_counts.get("MatMulNBits") == 3  # MatMul and both Gemm weights
    assert all(a.dtype.kind in "iu" or a.size < 1024 for a in session.weight_arrays.values())
    embed = passes.InferenceSession(files["gather"]["q8z"], mode="int8")
    assert embed.op_counts.get("Gather", 0) >= 1 and "DequantizeLinear" not in embed.op_counts
    conv = passes.InferenceSession(files["conv"]["q8z"], mode="int8")
    assert conv.op_counts.get("DequantizeLinear") == 1  # the Conv weight stays int8, dequantized per run


def test_int8_folds_the_first_convolutions(monkeypatch, tmp_path):
    """int8 mode folds the Conv weights met first in the graph, up to a share of all Conv weights."""
    import passes.runtime_int8 as int8

    inits = [numpy_helper.from_array(_w((32, 8, 3, 3), 11), "W1"), numpy_helper.from_array(_w((64, 32, 3, 3), 12), "W2"),
             numpy_helper.from_array(_w((128, 64, 3, 3), 13), "W3")]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "W2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c2", "W3"], ["y"], pads=[1, 1, 1, 1])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128, 10, 10])], inits)
    q8 = passes.quantize_weights(m, bits=8, min_elements=256)
    path = tmp_path / "convs.q8.onnx"
    onnx.save(q8, str(path))
    feeds = feeds_for(m)
    want = run_plain(passes.fold_dequantize(q8), feeds)
    counts = {}
    for share in (0.0, 0.3, 1.0):  # W1 is 2304 of 94464 weights, W1 + W2 20736
        monkeypatch.setattr(int8, "EARLY_CONV_FLOAT_SHARE", share)
        session = passes.InferenceSession(path, mode="int8")
        counts[share] = session.op_counts.get("DequantizeLinear", 0)
        for got, w in zip(run(session, feeds), want):
            np.testing.assert_allclose(got[0], w[0], rtol=1e-5, atol=1e-5)
    assert counts == {0.0: 2, 0.3: 1, 1.0: 0}  # W1 (2.3 KB of int8) is folded as small in any case


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "batchnorm", "batchnorm-float"])
def test_int8_takes_per_channel_arithmetic_into_the_conv(monkeypatch, tmp_path, layout):
    """Conv -> [Transpose, Cast] -> Add / Sub / Mul by per-channel constants (a bias, a decomposed
    batch norm): taken into the Conv (bias, DequantizeLinear scale or float weight rows), since
    onnxruntime fuses them only for constant weights. Same outputs as the unfused graph: bit for
    bit for a lone bias Add, to the last bits when regrouped."""
    import passes.runtime_int8 as int8

    monkeypatch.setattr(int8, "EARLY_CONV_FLOAT_SHARE", 1.0 if layout == "batchnorm-float" else 0.0)
    c = 64
    inits = [numpy_helper.from_array(_w((c, 32, 3, 3), 31), "W"), numpy_helper.from_array(_w((c,), 32, 0.1), "B")]
    if layout == "nchw":
        inits.append(numpy_helper.from_array(_w((1, c, 1, 1), 33, 0.5), "A"))
        nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Add", ["A", "c"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
        out_shape = [1, c, 12, 12]
    else:  # as tf2onnx writes it: NHWC values behind a Transpose and a no-op Cast
        inits.append(numpy_helper.from_array(_w((c,), 33, 0.5), "A"))
        nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1]),
                 helper.make_node("Cast", ["t"], ["f"], to=TensorProto.FLOAT),
                 helper.make_node("Add", ["f", "A"], ["a"])]
        last = "a"
        if layout.startswith("batchnorm"):
            inits += [numpy_helper.from_array(_w((1, 1, 1, c), 34, 0.3), "S"),
                      numpy_helper.from_array(np.abs(_w((1, 1, 1, c), 35)) + 0.5, "M"),
                      numpy_helper.from_array(_w((1, 1, 1, c), 36, 0.3), "O")]
            nodes += [helper.make_node("Sub", ["a", "S"], ["s"]), helper.make_node("Mul", ["M", "s"], ["m"]),
                      helper.make_node("Add", ["m", "O"], ["o"])]
            last = "o"
        nodes.append(helper.make_node("Relu", [last], ["y"]))
        out_shape = [1, 12, 12, c]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 12, 12])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    q8 = passes.quantize_weights(m, bits=8, min_elements=256)
    path = tmp_path / f"conv_{layout}.q8.onnx"
    onnx.save(q8, str(path))
    feeds = feeds_for(m)
    fused = passes.InferenceSession(path, mode="int8")
    assert not any(fused.op_counts.get(op) for op in ("Add", "Sub", "Mul"))
    assert fused.op_counts.get("DequantizeLinear", 0) == (0 if layout == "batchnorm-float" else 1)
    monkeypatch.setattr(int8, "fuse_conv_bias_adds", lambda split: 0)
    plain = passes.InferenceSession(path, mode="int8")
    assert plain.op_counts.get("Add")
    for a, b, w in zip(run(fused, feeds), run(plain, feeds), run_plain(passes.fold_dequantize(q8), feeds)):
        if layout == "nhwc":  # no bias before: the same one addition
            np.testing.assert_array_equal(a[0], b[0])
        else:  # regrouped (B + A, scale * M): last-bit differences
            np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a[0], w[0], rtol=1e-4, atol=1e-4)


def test_int8_quantizes_a_lossless_model_at_load(files):
    f = files["dense"]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["float"], mode="int8")
    assert session.op_counts.get("MatMulNBits") == 3
    for got, want in zip(run(session, feeds), run_plain(f["model"], feeds)):
        assert cosine(got[0], want[0]) > 0.999


def test_int8_quantizes_a_lossless_opset12_model_at_load(tmp_path):
    """Below opset 13 the skeleton is converted (Squeeze's axes attribute becomes an input there),
    not just renumbered: onnxruntime refused the renumbered graph."""
    w = _w((256, 384), 7)
    nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),
             helper.make_node("Squeeze", ["u"], ["s"], axes=[0]),
             helper.make_node("MatMul", ["s", "W"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 384])],
                   [numpy_helper.from_array(w, "W")], opset=12)
    packed = tmp_path / "m.onnxz"
    passes.pack(model, packed)
    session = passes.InferenceSession(packed, mode="int8")
    assert session.op_counts.get("MatMulNBits") == 1
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    got = session.run(None, {"x": x})[0]
    assert cosine(got, x @ w) > 0.999


def test_int8_quantizes_float16_conv_weights_at_load(tmp_path):
    """float16 weights get float16 scales, which DequantizeLinear takes from opset 19: the opset-13
    skeleton is converted (it was left at 13 and onnxruntime refused the float16 scale)."""
    w = _w((64, 32, 3, 3), 8).astype(np.float16)
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 32, 8, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 64, 8, 8])],
                   [numpy_helper.from_array(w, "W")], opset=13)
    packed = tmp_path / "m.onnxz"
    passes.pack(model, packed)
    session = passes.InferenceSession(packed, mode="int8")
    assert session.op_counts.get("DequantizeLinear") == 1
    feeds = [{"x": np.random.default_rng(2).standard_normal((1, 32, 8, 8)).astype(np.float16)}]
    got, want = run(session, feeds)[0][0], run_plain(model, feeds)[0][0]
    assert cosine(got.astype(np.float32), want.astype(np.float32)) > 0.999


def test_int4_blocked(files):
    f = files["dense"]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["q4"], mode="int4")
    assert session.op_counts.get("MatMulNBits") == 3
    for got, want in zip(run(session, feeds), run_plain(f["q4_folded"], feeds)):
        assert cosine(got[0], want[0]) > 0.995
    lossless = passes.InferenceSession(f["float"], mode="int4")
    assert lossless.op_counts.get("MatMulNBits") == 3
    for got, want in zip(run(lossless, feeds), run_plain(f["model"], feeds)):
        assert cosine(got[0], want[0]) > 0.97  # 4-bit round-to-nearest of random weights, 3 layers


def test_auto_says_what_it_picked(files, caplog):
    with caplog.at_level("INFO", logger="passes.runtime"):
        session = passes.InferenceSession(files["dense"]["q8z"], mode="auto")
    assert session.mode in ("fold", "int8")
    assert session.mode_reason
    assert any("mode=auto picked" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------- options and errors

def test_callers_session_options_are_not_modified(files):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = passes.InferenceSession(files["dense"]["q8z"], options, mode="int8")
    assert session.get_session_options().intra_op_num_threads == 1
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception):
        options.get_session_config_entry("session.qdq_matmulnbits_accuracy_level")
    # still usable for a plain onnxruntime session of another model
    plain = ort.InferenceSession(str(files["conv"]["float"]), options, providers=CPU)
    assert plain.run(None, feeds_for(files["conv"]["model"], 1)[0])[0].shape == (1, 64, 12, 12)


def test_options_are_copied_only_where_the_load_adds_to_them(tmp_path, monkeypatch):
    """OptionsDraft: the caller's SessionOptions go to onnxruntime as they are when the load adds
    nothing (no config entry, thread count or attached initializer); else a copy carries the
    additions and the caller's object is left as it was."""
    import passes.runtime_fold
    import passes.runtime_options as runtime_options
    from passes.runtime_options import OptionsDraft

    caller = ort.SessionOptions()
    caller.add_session_config_entry("session.intra_op.allow_spinning", "0")
    assert OptionsDraft(caller).build() is caller
    assert isinstance(OptionsDraft(None).build(), ort.SessionOptions)
    draft = OptionsDraft(caller, threads=1)
    draft.add_session_config_entry("session.disable_quant_qdq", "1")
    built = draft.build()
    assert built is not caller and built.intra_op_num_threads == 1
    assert built.get_session_config_entry("session.disable_quant_qdq") == "1"
    assert built.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception):
        caller.get_session_config_entry("session.disable_quant_qdq")
    assert OptionsDraft(caller).build(private=True) is not caller
    with pytest.raises(InvalidArgumentError, match="sess_options"):
        OptionsDraft("threads=2")

    # a float16 model folded here on a CPU (weights inside the model bytes): no copy made
    monkeypatch.setattr(passes.runtime_fold, "fold_kernel_fast", lambda: True)
    copies = []
    real_copy = runtime_options.copy_session_options
    monkeypatch.setattr(runtime_options, "copy_session_options", lambda o: copies.append(o) or real_copy(o))
    inits = [numpy_helper.from_array(_w((256, 64), 41).astype(np.float16), "W")]
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 256])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 64])], inits)
    path = tmp_path / "fp16.q8.onnx"
    onnx.save(passes.quantize_weights(m, bits=8, min_elements=256), str(path))
    session = passes.InferenceSession(path, caller, mode="fold")
    assert session.fold_route == "here" and not copies
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    feeds = [{"x": np.random.default_rng(0).standard_normal((4, 256)).astype(np.float16)}]
    assert run(session, feeds)[0][0].shape == (4, 64)
    # int8 mode adds config entries: copied, the caller's options untouched
    passes.InferenceSession(path, caller, mode="int8")
    assert copies == [caller]
    with pytest.raises(Exception):
        caller.get_session_config_entry("session.qdq_matmulnbits_accuracy_level")


def test_threads(files):
    session = passes.InferenceSession(files["dense"]["q8z"], threads=1)
    assert session.get_session_options().intra_op_num_threads == 1


def test_unknown_mode(files):
    with pytest.raises(InvalidArgumentError, match="unknown mode"):
        passes.InferenceSession(files["dense"]["q8"], mode="int3")


def test_unsupported_dtype(files):
    with pytest.raises(InvalidArgumentError, match="dtype"):
        passes.InferenceSession(files["dense"]["q8"], dtype="int8")


def test_missing_provider(files):
    missing = next(p for p in ("CUDAExecutionProvider", "NoSuchExecutionProvider") if p not in ort.get_available_providers())
    with pytest.raises(InvalidArgumentError, match="not available"):
        passes.InferenceSession(files["dense"]["q8"], providers=[missing])


def test_missing_file(tmp_path):
    with pytest.raises(FileAccessError):
        passes.InferenceSession(tmp_path / "nope.onnx")


def test_corrupt_packed_file(files, tmp_path):
    data = bytearray(files["dense"]["q8z"].read_bytes())
    truncated = tmp_path / "truncated.onnxz"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptFileError):
        passes.InferenceSession(truncated)
    flipped = tmp_path / "flipped.onnxz"
    data[len(data) // 3] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError):
        passes.InferenceSession(flipped)


def test_corrupt_onnx_file(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0a\xff\xff\xff\xff\x0f not a model")
    with pytest.raises(SurgeonError):
        passes.InferenceSession(bad)


# ---------------------------------------------------------------------- GPU (skipped without CUDA)

cuda = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                          reason="CUDAExecutionProvider not available (onnxruntime-gpu and a GPU needed)")


@cuda
@pytest.mark.parametrize("gpu_fold", ["host", "device"])
def test_cuda_fold_matches_cpu(files, gpu_fold):
    f = files["dense"]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["q8z"], providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                                      mode="fold", gpu_fold=gpu_fold)
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-3)


@cuda
def test_cuda_float16_and_auto(files):
    f = files["dense"]
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(f["q8z"], providers=["CUDAExecutionProvider"], mode="auto", dtype="float16")
    assert session.mode == "fold"
    for got, want in zip(run(session, feeds), run_plain(f["folded"], feeds)):
        assert cosine(got[0], want[0]) > 0.999


def test_auto_picks_int8_when_float_weights_do_not_fit(files, monkeypatch):
    import passes.runtime as runtime

    monkeypatch.setattr(runtime, "_free_memory_bytes", lambda: 100_000)  # 100 kB free
    session = passes.InferenceSession(files["dense"]["q8z"], mode="auto")
    assert session.mode == "int8"
    assert "exceed" in session.mode_reason
    monkeypatch.setattr(runtime, "_free_memory_bytes", lambda: 1 << 34)
    assert passes.InferenceSession(files["dense"]["q8z"], mode="auto").mode == "fold"


def test_prepack_option(files):
    f = files["dense"]
    feeds = feeds_for(f["model"])
    off = passes.InferenceSession(f["q8z"], mode="fold", prepack=False)
    assert off.get_session_options().get_session_config_entry("session.disable_prepacking") == "1"
    on = passes.InferenceSession(f["q8z"], mode="fold", prepack=True)
    for a, b in zip(run(off, feeds), run(on, feeds)):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError):
        passes.InferenceSession(f["q8z"], prepack="yes")


def test_fold_of_palette_weights(files, tmp_path):
    palettize = pytest.importorskip("passes.palette").palettize
    f = files["dense"]
    p = palettize(f["model"], bits=4)
    path = tmp_path / "palette.onnx"
    onnx.save(p, str(path))
    feeds = feeds_for(f["model"])
    session = passes.InferenceSession(path, mode="fold")
    assert "Gather" not in session.op_counts and "Cast" not in session.op_counts
    for got, want in zip(run(session, feeds), run_plain(p, feeds)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
