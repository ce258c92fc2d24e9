"""Small packed models, one per codec family of FORMAT.md, built fresh from generated weights.

Each sample knows what a correct reader must return: the original files byte for byte and every
tensor as numpy would decode it from the original model. `families` names the codecs the packed
file really uses (read back from its metadata, so a writer change that stops exercising a family
is noticed by `check_families`).
"""
from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


@dataclass
class Sample:
    name: str
    packed: bytes                     # the .onnxz file
    files: Dict[str, bytes]           # original model file ("" key) and its external data files
    tensors: Dict[str, np.ndarray]    # key -> expected array (as get_tensor must return it)
    families: List[str] = field(default_factory=list)  # codec names used in the pack
    feeds: Dict[str, np.ndarray] = field(default_factory=dict)  # inputs for InferenceSession runs


def _graph_with(initializers, extra_nodes=()):
    """Every initializer feeds one Identity output, so the model is valid and each weight is used."""
    nodes, outputs = list(extra_nodes), []
    for t in initializers:
        out = t.name + "_out"
        nodes.append(helper.make_node("Identity", [t.name], [out]))
        outputs.append(helper.make_tensor_value_info(out, t.data_type, list(t.dims)))
    for n in extra_nodes:
        outputs.append(helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "sample", [], outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _family_tensors(rng, nbytes: int):
    """name -> array of about `nbytes` bytes, chosen so the writer picks each codec family.
    (The writer leaves payloads under 1 KiB in the skeleton: nbytes must stay >= 1024.)"""
    def n(itemsize):
        return max(1, nbytes // itemsize)

    bf16_bits = (rng.standard_normal(n(4)).astype(np.float32).view(np.uint32) & 0xFFFF0000).astype(np.uint32)
    q = np.clip(np.round(rng.laplace(0, 12, n(1))), -127, 127).astype(np.int8)
    return {
        "f32": rng.standard_normal(n(4)).astype(np.float32),              # fplanes w=4
        "f16": rng.standard_normal(n(2)).astype(np.float16),              # fplanes w=2
        "f64": rng.standard_normal(n(8)),                                 # fplanes w=8
        "f32_holding_f16": rng.standard_normal(n(4)).astype(np.float16).astype(np.float32),  # narrow 1->10
        "f32_holding_bf16": bf16_bits.view(np.float32),                   # narrow 1->16
        "f64_holding_f32": rng.standard_normal(n(8)).astype(np.float32).astype(np.float64),  # narrow 11->1
        "i8": q,                                                          # bytes (entropy)
        "u8": (q.astype(np.int16) + 128).astype(np.uint8),                # bytes
        "ternary": rng.integers(-1, 2, max(n(1), 4096)).astype(np.int8),  # bpairs (few distinct bytes; wins from ~4 KiB)
        "i16": rng.integers(-300, 300, n(2)).astype(np.int16),            # planes w=2
        "i32": rng.integers(-5000, 5000, n(4)).astype(np.int32),          # planes w=4
        "i64": rng.integers(-10**6, 10**6, n(8)).astype(np.int64),        # planes w=8
        "repeated": np.tile(rng.standard_normal(16).astype(np.float32), max(n(4), 1024) // 16),  # LZ wins (>= 4 KiB)
        "boolean": rng.integers(0, 2, n(1)).astype(bool),
    }


@contextlib.contextmanager
def forced_fpairs():
    """While active, the writer codes every float32/bfloat16 payload with `fpairs` (and the inner
    codec of `narrow` to bfloat16 too). The writer keeps fpairs only where it is smaller, which
    small generated tensors never are; the samples and golden files must still exercise it.
    (Patches the writer's private codec choice: a test tool, not an API.)"""
    from passes.onnxz import codecs

    original = codecs.encode_tensor

    def encode(data, dtype, field, *, chunk_bytes=codecs.CHUNK_BYTES, try_lz=None, **extra):
        if field == "raw_data" and dtype in (codecs.FLOAT, codecs.BFLOAT16) and data.size % 4 == 0:
            width = 4 if dtype == codecs.FLOAT else 2
            narrowed = codecs._narrowed(data, dtype) if dtype == codecs.FLOAT else None
            if narrowed is not None and narrowed[0] == codecs.BFLOAT16:
                inner = codecs._encode_planes(narrowed[1], "fpairs", 2, chunk_bytes // 2)
                return codecs.EncodedStream(
                    "narrow", {"from": dtype, "to": codecs.BFLOAT16, "inner": {"codec": inner.codec, "params": inner.params}},
                    [codecs.EncodedChunk(c.raw_length * 2, c.planes) for c in inner.chunks])
            return codecs._encode_planes(data, "fpairs", width, chunk_bytes)
        return original(data, dtype, field, chunk_bytes=chunk_bytes, try_lz=try_lz, **extra)

    codecs.encode_tensor = encode
    try:
        yield
    finally:
        codecs.encode_tensor = original


def _pack_model(model: onnx.ModelProto, *, external: bool = False, chunk_bytes: int = 1 << 20):
    """(packed bytes, {name: original file bytes}) through the real writer."""
    from passes import pack

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "model.onnx"
        if external:
            onnx.save_model(model, src, save_as_external_data=True, all_tensors_to_one_file=True,
                            location="weights.bin", size_threshold=0)
        else:
            src.write_bytes(model.SerializeToString())
        pack(src, tmp / "model.onnxz", threads=1, chunk_bytes=chunk_bytes)
        files = {("" if p.name == "model.onnx" else p.name): p.read_bytes()
                 for p in tmp.iterdir() if p.name != "model.onnxz"}
        return (tmp / "model.onnxz").read_bytes(), files


def _expected_tensors(packed: bytes) -> Dict[str, np.ndarray]:
    """Keys come from the writer; values from numpy_helper on the original, matched by key."""
    from passes import open_packed

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "s.onnxz"
        p.write_bytes(packed)
        with open_packed(p, threads=1) as pm:
            meta = pm.metadata()
            return {k: pm.get_tensor(k) for k in pm.keys()}, sorted({t["codec"] for t in meta["tensors"]} |
                                                                       {_inner(t) for t in meta["tensors"]} - {None})


def _inner(t):
    return "narrow/" + t["params"]["inner"]["codec"] if t.get("codec") == "narrow" else None


def _sample(name, model, *, external=False, chunk_bytes=1 << 20, feeds=None) -> Sample:
    packed, files = _pack_model(model, external=external, chunk_bytes=chunk_bytes)
    got, families = _expected_tensors(packed)
    # the reference: numpy_helper on the original model (external data read by onnx itself)
    with tempfile.TemporaryDirectory() as tmp:
        for fname, data in files.items():
            (Path(tmp) / (fname or "model.onnx")).write_bytes(data)
        original = onnx.load(str(Path(tmp) / "model.onnx"))
    reference, seen = {}, set()
    for t in _all_tensors(original):
        if t.name in seen:  # a repeated name: ambiguous, not cross-checked
            reference.pop(t.name, None)
        elif t.name:
            reference[t.name] = numpy_helper.to_array(t)
        seen.add(t.name)
    for key, arr in got.items():
        ref = reference.get(key)
        if ref is None or "#" in key:  # unnamed (keyed by node output) or repeated names: no cross-check
            continue
        if ref.dtype != arr.dtype or ref.shape != arr.shape or ref.tobytes() != arr.tobytes():
            raise AssertionError(f"sample {name}: the unmutated pack already decodes {key!r} wrongly")
    return Sample(name, packed, files, got, families, dict(feeds or {}))


def _all_tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(model))


# ---------------------------------------------------------------------- the samples

def all_families(nbytes: int = 1024, seed: int = 0, name: str = "all_families") -> Sample:
    """One small model holding one tensor per codec family (the every-byte sweeps use this one),
    written with the codecs of format 1.0 (which readers keep forever; the writer now prefers
    `ans`); `ans_families` is the same model as today's writer packs it."""
    from passes.onnxz import codecs

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(a, k) for k, a in _family_tensors(rng, nbytes).items()]
    inits.append(numpy_helper.from_array(np.arange(6, dtype=np.float32), "tiny"))  # stays in the skeleton
    with codecs.without_ans() if name == "all_families" else contextlib.nullcontext():
        return _sample(name, _graph_with(inits))


def ans_families() -> Sample:
    return all_families(name="ans_families")


def per_family(nbytes: int = 2048, seed: int = 1) -> List[Sample]:
    """One model per family, tensors big enough to span several chunks (chunk_bytes=256)."""
    rng = np.random.default_rng(seed)
    out = []
    for key, arr in _family_tensors(rng, nbytes).items():
        out.append(_sample(f"family_{key}", _graph_with([numpy_helper.from_array(arr, key)]), chunk_bytes=256))
    return out


def odd_layouts(seed: int = 2) -> List[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    # external data file beside the model
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "ext_a"),
             numpy_helper.from_array(rng.integers(-100, 100, 300).astype(np.int8), "ext_b"),
             numpy_helper.from_array(np.arange(8, dtype=np.float32), "ext_tiny")]
    samples.append(_sample("external_data", _graph_with(inits), external=True))
    # typed fields instead of raw_data: float_data, int64_data, int32_data (int8 stored as int32), double_data
    typed = [
        helper.make_tensor("fd", TensorProto.FLOAT, [300], rng.standard_normal(300).astype(np.float32).tolist()),
        helper.make_tensor("i64d", TensorProto.INT64, [200], rng.integers(-(2**40), 2**40, 200).tolist()),
        helper.make_tensor("i32d", TensorProto.INT8, [600], rng.integers(-128, 128, 600).tolist()),
        helper.make_tensor("dd", TensorProto.DOUBLE, [150], rng.standard_normal(150).tolist()),
    ]
    samples.append(_sample("typed_fields", _graph_with(typed)))
    # a Constant inside an If branch, a second Constant at top level, an empty tensor
    const = helper.make_tensor("branch_w", TensorProto.FLOAT, [300], rng.standard_normal(300).astype(np.float32).tobytes(), raw=True)
    branch = helper.make_graph([helper.make_node("Constant", [], ["bw"], value=const)], "then", [],
                               [helper.make_tensor_value_info("bw", TensorProto.FLOAT, [300])])
    if_node = helper.make_node("If", ["cond"], ["if_out"], then_branch=branch, else_branch=branch)
    top = helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cond_v", TensorProto.BOOL, [], [True]))
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    big = numpy_helper.from_array(rng.standard_normal(300).astype(np.float32), "plain")
    samples.append(_sample("subgraph_const_empty", _graph_with([empty, big], extra_nodes=[top, if_node])))
    return samples


def fpairs_samples(seed: int = 4) -> List[Sample]:
    """`fpairs` forced: float32 with more than 15 exponents (escapes used), bfloat16 stored as
    such, float32 holding bfloat16 values (narrow with an fpairs inner codec); several chunks."""
    rng = np.random.default_rng(seed)
    wide = (rng.standard_normal(600) * np.exp2(rng.integers(-30, 30, 600))).astype(np.float32)
    bf16 = helper.make_tensor("bf16", TensorProto.BFLOAT16, [600],
                              (rng.standard_normal(600).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
    held = (rng.standard_normal(600).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    inits = [numpy_helper.from_array(wide, "wide_f32"), bf16, numpy_helper.from_array(held, "f32_holding_bf16_pairs")]
    with forced_fpairs():
        return [_sample("fpairs_forced", _graph_with(inits), chunk_bytes=1024)]


def quantized_samples(seed: int = 5) -> List[Sample]:
    """A small network quantized by our own pass (int8 per channel and int4 blocks behind
    DequantizeLinear), with an input: the samples InferenceSession runs on (fold and int8 modes)."""
    from passes import quantize_weights

    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((64, 16)).astype(np.float32), "W2")
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["H"]), helper.make_node("Relu", ["H"], ["R"]),
             helper.make_node("MatMul", ["R", "W2"], ["Y"])]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 32])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 16])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    feeds = {"X": rng.standard_normal((2, 32)).astype(np.float32)}
    out = [_sample("quantized_int8", quantize_weights(model, bits=8, min_elements=0), feeds=feeds),
           _sample("quantized_int4_block", quantize_weights(model, bits=4, granularity="block", block_size=32,
                                                            min_elements=0), feeds=feeds)]
    return out


