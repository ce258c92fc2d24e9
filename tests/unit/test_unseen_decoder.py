"""Shapes users ship now that the other tests do not build (bench/unseen_shapes.py, small and
with random weights here): a decoder-only transformer exported as optimum does it (past key /
value inputs, an attention mask over past + new tokens named 'past_sequence_length +
sequence_length', rotary tables as initializers, a causal mask holding -inf, the output
projection tied to the embedding) in float32, in float16 with float32 islands and with bfloat16
weights behind Casts, with its weights over several external files, quantized by onnxruntime's
static QDQ quantizer, with com.microsoft MatMulNBits; and a conv net whose weights sit in
Constant nodes at opset 11 (per-tensor DequantizeLinear, no axis) and 13 (per channel).
Every public path runs on each: quantize_weights int8 / 4-bit blocks, palettize, fold_dequantize,
pack / verify / unpack / load, InferenceSession fold / int8 / auto, evaluate, compress --target.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import passes
from unseen_helpers import folder_digest as _digest, restored_digest, same_outputs as _same, worst_output_snr as _snr
from passes import graph

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import unseen_shapes as shapes  # noqa: E402

HEADS, MAX_POS = 2, 160  # synthesised feeds: 64 past + 64 new tokens, position ids below 100
SIZES = dict(vocab=256, layers=1, heads=HEADS, head_dim=32)


def _run(model, feeds, accuracy0=True):
    """Outputs per feed. MatMulNBits at accuracy level 0 (float compute) where onnxruntime fuses
    DequantizeLinear + MatMul: the error measured is the weights' (the README's note)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if accuracy0:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if isinstance(model, passes.InferenceSession):
        s = model
    else:
        src = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
        s = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return [[np.asarray(o) for o in s.run(None, f)] for f in feeds]


