"""The lossless stage (passes.onnxz): byte-for-byte round trips of generated models of every dtype
and layout, lazy tensor access, and the documented errors on bad inputs."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import onnxz
from passes.errors import (CorruptFileError, FileAccessError, InvalidArgumentError, InvalidModelError,
                           LimitExceededError, NewerFormatError)

RNG = np.random.default_rng(7)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _raw(name, dtype, shape, data: bytes) -> TensorProto:
    t = TensorProto()
    t.name, t.data_type = name, dtype
    t.dims.extend(shape)
    t.raw_data = data
    return t


def _weights(n, scale=0.05):
    return (RNG.standard_normal(n) * scale).astype(np.float32)


def all_dtype_tensors():
    """One initializer per dtype and payload layout (raw_data and the typed repeated fields)."""
    w = _weights(4096)
    ts = [
        numpy_helper.from_array(w.reshape(64, 64), "f32"),
        numpy_helper.from_array(w.astype(np.float16).reshape(64, 64), "f16"),
        _raw("bf16", TensorProto.BFLOAT16, [4096], (w.view(np.uint32) >> 16).astype(np.uint16).tobytes()),
        numpy_helper.from_array(w.astype(np.float64), "f64"),
        numpy_helper.from_array(w.astype(np.float16).astype(np.float32), "f32_holding_f16"),
        numpy_helper.from_array((w.view(np.uint32) & 0xFFFF0000).view(np.float32), "f32_holding_bf16"),
        numpy_helper.from_array(w.astype(np.float64).astype(np.float32).astype(np.float64) * 1.0, "f64_holding_f32"),
        numpy_helper.from_array(np.clip(np.round(RNG.standard_normal(5000) * 20), -127, 127).astype(np.int8), "i8"),
        numpy_helper.from_array(RNG.integers(0, 256, 3000).astype(np.uint8), "u8"),
        numpy_helper.from_array(RNG.integers(-300, 300, 2000).astype(np.int16), "i16"),
        numpy_helper.from_array(RNG.integers(0, 60000, 2000).astype(np.uint16), "u16"),
        numpy_helper.from_array(RNG.integers(-2**30, 2**30, 1000).astype(np.int32), "i32"),
        numpy_helper.from_array(RNG.integers(0, 2**32 - 1, 1000, dtype=np.uint64).astype(np.uint32), "u32"),
        numpy_helper.from_array(RNG.integers(-2**40, 2**40, 700).astype(np.int64), "i64"),
        numpy_helper.from_array(RNG.integers(0, 2**63, 700, dtype=np.uint64), "u64"),
        numpy_helper.from_array(RNG.integers(0, 2, 999).astype(bool), "b"),
        numpy_helper.from_array((RNG.standard_normal(300) + 1j * RNG.standard_normal(300)).astype(np.complex64), "c64"),
        numpy_helper.from_array(np.array([b"abc", b"de"] * 50, dtype=object), "strings"),
        numpy_helper.from_array(np.arange(3, dtype=np.int64), "tiny_shape"),
        numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty"),
        numpy_helper.from_array(np.float32(3.5), "scalar"),
        # typed repeated fields instead of raw_data
        helper.make_tensor("f32_float_data", TensorProto.FLOAT, [512], w[:512].tolist()),
        helper.make_tensor("f64_double_data", TensorProto.DOUBLE, [300], w[:300].astype(np.float64).tolist()),
        helper.make_tensor("i32_int32_data", TensorProto.INT32, [400], RNG.integers(-1000, 1000, 400).tolist()),
        helper.make_tensor("i64_int64_data", TensorProto.INT64, [400], RNG.integers(-2**40, 2**40, 400).tolist()),
        helper.make_tensor("u64_uint64_data", TensorProto.UINT64, [100], RNG.integers(0, 2**60, 100).tolist()),
        helper.make_tensor("f16_int32_data", TensorProto.FLOAT16, [256], w[:256].astype(np.float16).view(np.uint16).tolist()),
        helper.make_tensor("i8_int32_data", TensorProto.INT8, [256], RNG.integers(-128, 128, 256).tolist()),
    ]
    i4 = RNG.integers(-8, 8, 1000).astype(np.int8)
    ts.append(_raw("i4", TensorProto.INT4, [1000], ((i4[0::2] & 0xF) | ((i4[1::2] & 0xF) << 4)).astype(np.uint8).tobytes()))
    u4 = RNG.integers(0, 16, 999).astype(np.uint8)
    u4p = np.concatenate([u4, [0]]).astype(np.uint8)
    ts.append(_raw("u4", TensorProto.UINT4, [999], (u4p[0::2] | (u4p[1::2] << 4)).astype(np.uint8).tobytes()))
    return ts


def dtype_model() -> onnx.ModelProto:
    inits = all_dtype_tensors()
    outputs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    nodes = [helper.make_node("Identity", [t.name], [t.name + "_out"]) for t in inits]
    outputs = [helper.make_tensor_value_info(t.name + "_out", t.data_type, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "dtypes", [], outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def layout_model() -> onnx.ModelProto:
    """Weights in every place a tensor can live: Constant nodes inside If branches and a Loop body,
    a ConstantOfShape attribute, a sparse initializer, a function body, training info."""
    w1, w2, w3 = _weights(2000).reshape(40, 50), _weights(3000), _weights(1500)
    then_g = helper.make_graph([helper.make_node("Constant", [], ["tc"], value=numpy_helper.from_array(w1, "then_w"))],
                               "then", [], [helper.make_tensor_value_info("tc", TensorProto.FLOAT, [40, 50])])
    else_g = helper.make_graph([helper.make_node("Constant", [], ["ec"], value=numpy_helper.from_array(w1 * 2))],
                               "else", [], [helper.make_tensor_value_info("ec", TensorProto.FLOAT, [40, 50])])
    inner = helper.make_graph([helper.make_node("Constant", [], ["deep"], value=numpy_helper.from_array(w2))],
                              "inner", [], [helper.make_tensor_value_info("deep", TensorProto.FLOAT, [3000])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("If", ["cond_in"], ["body_out"], then_branch=inner, else_branch=inner)],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("body_out", TensorProto.FLOAT, [3000])])
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(w3[:200], "sp"), numpy_helper.from_array(np.arange(0, 1000, 5, dtype=np.int64)), [1000])
    fn = helper.make_function("local", "WithConst", ["a"], ["b"],
                              [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(w3, "fn_w")),
                               helper.make_node("Add", ["a", "k"], ["b"])],
                              [helper.make_opsetid("", 21)])
    nodes = [
        helper.make_node("If", ["cond"], ["y_if"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trip", "cond"], ["c_out", "y_loop"], body=body),
        helper.make_node("ConstantOfShape", ["shape"], ["filled"], value=numpy_helper.from_array(np.array([1.5], np.float32))),
        helper.make_node("WithConst", ["x"], ["y_fn"], domain="local"),
    ]
    g = helper.make_graph(
        nodes, "layouts",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), helper.make_tensor_value_info("trip", TensorProto.INT64, []),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [1]), helper.make_tensor_value_info("x", TensorProto.FLOAT, [1500])],
        [helper.make_tensor_value_info("y_if", TensorProto.FLOAT, [40, 50]), helper.make_tensor_value_info("y_fn", TensorProto.FLOAT, [1500])],
        [numpy_helper.from_array(_weights(5000).reshape(100, 50), "init_w")],
        sparse_initializer=[sparse])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("local", 1)], functions=[fn])
    m.ir_version = 10
    ti = m.training_info.add()
    ti.initialization.CopyFrom(helper.make_graph([], "init", [], [], [numpy_helper.from_array(_weights(700), "train_w")]))
    return m


def _expected_arrays(model: onnx.ModelProto):
    """Every tensor with a payload in the model, as numpy arrays (onnx's own reading)."""
    from onnx.external_data_helper import _get_all_tensors

    return [numpy_helper.to_array(t) for t in _get_all_tensors(model)]


def _roundtrip(tmp_path, model_path: Path, **kw):
    packed = tmp_path / "m.onnxz"
    stats = passes.pack(model_path, packed, **kw)
    out = passes.unpack(packed, tmp_path / "out" / model_path.name) if (tmp_path / "out").exists() else None
    return packed, stats, out


@pytest.fixture
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.mark.parametrize("build", [dtype_model, layout_model])
@pytest.mark.parametrize("threads", [1, 2])
def test_roundtrip_byte_for_byte(tmp_path, outdir, build, threads):
    src = tmp_path / "model.onnx"
    src.write_bytes(build().SerializeToString())
    packed = tmp_path / "model.onnxz"
    stats = passes.pack(src, packed, threads=threads)
    assert stats.packed_bytes == packed.stat().st_size
    assert stats.original_bytes == src.stat().st_size
    out = passes.unpack(packed, outdir / "model.onnx", threads=threads)
    assert _sha(out) == _sha(src)
    model = passes.load(packed, threads=threads)
    assert model.SerializeToString() == src.read_bytes()


def test_every_tensor_readable_lazily(tmp_path):
    m = dtype_model()
    src = tmp_path / "model.onnx"
    src.write_bytes(m.SerializeToString())
    passes.pack(src, tmp_path / "m.onnxz")
    with passes.open_packed(tmp_path / "m.onnxz", threads=2) as pm:
        assert len(set(pm.keys())) == len(pm.keys()) == len(m.graph.initializer)
        for t in m.graph.initializer:
            got, want = pm.get_tensor(t.name), numpy_helper.to_array(t)
            assert got.dtype == want.dtype and got.shape == want.shape, t.name
            if want.dtype == object:
                assert list(got.ravel()) == list(want.ravel())
            else:
                assert got.tobytes() == want.tobytes(), t.name
        meta = pm.metadata()
        assert meta["format_version"] in ("1.1", "1.2", "1.3", "1.4")
        assert meta["original_bytes"] == src.stat().st_size
        codecs_used = {t["codec"] for t in meta["tensors"]}
        assert {"narrow", "skeleton"} <= codecs_used and codecs_used & {"fplanes", "fpairs", "ans", "ans_shared"}, codecs_used
        by_key = {t["key"]: t for t in meta["tensors"]}
        # floats that are exactly narrower are stored narrow
        assert by_key["f32_holding_f16"]["codec"] == "narrow" and by_key["f32_holding_f16"]["params"]["to"] == TensorProto.FLOAT16
        assert by_key["f32_holding_bf16"]["params"]["to"] == TensorProto.BFLOAT16
        assert by_key["f32"]["codec"] in ("fplanes", "fpairs", "ans", "ans_shared")
        with pytest.raises(KeyError):
            pm.get_tensor("no such tensor")
        # a read-only mapping, as a dict of arrays would be
        assert list(pm) == pm.keys() and len(pm) == len(pm.keys())
        assert np.array_equal(pm["f32"], pm.get_tensor("f32"))
        with pytest.raises(KeyError):
            pm["no such tensor"]


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_pack_and_unpack_refuse_the_same_thread_counts(tmp_path, threads):
    src = tmp_path / "m.onnx"
    src.write_bytes(layout_model().SerializeToString())
    with pytest.raises(passes.InvalidArgumentError, match="threads must be a positive integer"):
        passes.pack(src, tmp_path / "m.onnxz", threads=threads)
    passes.pack(src, tmp_path / "m.onnxz", threads=1)
    with pytest.raises(passes.InvalidArgumentError, match="threads must be a positive integer"):
        passes.load(tmp_path / "m.onnxz", threads=threads)


def test_layout_tensors_found_everywhere(tmp_path):
    m = layout_model()
    src = tmp_path / "model.onnx"
    src.write_bytes(m.SerializeToString())
    passes.pack(src, tmp_path / "m.onnxz")
    with passes.open_packed(tmp_path / "m.onnxz") as pm:
        keys = pm.keys()
        # Constant nodes are known by their output name; named tensors by their name
        for k in ("init_w", "then_w", "ec", "deep", "deep#2", "fn_w", "train_w", "sp"):
            assert k in keys, (k, keys)
        got = sorted(pm.get_tensor(k).tobytes() for k in keys)
    want = {a.tobytes() for a in _expected_arrays(m) if a.size}
    assert want <= set(got)


def test_external_data_restored_beside_model(tmp_path, outdir):
    m = layout_model()
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "model.onnx"
    onnx.save_model(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=512)
    # a second file in a subfolder, written by hand with a gap before the payload
    m2 = onnx.load(src, load_external_data=False)
    assert (src_dir / "weights.bin").exists()
    packed = tmp_path / "m.onnxz"
    stats = passes.pack(src, packed)
    assert stats.files == 2
    out = passes.unpack(packed, outdir / "restored.onnx")
    assert _sha(out) == _sha(src)
    assert _sha(outdir / "weights.bin") == _sha(src_dir / "weights.bin")
    loaded = passes.load(packed)
    want = onnx.load(src)
    assert loaded.SerializeToString() == want.SerializeToString()
    assert passes.verify(packed, against=src).ok
    with passes.open_packed(packed) as pm:
        assert pm.get_tensor("init_w").tobytes() == numpy_helper.to_array(want.graph.initializer[0]).tobytes()
    del m2


def test_external_data_outside_folder_refused(tmp_path):
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(_weights(100), "w")]))
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", "400")):
        e = t.external_data.add()
        e.key, e.value = k, v
    (tmp_path / "secret.bin").write_bytes(b"\0" * 400)
    d = tmp_path / "d"
    d.mkdir()
    (d / "m.onnx").write_bytes(m.SerializeToString())
    with pytest.raises(InvalidModelError):
        passes.pack(d / "m.onnx", tmp_path / "x.onnxz")
    assert not (tmp_path / "x.onnxz").exists()


