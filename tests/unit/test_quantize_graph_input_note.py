"""Weights that are also graph inputs (IR >= 4: overridable, so no constants) stay float; the
report says so in a note, with their bytes and what would let them be quantized (H7 s20 F4: a
model made only of such weights came out at 100% of its size without a word)."""
import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import passes
from tools.surgeon_compress import main


def _listed_weights_model(ir_version: int) -> onnx.ModelProto:
    """x[2, 64] -> MatMul W1[64, 256] + b1 -> Relu -> MatMul W2[256, 10], every initializer also
    a graph input (torch's keep_initializers_as_inputs=True)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(64, 256)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(size=(256,)).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(size=(256, 10)).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["hr"]), helper.make_node("MatMul", ["hr", "W2"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, [2, 64])] + [
        helper.make_tensor_value_info(t.name, TP.FLOAT, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "listed", inputs, [helper.make_tensor_value_info("y", TP.FLOAT, [2, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = ir_version
    return m


def test_weights_listed_as_graph_inputs_are_named_in_a_note(tmp_path, capsys):
    report = passes.Report()
    q = passes.quantize_weights(_listed_weights_model(6), report=report)
    assert [t.name for t in q.graph.initializer] == ["W1", "b1", "W2"]  # all float, as they were
    note = next(n for n in report.notes if "also listed as graph inputs" in n)
    assert note.startswith("2 float weight(s) (74.0 kB) also listed as graph inputs (overridable by the caller) "
                           "stay float: W1, W2;")
    src = tmp_path / "m.onnx"
    onnx.save(_listed_weights_model(6), str(src))
    assert main(["compress", str(src), "-o", str(tmp_path / "q.onnx")]) == 0
    assert "also listed as graph inputs" in capsys.readouterr().out


def test_no_note_where_the_listing_is_ir3_s_and_is_removed():
    """IR 3 lists every initializer as an input because it must: those entries are removed (its own
    note) and the weights quantized; nothing is kept for being an input."""
    report = passes.Report()
    q = passes.quantize_weights(_listed_weights_model(3), report=report)
    assert not any("also listed as graph inputs" in n for n in report.notes)
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 2
