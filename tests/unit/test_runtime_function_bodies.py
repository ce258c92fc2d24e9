"""InferenceSession(mode="fold") folds the DequantizeLinear nodes of model-local function bodies as
fold_dequantize folds them (quantize_weights writes them there), from a .onnx and from a pack."""
import sys
from pathlib import Path

import numpy as np

import passes
from unseen_helpers import run_outputs, same_outputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import unseen_edges as edges  # noqa: E402


def test_function_body_weights_fold_at_load_as_fold_dequantize_folds_them(tmp_path):
    q8 = passes.quantize_weights(edges.fn_in_subgraphs())
    assert any(n.op_type == "DequantizeLinear" for n in q8.functions[0].node)
    feeds = edges.feeds_for("fn_in_subgraphs", np.random.default_rng(0))
    (tmp_path / "q.onnx").write_bytes(q8.SerializeToString())
    passes.pack(str(tmp_path / "q.onnx"), str(tmp_path / "q.onnxz"))
    want = run_outputs(passes.fold_dequantize(q8), feeds)
    for name in ("q.onnx", "q.onnxz"):
        session = passes.InferenceSession(str(tmp_path / name), mode="fold")
        assert not session.verbatim, name  # (a parse of the file as it is would leave the bodies unfolded)
        assert same_outputs(run_outputs(session, feeds), want), name