def _first_feed(npz_path: Path) -> Dict[str, np.ndarray]:
    if not npz_path.is_file():
        return {}
    with np.load(npz_path) as z:
        keys = [k for k in z.files if k.startswith("0/")] or list(z.files)
        return {k.split("/", 1)[-1]: z[k] for k in keys}


def real_models() -> List[Sample]:
    """The small real models of models/ (float32, float16, weights in If subgraphs) and the int8
    output of our quantize pass on the float32 one: real weight statistics for the long run."""
    from passes import quantize_weights

    folder = Path(__file__).resolve().parent.parent / "models"
    out = []
    for name in ("rapidocr_cls", "rapidocr_cls_fp16", "silero_vad_v6"):
        path = folder / f"{name}.onnx"
        if not path.is_file():
            continue
        model = onnx.load(str(path))
        feeds = _first_feed(folder / f"{name.replace('_fp16', '')}_feeds.npz")
        out.append(_sample(f"real_{name}", model, feeds=feeds))
        if name == "rapidocr_cls":
            out.append(_sample("real_rapidocr_cls_int8", quantize_weights(model, bits=8), feeds=feeds))
    return out


def shared_samples(seed: int = 6) -> List[Sample]:
    """Format 1.2 (`ans_shared`): small int8 and float32 tensors whose planes use tables stored
    once in the index (a few KB: swept byte by byte)."""
    from passes.onnxz import codecs

    rng = np.random.default_rng(seed)
    inits = []
    for i in range(3):
        q = np.clip(np.round(rng.laplace(0, 6 + 2 * i, 1200)), -127, 127).astype(np.int8)
        inits.append(numpy_helper.from_array(q, f"shared_q{i}"))
        inits.append(numpy_helper.from_array((rng.standard_normal(300) * 0.1).astype(np.float32), f"shared_w{i}"))
    samples = [_sample("shared_tables", _graph_with(inits))]
    # short blobs longer than their plane once the table is back (forced whatever the writer's
    # SHARED_WHOLE_BELOW_PLANE: decoded by _planes.ans_decode_shared or numpy, never ans_decode)
    wide = [numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 30, n)), -127, 127).astype(np.int8), f"shared_long{i}")
            for i, n in enumerate([1100, 1300, 1200])]
    saved, codecs.SHARED_WHOLE_BELOW_PLANE = codecs.SHARED_WHOLE_BELOW_PLANE, False
    try:
        samples.append(_sample("shared_long_blobs", _graph_with(wide)))
    finally:
        codecs.SHARED_WHOLE_BELOW_PLANE = saved
    return samples