def test_pack_from_modelproto_and_determinism(tmp_path):
    m = dtype_model()
    src = tmp_path / "model.onnx"
    src.write_bytes(m.SerializeToString())
    passes.pack(src, tmp_path / "a.onnxz", threads=1)
    passes.pack(src, tmp_path / "b.onnxz", threads=2)
    passes.pack(m, tmp_path / "c.onnxz")
    a = (tmp_path / "a.onnxz").read_bytes()
    assert a == (tmp_path / "b.onnxz").read_bytes()
    out = passes.unpack(tmp_path / "c.onnxz", tmp_path / "c.onnx")
    assert out.read_bytes() == src.read_bytes()


def test_compresses_floats_and_ints(tmp_path):
    w = _weights(1 << 18)
    q = np.clip(np.round(RNG.laplace(size=1 << 18) * 6), -127, 127).astype(np.int8)
    w2 = w[:1001] * 3  # a second float tensor, small: fpairs without split
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(q, "q"),
                                                             numpy_helper.from_array(w2, "w2")]))
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    stats = passes.pack(src, tmp_path / "m.onnxz")
    with passes.open_packed(tmp_path / "m.onnxz") as pm:
        stored = {t["key"]: t["stored"] for t in pm.metadata()["tensors"]}
    assert stored["w"] < 0.9 * w.nbytes
    counts = np.bincount(q.view(np.uint8), minlength=256) / q.size
    h = -(counts[counts > 0] * np.log2(counts[counts > 0])).sum()
    assert stored["q"] < 1.03 * h / 8 * q.size
    assert sum(v["stored_bytes"] for v in stats.by_codec.values()) == sum(v for v in stored.values() if v)


