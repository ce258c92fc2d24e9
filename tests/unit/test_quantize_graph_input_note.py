"""Weights that are also graph inputs (IR >= 4: overridable, so no constants) stay float; the
report says so in a note, with their bytes and what would let them be quantized (before, a
model made only of such weights came out at 100% of its size without a word)."""
import onnx

import passes
from modelgen import listed_weights_model
from tools.surgeon_compress import main


def test_weights_listed_as_graph_inputs_are_named_in_a_note(tmp_path, capsys):
    report = passes.Report()
    q = passes.quantize_weights(listed_weights_model(6), report=report)
    assert [t.name for t in q.graph.initializer] == ["W1", "b1", "W2"]  # all float, as they were
    note = next(n for n in report.notes if "also listed as graph inputs" in n)
    assert note.startswith("2 float weight(s) (74.0 kB) also listed as graph inputs (overridable by the caller) "
                           "stay float: W1, W2;")
    src = tmp_path / "m.onnx"
    onnx.save(listed_weights_model(6), str(src))
    assert main(["compress", str(src), "-o", str(tmp_path / "q.onnx")]) == 0
    assert "also listed as graph inputs" in capsys.readouterr().out


def test_no_note_where_the_listing_is_ir3_s_and_is_removed():
    """IR 3 lists every initializer as an input because it must: those entries are removed (its own
    note) and the weights quantized; nothing is kept for being an input."""
    report = passes.Report()
    q = passes.quantize_weights(listed_weights_model(3), report=report)
    assert not any("also listed as graph inputs" in n for n in report.notes)
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 2
