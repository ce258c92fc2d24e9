"""Why a big model's fold session differs from the plain session in the last bits (bench/load.py's
generated ~3 GB chain: 2.3e-05 with byte-identical weights): prepack=None turns onnxruntime's
weight prepacking off above PREPACK_AUTO_LIMIT, and onnxruntime's MatMul without its packed
layout sums in another order. With the same prepacking, the fold session's outputs are the folded
model's bit for bit; that is what these tests hold (small models, the limit lowered)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
import passes.runtime as runtime

CPU = ["CPUExecutionProvider"]
WIDTH = 1024


def _chain(layers=2):
    rng = np.random.default_rng(7)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"y{i}"]))
        prev = f"y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepack")
    src = folder / "chain.onnx"
    onnx.save(_chain(), str(src))
    q8 = folder / "chain.q8.onnx"
    onnx.save(passes.quantize_weights(str(src), bits=8), str(q8))
    folded = folder / "chain.q8.folded.onnx"
    onnx.save(passes.fold_dequantize(str(q8)), str(folded))
    packs = {}
    for key, path in (("float", src), ("q8", q8)):
        packs[key] = folder / f"chain.{key}.onnxz"
        passes.pack(str(path), str(packs[key]), force=True)
    feed = {"x": np.random.default_rng(3).standard_normal((1, WIDTH)).astype(np.float32)}
    return {"float": src, "folded": folded, "q8z": packs["q8"], "floatz": packs["float"], "feed": feed}


def _plain(path, feed, prepack: bool):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(path), options, providers=CPU).run(None, feed)[0]


def _fold(path, feed, **kw):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = passes.InferenceSession(str(path), options, providers=CPU, mode="fold", **kw)
    return session, session.run(None, feed)[0]


@pytest.mark.parametrize("source,reference", [("q8z", "folded"), ("floatz", "float")])
def test_auto_prepack_off_gives_the_unprepacked_plain_sessions_outputs(files, monkeypatch, source, reference):
    monkeypatch.setattr(runtime, "PREPACK_AUTO_LIMIT", 0)  # (as a model over the limit)
    session, got = _fold(files[source], files["feed"])
    if session.shared_names:  # (the limit counts shared weights: with none, prepacking stays on)
        assert session.prepack is False
    np.testing.assert_array_equal(got, _plain(files[reference], files["feed"], prepack=session.prepack))


@pytest.mark.parametrize("prepack", [True, False])
def test_fold_session_equals_the_folded_model_with_the_same_prepacking(files, prepack):
    session, got = _fold(files["q8z"], files["feed"], prepack=prepack)
    assert session.prepack is prepack
    np.testing.assert_array_equal(got, _plain(files["folded"], files["feed"], prepack=prepack))


def test_prepacking_is_what_moves_the_last_bits(files):
    """The two plain sessions of one model, prepacked or not: where they differ, the fold session
    follows its own prepacking, never the other one (the difference is onnxruntime's kernels')."""
    on, off = (_plain(files["folded"], files["feed"], prepack=p) for p in (True, False))
    _, folded_off = _fold(files["q8z"], files["feed"], prepack=False)
    np.testing.assert_array_equal(folded_off, off)
    if not np.array_equal(on, off):
        assert not np.array_equal(folded_off, on)
