"""A weight include= names that the rules would keep as 1-D (a vector: one axis holds every value)
has no channels: granularity="channel" quantizes it per tensor, not with one scale per value, which
made the tensor larger than its float original (65536 -> 81920 bytes). Blocks, when asked, still apply."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import passes


def _flat_weight_model() -> onnx.ModelProto:
    """x[4, 128] -> MatMul(Reshape(Wflat[16384], [128, 128])) -> Add(row[1, 128]) -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.normal(size=16384) / 11).astype(np.float32), "Wflat"),
             numpy_helper.from_array(np.array([128, 128], np.int64), "shape"),
             numpy_helper.from_array(rng.normal(size=(1, 128)).astype(np.float32), "row")]
    nodes = [helper.make_node("Reshape", ["Wflat", "shape"], ["W"]), helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Add", ["h", "row"], ["y"])]
    g = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TP.FLOAT, [4, 128])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [4, 128])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _snr(model, q) -> float:
    x = {"x": np.random.default_rng(1).normal(size=(4, 128)).astype(np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]  # noqa: E731
    ref, got = run(model).astype(np.float64), run(q).astype(np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2))


def test_a_named_vector_is_quantized_per_tensor():
    model = _flat_weight_model()
    report = passes.Report()
    q = passes.quantize_weights(model, include=["Wflat", "row"], report=report)
    onnx.checker.check_model(q, full_check=True)
    rows = {t.name: t for t in report.tensors}
    for name, before in (("Wflat", 65536), ("row", 512)):
        assert rows[name].scheme == "int8/tensor/sym", rows[name].scheme
        assert rows[name].bytes_before == before and rows[name].bytes_after == before // 4 + 4
    assert _snr(model, q) > 35


def test_blocks_still_apply_to_a_named_vector():
    report = passes.Report()
    passes.quantize_weights(_flat_weight_model(), include=["Wflat"], granularity="block", block_size=32, report=report)
    assert next(t.scheme for t in report.tensors if t.name == "Wflat") == "int8/block(axis=0,size=32)/sym"