def same_samples(seed: int = 7) -> List[Sample]:
    """Format 1.4 (`same`, FORMAT.md 3.3): payloads stored once. A float32 weight held three times
    and an int8 one twice (one file), and a weight whose copy lies in the external data file."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(400).astype(np.float32)
    q = np.clip(np.round(rng.laplace(0, 10, 1500)), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(w, "same_w"), numpy_helper.from_array(q, "same_q"),
             numpy_helper.from_array(w.copy(), "same_w2"), numpy_helper.from_array(q.copy(), "same_q2"),
             numpy_helper.from_array(w.copy(), "same_w3")]
    samples = [_sample("same_payloads", _graph_with(inits))]
    ext = [numpy_helper.from_array(w, "same_ext_a"), numpy_helper.from_array(w.copy(), "same_ext_b"),
           numpy_helper.from_array(q, "same_ext_q")]
    samples.append(_sample("same_external", _graph_with(ext), external=True))
    return samples


def build_all() -> List[Sample]:
    return ([all_families(), ans_families()] + per_family() + odd_layouts() + fpairs_samples() + quantized_samples()
            + shared_samples() + same_samples())


SAMPLE_BUILDERS: Dict[str, Callable[[], List[Sample]]] = {
    "all_families": lambda: [all_families(), ans_families()],
    "per_family": per_family,
    "odd_layouts": odd_layouts,
    "fpairs": fpairs_samples,
    "quantized": quantized_samples,
    "shared": shared_samples,
    "same": same_samples,
    "real": real_models,
}


REQUIRED_FAMILIES = {"bytes", "bpairs", "planes", "fplanes", "fpairs", "narrow", "skeleton", "ans", "ans_shared"}


def check_families(samples: List[Sample]) -> set:
    """The codec families used by the samples (the tests assert every one of FORMAT.md is there)."""
    used = set()
    for s in samples:
        used |= {f.split("/")[0] for f in s.families}
    return used