# ------------------------------------------------------------------ damage and bad inputs

@pytest.fixture(scope="module")
def small_packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    w = _weights(3000)
    q = np.clip(np.round(RNG.standard_normal(2000) * 10), -127, 127).astype(np.int8)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(w[:800].astype(np.float16)))], "g", [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT16, [800])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(q, "q")]))
    src = d / "m.onnx"
    src.write_bytes(m.SerializeToString())
    packed = d / "m.onnxz"
    passes.pack(src, packed, chunk_bytes=4096)  # several chunks per tensor
    return src, packed


def _read_everything(path):
    """Every way of reading: all must fail with CorruptFileError on a damaged file."""
    passes.verify(path)
    with passes.open_packed(path) as pm:
        for k in pm.keys():
            pm.get_tensor(k)
    passes.load(path)


def test_every_byte_flip_detected(tmp_path, small_packed):
    src, packed = small_packed
    data = bytearray(packed.read_bytes())
    bad = tmp_path / "bad.onnxz"
    step = max(1, len(data) // 1500)
    for pos in list(range(0, len(data), step)) + list(range(len(data) - 70, len(data))):
        damaged = bytearray(data)
        damaged[pos] ^= 0x41
        bad.write_bytes(damaged)
        with pytest.raises(CorruptFileError):
            _read_everything(bad)


def test_truncation_and_extension_detected(tmp_path, small_packed):
    src, packed = small_packed
    data = packed.read_bytes()
    bad = tmp_path / "bad.onnxz"
    for n in sorted(set(list(range(0, 80)) + list(range(0, len(data), max(1, len(data) // 200))))):
        bad.write_bytes(data[:n])
        with pytest.raises(CorruptFileError):
            _read_everything(bad)
    bad.write_bytes(data + b"\0")
    with pytest.raises(CorruptFileError):
        _read_everything(bad)


def _rewrite_index(data: bytes, mutate) -> bytes:
    """A copy of the packed file with its index changed and every checksum made valid again."""
    import json
    import struct
    import zlib

    import zstandard as zstd

    from passes.onnxz.format import pack_header

    ioff, ilen = struct.unpack_from("<QQ", data, 16)
    obj = json.loads(zstd.ZstdDecompressor().decompress(data[ioff:ioff + ilen]))
    mutate(obj)
    text = json.dumps(obj).encode()
    frame = zstd.ZstdCompressor(write_checksum=True).compress(text)
    body = data[64:ioff]
    return pack_header(ioff, len(frame), len(text), ioff + len(frame), zlib.crc32(frame)) + body + frame


def test_newer_format_and_unknown_codec(tmp_path, small_packed):
    import struct
    import zlib

    src, packed = small_packed
    data = bytearray(packed.read_bytes())
    newer = bytearray(data)
    struct.pack_into("<H", newer, 8, 2)
    struct.pack_into("<I", newer, 60, zlib.crc32(bytes(newer[:60])))
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(newer)
    with pytest.raises(NewerFormatError, match="newer version"):
        passes.open_packed(bad)

    def new_codec(obj):
        obj["tensors"][0]["stream"]["codec"] = "hyper-ans"

    bad.write_bytes(_rewrite_index(bytes(data), new_codec))
    with pytest.raises(NewerFormatError, match="hyper-ans"):
        passes.open_packed(bad)
    bad.write_bytes(_rewrite_index(bytes(data), lambda obj: None))
    passes.verify(bad)  # the rewriting itself keeps a valid file


@pytest.mark.parametrize("mutation", [
    lambda o: o["files"][0].__setitem__("size", o["files"][0]["size"] + 1),
    lambda o: o["files"][0].__setitem__("sha256", "0" * 64),
    lambda o: o["tensors"][0]["stream"]["chunks"][0].__setitem__(1, 10**12),
    lambda o: o["tensors"][0]["stream"]["chunks"][0].__setitem__(0, 10),
    lambda o: o["tensors"][0]["stream"]["chunks"][0].__setitem__(0, -5),
    lambda o: o["tensors"][0]["stream"]["chunks"][0][2].append(5),
    lambda o: o["tensors"][0]["stream"]["chunks"].append(o["tensors"][0]["stream"]["chunks"][0]),
    lambda o: o["tensors"][0].__setitem__("length", 3),
    lambda o: o["tensors"][0]["stream"]["params"].__setitem__("width", 3),
    lambda o: o["files"][0]["cuts"].reverse(),
    lambda o: o["files"][0]["cuts"][0].__setitem__(2, 99),
    lambda o: o["files"].append(dict(o["files"][0], name="../escape.bin")),
    lambda o: o.__setitem__("tensors", "nope"),
    lambda o: o["tensors"][1].__setitem__("stream", {"codec": "bytes", "chunks": [[64, 10, [5.5]]]}),
])
def test_inconsistent_index_refused(tmp_path, small_packed, mutation):
    src, packed = small_packed
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(_rewrite_index(packed.read_bytes(), mutation))
    with pytest.raises(CorruptFileError):
        _read_everything(bad)


def test_size_limit(tmp_path, small_packed):
    src, packed = small_packed
    with pytest.raises(LimitExceededError):
        passes.open_packed(packed, max_bytes=100)
    with pytest.raises(LimitExceededError):
        passes.unpack(packed, tmp_path / "x.onnx", max_bytes=100)
    assert not (tmp_path / "x.onnx").exists()


def test_verify_against(tmp_path, small_packed):
    src, packed = small_packed
    r = passes.verify(packed, against=src)
    assert r.ok and all(c["ok"] for c in r.checks) and r
    other = tmp_path / "other.onnx"
    data = bytearray(src.read_bytes())
    data[-1] ^= 1
    other.write_bytes(data)
    r = passes.verify(packed, against=other)
    assert not r.ok and any(not c["ok"] for c in r.checks)
    assert not r  # `assert passes.verify(...)` fails on a mismatch (the README's example)


def test_bad_inputs(tmp_path, small_packed):
    src, packed = small_packed
    with pytest.raises(FileAccessError):
        passes.pack(tmp_path / "missing.onnx", tmp_path / "x.onnxz")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xfe not a model at all" * 10)
    with pytest.raises(InvalidModelError):
        passes.pack(junk, tmp_path / "x.onnxz")
    existing = tmp_path / "exists.onnxz"
    existing.write_bytes(b"keep")
    with pytest.raises(FileAccessError):
        passes.pack(src, existing)
    assert existing.read_bytes() == b"keep"
    passes.pack(src, existing, force=True)
    with pytest.raises(InvalidArgumentError):
        passes.pack(src, src, force=True)
    with pytest.raises(CorruptFileError):
        passes.open_packed(src)  # an .onnx is not a packed file
    with pytest.raises(CorruptFileError):
        passes.unpack(junk, tmp_path / "y.onnx")
    with pytest.raises(FileAccessError):
        passes.unpack(packed, existing)  # exists, no force
    with pytest.raises(InvalidArgumentError):
        passes.open_packed(packed, threads=0)
    with pytest.raises(FileAccessError):
        passes.open_packed(tmp_path / "missing.onnxz")
    pm = passes.open_packed(packed)
    pm.close()
    with pytest.raises(InvalidArgumentError):
        pm.get_tensor(pm.keys()[0])


def test_load_plain_onnx_and_default_unpack_name(tmp_path, small_packed):
    src, packed = small_packed
    assert passes.load(src).SerializeToString() == src.read_bytes()
    copy = tmp_path / "copy.onnxz"
    copy.write_bytes(packed.read_bytes())
    out = passes.unpack(copy)
    assert out == tmp_path / "copy.onnx" and out.read_bytes() == src.read_bytes()


def test_numpy_fallback_gives_the_same_bytes(tmp_path, monkeypatch):
    """Without the optional C extension the numpy planes give identical files and tensors."""
    from passes.onnxz import codecs

    src = tmp_path / "model.onnx"
    src.write_bytes(dtype_model().SerializeToString())
    passes.pack(src, tmp_path / "c.onnxz")
    monkeypatch.setattr(codecs, "_fast", None)
    passes.pack(src, tmp_path / "n.onnxz")
    assert (tmp_path / "c.onnxz").read_bytes() == (tmp_path / "n.onnxz").read_bytes()
    out = passes.unpack(tmp_path / "c.onnxz", tmp_path / "out.onnx")
    assert out.read_bytes() == src.read_bytes()
    for width in (2, 4, 8):
        data = RNG.integers(0, 256, 4096 * width, dtype=np.uint8)
        for sign in (False, True):
            planes = codecs.split_planes(data, width, sign)
            back = np.empty_like(data)
            codecs.merge_planes(planes.reshape(-1), width, sign, back[:])
            assert np.array_equal(back, data)


def test_paired_rank_codecs_round_trip_and_damage_detected(tmp_path, monkeypatch):
    """The paired-exponent codec, forced on every float tensor: exact, and every flip detected."""
    from passes.onnxz import codecs

    def forced(data, dtype, field, chunk_bytes=codecs.CHUNK_BYTES, try_lz=None):
        if dtype == TensorProto.FLOAT and data.size % 4 == 0:
            return codecs._encode_planes(data, "fpairs", 4, chunk_bytes, split=3 if data.size > 4096 else 0)
        return codecs._encode_planes(data, "bpairs", 1, chunk_bytes)

    monkeypatch.setattr(codecs, "encode_tensor", forced)
    w = np.concatenate([_weights(2001), np.float32([1e-30, -3e20, 0.0, -0.0, np.inf, np.nan])])  # escapes, odd count
    q = np.concatenate([np.clip(np.round(RNG.standard_normal(3001) * 2), -8, 8), np.arange(-128, 128)]).astype(np.int8)
    w2 = w[:1001] * 3  # a second float tensor, small: fpairs without split
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(q, "q"),
                                                             numpy_helper.from_array(w2, "w2")]))
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed, chunk_bytes=4004)
    with passes.open_packed(packed) as pm:
        meta = pm.metadata()["tensors"]
        assert [t["codec"] for t in meta] == ["fpairs", "bpairs", "fpairs"]
        assert meta[0]["params"].get("split") == 3 and not meta[2]["params"].get("split")
        assert pm.get_tensor("w").tobytes() == w.tobytes()
        assert pm.get_tensor("q").tobytes() == q.tobytes()
        assert pm.get_tensor("w2").tobytes() == w2.tobytes()
    assert passes.load(packed).SerializeToString() == src.read_bytes()
    data = packed.read_bytes()
    bad = tmp_path / "bad.onnxz"
    for pos in range(0, len(data), max(1, len(data) // 800)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        bad.write_bytes(damaged)
        with pytest.raises(CorruptFileError):
            _read_everything(bad)
    monkeypatch.setattr(codecs, "_fast", None)  # the numpy expand reads the same file
    with passes.open_packed(packed) as pm:
        assert pm.get_tensor("w").tobytes() == w.tobytes()
        assert pm.get_tensor("q").tobytes() == q.tobytes()
        assert pm.get_tensor("w2").tobytes() == w2.tobytes()


def test_effort_max_tries_split_and_round_trips(tmp_path):
    # split is off by default (decode speed); effort="max" tries it, and the file is never larger
    w = _weights(1 << 18)
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w")]))
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    default = passes.pack(src, tmp_path / "d.onnxz")
    best = passes.pack(src, tmp_path / "x.onnxz", effort="max")
    assert best.packed_bytes <= default.packed_bytes
    with passes.open_packed(tmp_path / "d.onnxz") as pm:
        assert not any(t["params"].get("split") for t in pm.metadata()["tensors"])
    with passes.open_packed(tmp_path / "x.onnxz") as pm:
        assert np.array_equal(pm.get_tensor("w"), w)
    assert passes.unpack(tmp_path / "x.onnxz", tmp_path / "x.onnx").read_bytes() == src.read_bytes()
    with pytest.raises(passes.InvalidArgumentError):
        passes.pack(src, tmp_path / "e.onnxz", effort="fast")


@pytest.mark.parametrize("n", [1, 2, 7, 4095, 4096, 4097, 9001])
@pytest.mark.parametrize("width", [2, 4])
def test_fused_pairs_merge_matches_numpy(n, width, monkeypatch):
    """The C one-pass fpairs decode (ranks -> top byte, planes read in place) equals the numpy
    path, with escapes everywhere (also in the last pair of an odd count), and refuses escapes
    that do not match the ranks."""
    from passes.onnxz import codecs

    if codecs._fast is None:
        pytest.skip("C extension not built")
    data = RNG.integers(0, 256, n * width, dtype=np.uint8)
    planes = codecs.split_planes(data, width, True)
    table, ranks, escapes = codecs.rank_planes(planes[0])  # random bytes: many escapes
    rest = [bytes(p) for p in planes[1:]]
    fast = np.empty_like(data)
    assert codecs.pairs_merge(table, ranks, escapes, rest, fast)
    monkeypatch.setattr(codecs, "_fast", None)
    slow = np.empty_like(data)
    assert codecs.pairs_merge(table, ranks, escapes, rest, slow)
    assert np.array_equal(fast, data) and np.array_equal(slow, data)
    monkeypatch.undo()
    if escapes.size:
        assert not codecs.pairs_merge(table, ranks, escapes[:-1], rest, fast)
        assert not codecs.pairs_merge(table, ranks, np.append(escapes, np.uint8(1)), rest, fast)
    odd = ranks.copy()
    if n % 2:  # the pad nibble of an odd count is ignored, even when it reads 15
        odd[-1] |= 0x0F
        assert codecs.pairs_merge(table, odd, escapes, rest, fast) and np.array_equal(fast, data)


# ------------------------------------------------------------------ reader API: memory, tensors, files

def test_packed_bytes_in_memory_read_like_the_file(tmp_path):
    """open_packed / load / verify / unpack over the packed bytes in memory (bytes, bytearray,
    memoryview, numpy) give what the file gives; damage in memory is refused the same way."""
    m = dtype_model()
    src = tmp_path / "model.onnx"
    src.write_bytes(m.SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed)
    data = packed.read_bytes()
    with passes.open_packed(packed) as pf_file:
        want = {k: pf_file.get_tensor(k) for k in pf_file.keys()}
    for buf in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        with passes.open_packed(buf, threads=2) as pm:
            assert pm.keys() == list(want)
            for k, v in want.items():
                got = pm.get_tensor(k)
                assert got.dtype == v.dtype and got.shape == v.shape
                if v.dtype != object:
                    assert got.tobytes() == v.tobytes(), k
            assert pm.metadata()["packed_bytes"] == len(data)
    assert passes.load(data).SerializeToString() == src.read_bytes()
    assert passes.verify(data, against=src).ok
    out = onnxz.unpack(data, tmp_path / "r.onnx")
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(InvalidArgumentError):
        onnxz.unpack(data)  # no destination for bytes
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x40
    with pytest.raises(CorruptFileError):
        with passes.open_packed(damaged) as pm:
            for k in pm.keys():
                pm.get_tensor(k)
            passes.load(bytes(damaged))
    with pytest.raises(CorruptFileError):
        passes.open_packed(data[:-1])
    with pytest.raises(CorruptFileError):
        passes.open_packed(b"not a pack at all, just some bytes" * 4)


def test_public_reader_api_tensor_bytes_and_restore_file(tmp_path):
    """tensor_bytes / tensors_bytes give each payload exactly as it lies in the original file;
    restore_file gives the whole file (into a caller's buffer too), and with skip= leaves the
    skipped payloads untouched."""
    from passes.onnxz.reader import PackedFile

    w = _weights(1 << 17)
    small = _weights(100)
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(small, "small")]))
    src = tmp_path / "m.onnx"
    raw = m.SerializeToString()
    src.write_bytes(raw)
    passes.pack(src, tmp_path / "m.onnxz", chunk_bytes=64 << 10)
    for threads in (1, 2, 3):
        with PackedFile(tmp_path / "m.onnxz", threads=threads) as pf:
            ew, es = pf.tensor("w"), pf.tensor("small")
            assert ew.stream is not None and len(ew.stream.chunks) > 4 and es.stream is None  # small: in the skeleton
            assert pf.tensor_bytes(ew).tobytes() == raw[ew.offset:ew.offset + ew.length] == w.tobytes()
            assert pf.tensor_bytes("small").tobytes() == small.tobytes()
            outs = [np.empty(ew.length, np.uint8), np.empty(es.length, np.uint8)]
            got = pf.tensors_bytes(["w", es], outs)
            assert got[0] is outs[0] and got[1].tobytes() == small.tobytes() and outs[0].tobytes() == w.tobytes()
            whole = pf.restore_file(0)
            assert whole.tobytes() == raw
            into = np.empty(len(raw), np.uint8)
            assert pf.restore_file(0, into) is into and into.tobytes() == raw
            holes = np.full(len(raw), 7, np.uint8)
            pf.restore_file(0, holes, skip=["w"])
            assert (holes[ew.offset:ew.offset + ew.length] == 7).all()
            keep = np.ones(len(raw), bool)
            keep[ew.offset:ew.offset + ew.length] = False
            assert holes[keep].tobytes() == np.frombuffer(raw, np.uint8)[keep].tobytes()
            assert b"".join(bytes(x) for x in pf.restore_windows(0)) == raw
            assert pf.read_range(0, ew.offset + 5, 1000).tobytes() == raw[ew.offset + 5:ew.offset + 1005]
            with pytest.raises(InvalidArgumentError):
                pf.read_range(0, len(raw) - 2, 10)
            with pytest.raises(InvalidArgumentError):
                pf.tensor_bytes(ew, np.empty(ew.length - 1, np.uint8))
            with pytest.raises(KeyError):
                pf.tensor("nope")
        with passes.open_packed(tmp_path / "m.onnxz", threads=threads) as pm:
            both = pm.get_tensors()
            assert np.array_equal(both["w"], w) and np.array_equal(both["small"], small)
            assert pm.packed_file.tensor("w").length == w.nbytes


def test_damaged_chunk_among_many_raises_and_leaves_no_worker_running(tmp_path):
    """One damaged chunk among many, decoded by several threads: CorruptFileError, and the pool
    is idle again (the next read of an intact tensor works)."""
    from passes.onnxz.reader import PackedFile

    w, v = _weights(1 << 17), _weights(1 << 16)
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v")]))
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed, chunk_bytes=32 << 10)
    data = bytearray(packed.read_bytes())
    with PackedFile(bytes(data)) as pf:
        c = pf.tensor("w").stream.chunks[5]
    data[c.offset + 3] ^= 1
    for threads in (1, 2, 4):
        with PackedFile(bytes(data), threads=threads) as pf:
            with pytest.raises(CorruptFileError):
                pf.tensor_bytes("w")
            with pytest.raises(CorruptFileError):
                pf.restore_file(0)
            with pytest.raises(CorruptFileError):
                for _ in pf.restore_windows(0):
                    pass
            assert pf.tensor_bytes("v").tobytes() == v.tobytes()


