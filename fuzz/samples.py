"""Small packed models, one per codec family of FORMAT.md, built fresh from generated weights.

Each sample knows what a correct reader must return: the original files byte for byte and every
tensor as numpy would decode it from the original model. `families` names the codecs the packed
file really uses (read back from its metadata, so a writer change that stops exercising a family
is noticed by `check_families`).
"""
from __future__ import annotations

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


def _family_tensors(rng, n: int):
    """name -> array, chosen so the writer picks each codec family."""
    f16 = rng.standard_normal(n).astype(np.float16)
    bf16_bits = (rng.standard_normal(n).astype(np.float32).view(np.uint32) & 0xFFFF0000).astype(np.uint32)
    q = np.clip(np.round(rng.laplace(0, 12, n)), -127, 127).astype(np.int8)
    return {
        "f32": rng.standard_normal(n).astype(np.float32),                 # fplanes w=4
        "f16": rng.standard_normal(n).astype(np.float16),                 # fplanes w=2
        "f64": rng.standard_normal(n),                                    # fplanes w=8
        "f32_holding_f16": f16.astype(np.float32),                        # narrow 1->10
        "f32_holding_bf16": bf16_bits.view(np.float32),                   # narrow 1->16
        "f64_holding_f32": rng.standard_normal(n).astype(np.float32).astype(np.float64),  # narrow 11->1
        "i8": q,                                                          # bytes (entropy)
        "u8": (q.astype(np.int16) + 128).astype(np.uint8),                # bytes
        "i16": rng.integers(-300, 300, n).astype(np.int16),               # planes w=2
        "i32": rng.integers(-5000, 5000, n).astype(np.int32),             # planes w=4
        "i64": rng.integers(-10**6, 10**6, n).astype(np.int64),           # planes w=8
        "repeated": np.tile(rng.standard_normal(16).astype(np.float32), max(n, 1024) // 16),  # LZ wins (>= 4 KiB)
        "boolean": rng.integers(0, 2, n).astype(bool),
    }


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


def _sample(name, model, *, external=False, chunk_bytes=1 << 20) -> Sample:
    packed, files = _pack_model(model, external=external, chunk_bytes=chunk_bytes)
    got, families = _expected_tensors(packed)
    # the reference: numpy_helper on the original model (external data read by onnx itself)
    with tempfile.TemporaryDirectory() as tmp:
        for fname, data in files.items():
            (Path(tmp) / (fname or "model.onnx")).write_bytes(data)
        original = onnx.load(str(Path(tmp) / "model.onnx"))
    reference = {}
    for t in _all_tensors(original):
        reference.setdefault(t.name, numpy_helper.to_array(t))
    for key, arr in got.items():
        ref = reference.get(key.split("#")[0])
        if ref is None or ref.dtype != arr.dtype or ref.shape != arr.shape or ref.tobytes() != arr.tobytes():
            raise AssertionError(f"sample {name}: the unmutated pack already decodes {key!r} wrongly")
    return Sample(name, packed, files, got, families)


def _all_tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(model))


# ---------------------------------------------------------------------- the samples

def all_families(n: int = 64, seed: int = 0) -> Sample:
    """One small model holding one tensor per codec family (the every-byte sweeps use this one)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(a, k) for k, a in _family_tensors(rng, n).items()]
    return _sample("all_families", _graph_with(inits))


def per_family(n: int = 512, seed: int = 1) -> List[Sample]:
    """One model per family, tensors big enough to span several chunks (chunk_bytes=256)."""
    rng = np.random.default_rng(seed)
    out = []
    for key, arr in _family_tensors(rng, n).items():
        out.append(_sample(f"family_{key}", _graph_with([numpy_helper.from_array(arr, key)]), chunk_bytes=256))
    return out


def odd_layouts(seed: int = 2) -> List[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    # external data file beside the model
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "ext_a"),
             numpy_helper.from_array(rng.integers(-100, 100, 300).astype(np.int8), "ext_b")]
    samples.append(_sample("external_data", _graph_with(inits), external=True))
    # typed fields instead of raw_data: float_data, int64_data, int32_data (int8 stored as int32), double_data
    typed = [
        helper.make_tensor("fd", TensorProto.FLOAT, [40], rng.standard_normal(40).astype(np.float32).tolist()),
        helper.make_tensor("i64d", TensorProto.INT64, [40], rng.integers(-(2**40), 2**40, 40).tolist()),
        helper.make_tensor("i32d", TensorProto.INT8, [80], rng.integers(-128, 128, 80).tolist()),
        helper.make_tensor("dd", TensorProto.DOUBLE, [20], rng.standard_normal(20).tolist()),
    ]
    samples.append(_sample("typed_fields", _graph_with(typed)))
    # a Constant inside an If branch, a second Constant at top level, an empty tensor
    const = helper.make_tensor("branch_w", TensorProto.FLOAT, [32], rng.standard_normal(32).astype(np.float32).tobytes(), raw=True)
    branch = helper.make_graph([helper.make_node("Constant", [], ["bw"], value=const)], "then", [],
                               [helper.make_tensor_value_info("bw", TensorProto.FLOAT, [32])])
    if_node = helper.make_node("If", ["cond"], ["if_out"], then_branch=branch, else_branch=branch)
    top = helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cond_v", TensorProto.BOOL, [], [True]))
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    big = numpy_helper.from_array(rng.standard_normal(200).astype(np.float32), "plain")
    samples.append(_sample("subgraph_const_empty", _graph_with([empty, big], extra_nodes=[top, if_node])))
    return samples


def build_all() -> List[Sample]:
    return [all_families()] + per_family() + odd_layouts()


SAMPLE_BUILDERS: Dict[str, Callable[[], List[Sample]]] = {
    "all_families": lambda: [all_families()],
    "per_family": per_family,
    "odd_layouts": odd_layouts,
}


REQUIRED_FAMILIES = {"bytes", "planes", "fplanes", "narrow"}


def check_families(samples: List[Sample]) -> set:
    """The codec families used by the samples (the tests assert every one of FORMAT.md is there)."""
    used = set()
    for s in samples:
        used |= {f.split("/")[0] for f in s.families}
    return used