def _check(model):
    onnx.checker.check_model(model, full_check=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (model path, feeds): each model in a folder of its own."""
    root = tmp_path_factory.mktemp("shapes")
    w = shapes.random_weights(seed=0)
    fp32 = shapes.decoder(TensorProto.FLOAT, w, heads=HEADS, max_pos=MAX_POS)
    feeds32 = shapes.decoder_feeds(np.random.default_rng(0), n=2, **SIZES)
    feeds16 = shapes.decoder_feeds(np.random.default_rng(0), np.float16, n=2, **SIZES)
    out = {}

    def put(name, model=None):
        folder = root / name
        folder.mkdir()
        path = folder / f"{name}.onnx"
        if model is not None:
            onnx.save(model, str(path))
        return path

    out["dec_fp32"] = (put("dec_fp32", fp32), feeds32)
    out["dec_fp16"] = (put("dec_fp16", shapes.decoder(TensorProto.FLOAT16, w, heads=HEADS, max_pos=MAX_POS)), feeds16)
    out["dec_bf16"] = (put("dec_bf16", shapes.bfloat16_weights(fp32)), feeds32)
    ext = put("dec_extdata")
    shapes.save_external_several(fp32, ext, large=16384)
    out["dec_extdata"] = (ext, feeds32)
    qdq = put("dec_qdq")
    shapes.qdq(out["dec_fp32"][0], qdq, shapes.decoder_feeds(np.random.default_rng(1), n=4, **SIZES))
    out["dec_qdq"] = (qdq, feeds32)
    out["dec_nbits"] = (put("dec_nbits", shapes.matmul_nbits(fp32)), feeds32)
    rng = np.random.default_rng(2)
    square = [(rng.standard_normal((384, 384)) / 20).astype(np.float32) for _ in range(3)]
    bias = (rng.standard_normal(384) / 10).astype(np.float32)
    for opset in (11, 13):
        out[f"legacy_op{opset}"] = (put(f"legacy_op{opset}", shapes.legacy(opset, square, bias)),
                                    shapes.legacy_feeds(np.random.default_rng(3), n=2))
    return out


DECODERS = ["dec_fp32", "dec_fp16", "dec_bf16", "dec_extdata"]


def test_the_shapes_are_what_they_claim(made):
    """The builders make what the module docstring says (several external files, -inf in the
    causal mask, float32 islands in the float16 model, the domains and forms)."""
    ext, _ = made["dec_extdata"]
    locations = {e.value for t in onnx.load(str(ext), load_external_data=False).graph.initializer
                 for e in t.external_data if e.key == "location"}
    assert len(locations) >= 3 and "data/small.bin" in locations
    m32 = onnx.load(str(made["dec_fp32"][0]))
    mask = next(t for t in m32.graph.initializer if t.name == "model.causal_mask")
    assert np.isneginf(graph.tensor_to_array(mask)).any()
    assert [d.dim_param for d in m32.graph.input[1].type.tensor_type.shape.dim][1] == \
        "past_sequence_length + sequence_length"
    m16 = onnx.load(str(made["dec_fp16"][0]))
    types = {t.data_type for t in m16.graph.initializer if len(t.dims) >= 1 and t.data_type in graph.FLOAT_TYPES}
    assert types == {TensorProto.FLOAT, TensorProto.FLOAT16}
    bf = onnx.load(str(made["dec_bf16"][0]))
    assert any(t.data_type == TensorProto.BFLOAT16 for t in bf.graph.initializer)
    ops = {n.op_type for n in onnx.load(str(made["dec_qdq"][0])).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    nb = onnx.load(str(made["dec_nbits"][0]))
    assert any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in nb.graph.node)
    for opset in (11, 13):
        lm = onnx.load(str(made[f"legacy_op{opset}"][0]))
        assert not lm.graph.initializer and lm.opset_import[0].version == opset


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_every_path(made, name, tmp_path):
    src, feeds = made[name]
    before = _digest(src.parent)
    ref = _run(src, feeds)
    q8 = passes.quantize_weights(str(src))
    _check(q8)
    assert _snr(ref, _run(q8, feeds)) >= 30
    q4 = passes.quantize_weights(str(src), bits=4, granularity="block", block_size=32)
    _check(q4)
    assert _snr(ref, _run(q4, feeds)) >= 10
    pal = passes.palettize(str(src), bits=4, min_elements=256)
    _check(pal)
    assert _same(_run(pal, feeds), _run(passes.fold_dequantize(pal), feeds))
    # the causal mask's -inf and the rotary tables' sums stay exactly as they were
    inits = {t.name: t for t in q8.graph.initializer}
    assert "model.causal_mask" in inits
    for dtype in (None, "float16", "float32"):
        f = passes.fold_dequantize(q8, dtype=dtype)
        _check(f)
        assert _snr(ref, _run(f, feeds)) >= 28
    # lossless: every file (several external ones) back byte for byte
    assert restored_digest(src, tmp_path) == before
    # sessions on the quantized pack and on the float pack
    qz = tmp_path / "q.onnxz"
    qpath = tmp_path / "q.onnx"
    qpath.write_bytes(q8.SerializeToString())
    passes.pack(str(qpath), str(qz))
    for mode in ("fold", "int8", "auto"):
        assert _snr(ref, _run(passes.InferenceSession(str(qz), mode=mode), feeds)) >= 24, mode
    assert _snr(ref, _run(passes.InferenceSession(str(tmp_path / "f.onnxz"), mode="int8"), feeds)) >= 24
    assert _digest(src.parent) == before  # inputs never modified, nothing left beside them


def test_decoder_fidelity_and_auto_with_feeds(made, tmp_path):
    src, feeds = made["dec_fp32"]
    q8 = passes.quantize_weights(str(src))
    r = passes.evaluate(str(src), q8, feeds=feeds)
    assert r.metrics["snr"] >= 30
    model, rep = passes.compress(str(src), target="snr>=25", feeds=feeds)
    _check(model)
    assert passes.evaluate(str(src), model, feeds=feeds).metrics["snr"] >= 25 - 1e-9
    assert model.ByteSize() < 0.5 * onnx.load(str(src)).ByteSize()


def test_decoder_runs_on_synthesised_feeds(made):
    """The mask's axis 'past_sequence_length + sequence_length' is sized as the sum (61f3eb1): before,
    every named axis took 64 and no size made the model run."""
    src, _ = made["dec_fp32"]
    # synthesize_feeds first (runs nothing): without the sums, runnable_feeds would grow every axis
    # to 16000 and onnxruntime allocate ~4 GB of attention scores before the mask's Add fails
    feeds = passes.synthesize_feeds(str(src), n=2)
    assert feeds[0]["attention_mask"].shape[1] == \
        feeds[0]["input_ids"].shape[1] + feeds[0]["past_key_values.0.key"].shape[2]
    r = passes.evaluate(str(src), passes.quantize_weights(str(src)))
    assert r.synthesized and r.metrics["snr"] >= 30


def test_qdq_model_is_left_quantized(made):
    """onnxruntime's QDQ model: compress finds nothing to quantize (its weights are int8 already,
    its float tensors are activations' scales and the -inf mask), fold folds the weights'
    DequantizeLinear only and leaves every activation's QuantizeLinear -> DequantizeLinear."""
    src, feeds = made["dec_qdq"]
    m = onnx.load(str(src))
    ref = _run(m, feeds)
    rep = passes.Report()
    q = passes.quantize_weights(m, report=rep)
    _check(q)
    assert not [t for t in rep.tensors if t.bytes_after != t.bytes_before]
    assert _same(ref, _run(q, feeds))
    inits = {t.name for t in m.graph.initializer}
    f = passes.fold_dequantize(m)
    _check(f)
    n_q = sum(n.op_type == "QuantizeLinear" for n in m.graph.node)
    assert sum(n.op_type == "QuantizeLinear" for n in f.graph.node) == n_q
    left = [n for n in f.graph.node if n.op_type == "DequantizeLinear"]
    assert left and not any(n.input[0] in inits for n in left)  # activations' only
    assert _snr(ref, _run(f, feeds)) >= 30


def test_qdq_model_sessions(made, tmp_path):
    src, feeds = made["dec_qdq"]
    ref = _run(src, feeds, accuracy0=False)
    z = tmp_path / "q.onnxz"
    passes.pack(str(src), str(z))
    for mode in ("fold", "auto"):
        assert _snr(ref, _run(passes.InferenceSession(str(z), mode=mode), feeds)) >= 60, mode


def test_qdq_model_runs_as_it_is_in_int8_mode(made, tmp_path):
    """A MatMul whose input the model quantizes itself keeps its weight's DequantizeLinear in int8
    mode (1d437b7): MatMulNBits quantized the activations a second time (38.8 dB here, 19.5 dB on
    bench/unseen_shapes.py's dec_qdq against the model itself)."""
    src, feeds = made["dec_qdq"]
    ref = _run(src, feeds, accuracy0=False)
    z = tmp_path / "q.onnxz"
    passes.pack(str(src), str(z))
    assert _snr(ref, _run(passes.InferenceSession(str(z), mode="int8"), feeds)) >= 60


def test_matmul_nbits_weights_are_left_as_they_are(made, tmp_path):
    src, feeds = made["dec_nbits"]
    m = onnx.load(str(src))
    ref = _run(m, feeds)
    nbits = {x for n in m.graph.node if n.op_type == "MatMulNBits" for x in n.input[1:]}
    def payloads(model):  # name -> (type, dims, bytes) of the MatMulNBits inputs
        return {t.name: (t.data_type, list(t.dims), graph.tensor_to_array(t).tobytes())
                for t in model.graph.initializer if t.name in nbits}

    before = payloads(m)
    for q in (passes.quantize_weights(m), passes.quantize_weights(m, bits=4, granularity="block", block_size=32),
              passes.palettize(m, bits=4, min_elements=256), passes.fold_dequantize(m)):
        _check(q)
        assert payloads(q) == before
        assert sum(n.op_type == "MatMulNBits" for n in q.graph.node) == len(before) // 3
    q = passes.quantize_weights(m)
    assert _snr(ref, _run(q, feeds)) >= 30
    qpath, z = tmp_path / "q.onnx", tmp_path / "q.onnxz"
    qpath.write_bytes(q.SerializeToString())
    passes.pack(str(qpath), str(z))
    for mode in ("fold", "int8", "auto"):
        assert _snr(ref, _run(passes.InferenceSession(str(z), mode=mode), feeds)) >= 24, mode


@pytest.mark.parametrize("opset", [11, 13])
def test_constant_node_weights_at_old_opsets(made, opset, tmp_path):
    """Weights in Constant nodes are quantized; the DequantizeLinear the model had (opset 11:
    per tensor, no axis; 13: per channel, uint8 with zero points) folds like ours."""
    src, feeds = made[f"legacy_op{opset}"]
    m = onnx.load(str(src))
    ref = _run(m, feeds)
    rep = passes.Report()
    q = passes.quantize_weights(m, report=rep)
    _check(q)
    assert [t for t in rep.tensors if t.bytes_after < t.bytes_before]
    assert _snr(ref, _run(q, feeds)) >= 30
    q4 = passes.quantize_weights(m, bits=4, granularity="block", block_size=32)
    _check(q4)
    assert _snr(ref, _run(q4, feeds)) >= 10
    for model in (m, q):
        f = passes.fold_dequantize(model)
        _check(f)
        assert not any(n.op_type == "DequantizeLinear" for n in f.graph.node)
        assert _snr(ref, _run(f, feeds)) >= 30
    z = tmp_path / "l.onnxz"
    passes.pack(str(src), str(z))
    assert passes.load(str(z)).SerializeToString() == src.read_bytes()
    qpath, qz = tmp_path / "q.onnx", tmp_path / "q.onnxz"
    qpath.write_bytes(q.SerializeToString())
    passes.pack(str(qpath), str(qz))
    for mode in ("fold", "int8", "auto"):
        assert _snr(ref, _run(passes.InferenceSession(str(qz), mode=mode), feeds)) >= 30, mode