def test_pack_bytes_do_not_depend_on_threads(tmp_path, monkeypatch):
    """Tensors are encoded in parallel but written in a fixed order: the same file at any thread
    count, also when the lookahead budget forces the writer to wait for results."""
    from passes.onnxz import writer

    inits = [numpy_helper.from_array(_weights(3000 + 997 * i), f"w{i}") for i in range(12)]
    m = helper.make_model(helper.make_graph([], "g", [], [], inits))
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    passes.pack(src, tmp_path / "t1.onnxz", threads=1)
    want = (tmp_path / "t1.onnxz").read_bytes()
    for threads in (2, 5):
        passes.pack(src, tmp_path / f"t{threads}.onnxz", threads=threads)
        assert (tmp_path / f"t{threads}.onnxz").read_bytes() == want
    monkeypatch.setattr(writer, "LOOKAHEAD_BYTES", 1)
    seen = []
    passes.pack(src, tmp_path / "tight.onnxz", threads=3, progress=lambda d, t: seen.append(d))
    assert (tmp_path / "tight.onnxz").read_bytes() == want
    assert seen == sorted(seen) and seen[-1] == src.stat().st_size
    with pytest.raises(InvalidArgumentError):
        passes.pack(src, tmp_path / "bad.onnxz", threads=-1, force=True)


def test_damage_in_memory_is_refused_like_on_disk(tmp_path):
    """Byte flips spread over a small pack, read from bytes in memory and from the file: both
    readers refuse the same mutants with a documented error, or both restore the original."""
    src = tmp_path / "model.onnx"
    src.write_bytes(dtype_model().SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed)
    data = packed.read_bytes()
    original = src.read_bytes()
    bad = tmp_path / "bad.onnxz"

    def verdict(source):
        try:
            with onnxz.reader.PackedFile(source, threads=2) as pf:
                return pf.restore_file(0).tobytes() == original
        except passes.SurgeonError as exc:
            return type(exc).__name__

    for pos in range(0, len(data), max(1, len(data) // 300)):
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        bad.write_bytes(damaged)
        on_disk = verdict(bad)
        assert on_disk is not False, pos  # never a wrong file
        assert verdict(bytes(damaged)) == on_disk, pos
    for cut in (1, 63, 64, len(data) // 2, len(data) - 1):
        assert isinstance(verdict(data[:cut]), str)


def test_reader_refuses_what_is_neither_path_nor_buffer():
    for bad in (None, 3, object(), 2.5):
        with pytest.raises(InvalidArgumentError):
            passes.open_packed(bad)


def test_get_tensor_into_a_reused_array(tmp_path):
    w = _weights(1 << 15).reshape(128, 256)
    i64 = np.arange(3000, dtype=np.int64)
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w"), helper.make_tensor("v", TensorProto.INT64, [3000], i64.tolist())]))
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    passes.pack(src, tmp_path / "m.onnxz")
    with passes.open_packed(tmp_path / "m.onnxz", threads=2) as pm:
        out = np.zeros_like(w)
        assert pm.get_tensor("w", out) is out and np.array_equal(out, w)
        typed = np.zeros(3000, np.int64)  # int64_data varints: decoded, then copied
        assert pm.get_tensor("v", typed) is typed and np.array_equal(typed, i64)
        for bad in (np.zeros((256, 128), np.float32), np.zeros_like(w, dtype=np.float64), np.zeros((128, 512), np.float32)[:, ::2], w.copy().tolist()):
            with pytest.raises(InvalidArgumentError):
                pm.get_tensor("w", bad)


@pytest.mark.parametrize("window", [1, 700, 4096, 1 << 16])
def test_restore_in_small_windows(tmp_path, monkeypatch, window):
    """Windows smaller than chunks and skeleton pieces (the pipeline reuses two arrays, hashes
    on its own thread): every way of restoring still gives the original bytes."""
    from passes.onnxz import reader

    m = dtype_model()
    src = tmp_path / "model.onnx"
    src.write_bytes(m.SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed, chunk_bytes=2048)
    monkeypatch.setattr(reader, "WINDOW_BYTES", window)
    raw = src.read_bytes()
    for threads in (1, 2, 3):
        with reader.PackedFile(packed, threads=threads) as pf:
            windows = [bytes(w) for w in pf.restore_windows(0)]
            assert b"".join(windows) == raw
            assert len(windows) > 1 and max(len(w) for w in windows) <= max(window, 2048 * 4)
            assert pf.restore_file(0).tobytes() == raw
            it = pf.restore_windows(0)
            next(it)
            it.close()  # abandoned half-way: the workers finish, nothing is left running
        out = reader.unpack(packed, tmp_path / f"r{threads}.onnx", threads=threads)
        assert out.read_bytes() == raw


def _direct_io_works(folder) -> bool:
    try:
        fd = os.open(folder / ".direct_probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / ".direct_probe")
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("window", [5000, 1 << 16])
def test_unpack_writes_whole_blocks_directly(tmp_path, monkeypatch, window):
    """unpack writes each window with O_DIRECT in whole blocks (the partial last block carried to
    the next window, the file's tail written through the page cache): same bytes at 1 and 2
    threads; same bytes when a direct write is refused half-way (plain writes take over), with
    direct_io=False and with ONNXZ_NO_DIRECT."""
    import errno
    import fcntl

    from passes.onnxz import reader

    m = dtype_model()
    src = tmp_path / "model.onnx"
    src.write_bytes(m.SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed, chunk_bytes=2048)
    raw = src.read_bytes()
    monkeypatch.setattr(reader, "WINDOW_BYTES", window)
    real_pwrite = os.pwrite
    writes, fail = [], []

    def spy(fd, data, offset):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
        if direct and fail:
            fail.pop()
            raise OSError(errno.EINVAL, "refused")
        writes.append((direct, len(memoryview(data)), offset))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    for threads in (1, 2):
        writes.clear()
        out = reader.unpack(packed, tmp_path / f"d{threads}.onnx", threads=threads)
        assert out.read_bytes() == raw
        direct = [w for w in writes if w[0]]
        assert all(n % reader.ALIGN == 0 and off % reader.ALIGN == 0 for _, n, off in direct)
        if _direct_io_works(tmp_path):
            assert sum(n for _, n, _ in direct) == len(raw) - len(raw) % reader.ALIGN
            assert [w for w in writes if not w[0]] == [(False, len(raw) % reader.ALIGN, len(raw) - len(raw) % reader.ALIGN)]
    for threads in (1, 2):
        fail.append(1)
        assert reader.unpack(packed, tmp_path / f"refused{threads}.onnx", threads=threads).read_bytes() == raw
        assert not fail or not _direct_io_works(tmp_path)
    writes.clear()
    assert reader.unpack(packed, tmp_path / "kw.onnx", threads=2, direct_io=False).read_bytes() == raw
    assert writes and not any(w[0] for w in writes)
    monkeypatch.setenv("ONNXZ_NO_DIRECT", "1")
    writes.clear()
    assert reader.unpack(packed, tmp_path / "plain.onnx", threads=1).read_bytes() == raw
    assert writes and not any(w[0] for w in writes)


# ---------------------------------------------------------------- ans_shared (format 1.2)

def _small_tensor_model():
    """Many KB-sized tensors of two kinds (int8, float32): what shared tables are for."""
    rng = np.random.default_rng(12)
    inits = []
    for i in range(12):
        n = int(rng.integers(1100, 6000))
        q = np.clip(np.round(rng.laplace(0, 12 + i, n)), -127, 127).astype(np.int8)
        inits.append(numpy_helper.from_array(q, f"q{i}"))
        inits.append(numpy_helper.from_array((rng.standard_normal(n // 2) * 0.1).astype(np.float32), f"w{i}"))
    return helper.make_model(helper.make_graph([], "g", [], [], inits))


def test_encode_shared_is_the_ans_blob_without_its_table():
    from passes.onnxz import ans

    rng = np.random.default_rng(3)
    for n, lanes_log2 in ((2, 0), (777, 0), (5000, 2), (9000, 2)):
        sym = np.clip(np.round(rng.laplace(128, 9, n)), 0, 255).astype(np.uint8)
        freq = ans.normalise(np.bincount(sym, minlength=256))
        short = ans.encode_shared(sym, freq, lanes_log2)
        whole = ans.with_table(short, ans.write_table(freq))
        assert whole == ans.encode_numpy(sym, lanes_log2)
        out = np.empty(n, np.uint8)
        ans.decode_numpy(whole, n, out)
        assert np.array_equal(out, sym)


@pytest.mark.parametrize("whole_below_plane", [True, False])
def test_small_tensors_share_tables_and_round_trip(tmp_path, monkeypatch, whole_below_plane):
    """Format 1.2: small payloads code planes with tables stored once in the index; the file says
    1.2, restores byte for byte, every tensor decodes exactly (also planes the C decoder of `ans`
    cannot take, decoded by numpy), and it is smaller than without shared tables."""
    from passes.onnxz import codecs
    from passes.onnxz.reader import PackedFile

    monkeypatch.setattr(codecs, "SHARED_WHOLE_BELOW_PLANE", whole_below_plane)
    m = _small_tensor_model()
    src = tmp_path / "m.onnx"
    src.write_bytes(m.SerializeToString())
    stats = passes.pack(src, tmp_path / "m.onnxz", threads=2)
    again = passes.pack(src, tmp_path / "m1.onnxz", threads=1)
    assert (tmp_path / "m.onnxz").read_bytes() == (tmp_path / "m1.onnxz").read_bytes()
    with PackedFile(tmp_path / "m.onnxz") as pf:
        assert pf.index.version == (1, 2) and pf.index.raw["ans_tables"]
        shared = [t for t in pf.index.tensors if t.stream is not None and t.stream.codec == "ans_shared"]
        assert {t.dtype for t in shared} == {TensorProto.INT8, TensorProto.FLOAT}
    with passes.open_packed(tmp_path / "m.onnxz", threads=2) as pm:
        for t in m.graph.initializer:
            assert pm.get_tensor(t.name).tobytes() == numpy_helper.to_array(t).tobytes(), t.name
    assert passes.unpack(tmp_path / "m.onnxz", tmp_path / "r.onnx").read_bytes() == src.read_bytes()
    monkeypatch.setattr(codecs.SharedTables, "build", classmethod(lambda cls, payloads: cls()))
    alone = passes.pack(src, tmp_path / "a.onnxz", threads=2)
    assert alone.packed_bytes > stats.packed_bytes == again.packed_bytes
    with passes.open_packed(tmp_path / "a.onnxz") as pm:
        meta = pm.metadata()
        # no shared table, but 1.2 all the same: every file carries its XXH3-128 restore digest
        assert meta["format_version"] == "1.2" and "ans_tables" not in pm.packed_file.index.raw
        assert all(len(f["xxh3_128"]) == 32 for f in meta["files"])


def _first_shared(index):
    return next(t["stream"] for t in index["tensors"] if t.get("stream") and t["stream"]["codec"] == "ans_shared")


@pytest.mark.parametrize("change, error", [
    (lambda ix: _first_shared(ix)["params"].update(tables=[99] * len(_first_shared(ix)["params"]["tables"])), CorruptFileError),
    (lambda ix: _first_shared(ix)["params"].update(tables=[-1] * len(_first_shared(ix)["params"]["tables"])), CorruptFileError),
    (lambda ix: _first_shared(ix)["params"].update(tables=[0, 0, 0]), CorruptFileError),
    (lambda ix: ix.update(ans_tables=["not base64!"]), CorruptFileError),
    (lambda ix: ix.update(ans_tables="AAAA"), CorruptFileError),
    (lambda ix: ix.pop("ans_tables"), CorruptFileError),
    (lambda ix: ix.update(ans_tables=[base64_of(b"\x05\x00\x01\x02\x03\x04\x05\xff\xff")] * len(ix["ans_tables"])), CorruptFileError),
    (lambda ix: _first_shared(ix).update(codec="ans_shared2"), NewerFormatError),
])
def test_shared_tables_refused_when_damaged(tmp_path, change, error):
    src = tmp_path / "m.onnx"
    src.write_bytes(_small_tensor_model().SerializeToString())
    passes.pack(src, tmp_path / "m.onnxz")
    packed = tmp_path / "m.onnxz"
    packed.write_bytes(_rewrite_index(packed.read_bytes(), change))
    with pytest.raises(error):
        with passes.open_packed(tmp_path / "m.onnxz") as pm:
            for k in pm.keys():
                pm.get_tensor(k)


def base64_of(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode()


# ---------------------------------------------------------------- restore digests (format 1.2)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_writer_stores_both_digests(small_packed):
    import xxhash

    src, packed = small_packed
    data = src.read_bytes()
    with passes.open_packed(packed) as pm:
        meta = pm.metadata()
    assert meta["format_version"] == "1.2"
    (f,) = meta["files"]
    assert f["sha256"] == hashlib.sha256(data).hexdigest()
    assert f["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()


@pytest.fixture
def damaging_decoder(monkeypatch):
    """A reader bug that the chunk checksums cannot see: one restored byte flipped after decoding
    (the first byte of every window: skeleton bytes)."""
    from passes.onnxz.reader import PackedFile

    fill, whole = PackedFile._fill, PackedFile._whole_file_tasks

    def bad_fill(self, window, items, skel):
        tasks = fill(self, window, items, skel)
        if window.size:
            window[0] ^= 0x40
        return tasks

    def bad_whole(self, fe, window, skel):  # (a file in one window on one thread: _fill is not used)
        tasks = whole(self, fe, window, skel)
        if window.size:
            window[0] ^= 0x40
        return tasks

    monkeypatch.setattr(PackedFile, "_fill", bad_fill)
    monkeypatch.setattr(PackedFile, "_whole_file_tasks", bad_whole)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("digest,label", [("fast", "xxh3_128"), ("sha256", "sha256")])
def test_damaged_restore_refused_by_each_digest(tmp_path, small_packed, damaging_decoder, threads, digest, label):
    _, packed = small_packed
    with pytest.raises(CorruptFileError, match=f"does not match its {label}"):
        passes.unpack(packed, tmp_path / "r.onnx", threads=threads, digest=digest)
    assert not (tmp_path / "r.onnx").exists()
    with pytest.raises(CorruptFileError, match=f"does not match its {label}"):
        passes.load(packed, threads=threads, digest=digest)
    with passes.open_packed(packed, threads=threads) as pm:
        with pytest.raises(CorruptFileError, match=f"does not match its {label}"):
            list(pm.packed_file.restore_windows(0, digest=digest))
    with pytest.raises(CorruptFileError, match="does not match its"):
        passes.verify(packed, threads=threads)
    # digest="none" (and the older check_sha256=False) restores the damage: only chunk checksums
    passes.unpack(packed, tmp_path / "n.onnx", threads=threads, digest="none")
    passes.unpack(packed, tmp_path / "o.onnx", threads=threads, check_sha256=False)


def test_each_digest_checks_its_own_field(tmp_path, small_packed):
    """A wrong stored xxh3_128 fails the default restore and verify, not a sha256 restore; a wrong
    sha256 fails a sha256 restore and verify, not the default one."""
    src, packed = small_packed
    data = packed.read_bytes()

    def with_field(key, value):
        def mutate(obj):
            obj["files"][0][key] = value
        path = tmp_path / f"{key}.onnxz"
        path.write_bytes(_rewrite_index(data, mutate))
        return path

    bad_fast = with_field("xxh3_128", "0" * 32)
    with pytest.raises(CorruptFileError, match="xxh3_128"):
        passes.unpack(bad_fast, tmp_path / "a.onnx")
    assert passes.unpack(bad_fast, tmp_path / "b.onnx", digest="sha256").read_bytes() == src.read_bytes()
    assert passes.unpack(bad_fast, tmp_path / "c.onnx", check_sha256=True).read_bytes() == src.read_bytes()
    with pytest.raises(CorruptFileError, match="xxh3_128"):
        passes.verify(bad_fast)
    bad_sha = with_field("sha256", "0" * 64)
    assert passes.unpack(bad_sha, tmp_path / "d.onnx").read_bytes() == src.read_bytes()
    with pytest.raises(CorruptFileError, match="sha256"):
        passes.unpack(bad_sha, tmp_path / "e.onnx", digest="sha256")
    with pytest.raises(CorruptFileError, match="sha256"):
        passes.verify(bad_sha)
    for bad in ("XYZ", 5, "0" * 31):
        with pytest.raises(CorruptFileError, match="xxh3_128"):
            passes.open_packed(with_field("xxh3_128", bad))


def test_digest_keyword_errors(tmp_path, small_packed):
    _, packed = small_packed
    with pytest.raises(InvalidArgumentError, match="digest must be one of"):
        passes.unpack(packed, tmp_path / "a.onnx", digest="md5")
    with pytest.raises(InvalidArgumentError, match="contradicts"):
        passes.unpack(packed, tmp_path / "a.onnx", digest="sha256", check_sha256=False)
    with pytest.raises(InvalidArgumentError, match="digest must be one of"):
        passes.load(packed, digest="both")
    assert not (tmp_path / "a.onnx").exists()


@pytest.mark.parametrize("folder", ["v1.0", "v1.1"])
def test_old_files_still_checked_by_sha256(tmp_path, folder, damaging_decoder):
    """1.0 / 1.1 files have no xxh3_128: the default restore falls back to their sha256."""
    path = sorted((GOLDEN / folder).glob("[a-m]*.onnxz"))[0]
    with passes.open_packed(path) as pm:
        assert all(f["xxh3_128"] is None for f in pm.metadata()["files"])
    with pytest.raises(CorruptFileError, match="does not match its sha256"):
        passes.unpack(path, tmp_path / "r.onnx")
    with pytest.raises(CorruptFileError, match="does not match its sha256"):
        passes.load(path)


def test_cli_unpack_sha256_flag(tmp_path, small_packed, capsys):
    import json

    from tools.surgeon_compress import main

    src, packed = small_packed
    assert main(["unpack", str(packed), "-o", str(tmp_path / "a.onnx"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == "fast"
    assert main(["unpack", str(packed), "-o", str(tmp_path / "b.onnx"), "--sha256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == "sha256"
    assert (tmp_path / "b.onnx").read_bytes() == src.read_bytes() == (tmp_path / "a.onnx").read_bytes()
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(_rewrite_index(packed.read_bytes(), lambda o: o["files"][0].__setitem__("sha256", "0" * 64)))
    assert main(["unpack", str(bad), "-o", str(tmp_path / "c.onnx")]) == 0  # the fast digest is right
    capsys.readouterr()
    assert main(["unpack", str(bad), "-o", str(tmp_path / "d.onnx"), "--sha256"]) == 4
    assert "sha256" in capsys.readouterr().err
    assert main(["info", str(packed)]) == 0
    out = capsys.readouterr().out
    assert hashlib.sha256(src.read_bytes()).hexdigest() in out and "xxh3_128" in out


GOLDEN_DIGEST = sorted((GOLDEN / "v1.2-digest").glob("*.onnxz"))


@pytest.mark.skipif(not GOLDEN_DIGEST, reason="no v1.2-digest golden files")
def test_golden_digest_files_check_their_xxh3(tmp_path, monkeypatch):
    """The stored XXH3-128 of each golden 1.2 file is that of the bytes whose sha256 the manifest
    recorded before packing; a damaged restoration of them is refused by it."""
    import json

    import xxhash

    from passes.onnxz.reader import PackedFile

    manifest = json.loads((GOLDEN / "v1.2-digest" / "MANIFEST.json").read_text())
    for path in GOLDEN_DIGEST:
        want = manifest["files"][path.name]["restored_files"]
        out = tmp_path / path.stem
        out.mkdir()
        passes.unpack(path, out / manifest["files"][path.name]["model_file"], threads=1)
        with passes.open_packed(path) as pm:
            for f in pm.metadata()["files"]:
                data = (out / f["name"]).read_bytes() if f["name"] in want else (out / Path(f["name"]).name).read_bytes()
                assert hashlib.sha256(data).hexdigest() == f["sha256"] in want.values()
                assert xxhash.xxh3_128(data).hexdigest() == f["xxh3_128"]
    fill, whole = PackedFile._fill, PackedFile._whole_file_tasks

    def bad_fill(self, window, items, skel):
        tasks = fill(self, window, items, skel)
        window[-1:] ^= 1
        return tasks

    def bad_whole(self, fe, window, skel):
        tasks = whole(self, fe, window, skel)
        window[-1:] ^= 1
        return tasks

    monkeypatch.setattr(PackedFile, "_fill", bad_fill)
    monkeypatch.setattr(PackedFile, "_whole_file_tasks", bad_whole)
    with pytest.raises(CorruptFileError, match="does not match its xxh3_128"):
        passes.load(GOLDEN_DIGEST[0])


def test_pack_of_a_pack_says_what_the_file_is(tmp_path):
    """passes.pack given an .onnxz (whatever its name) says it is a pack already; the protobuf
    parser's 'Wire format was corrupt' did not say what the file is."""
    src = tmp_path / "m.onnx"
    onnx.save(_tiny_pack_model(), src)
    packed = tmp_path / "m.bin"
    passes.pack(src, packed)
    with pytest.raises(passes.InvalidArgumentError, match=r"is an \.onnxz pack already"):
        passes.pack(packed, tmp_path / "again.onnxz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.onnx"]


def _tiny_pack_model():
    w = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
