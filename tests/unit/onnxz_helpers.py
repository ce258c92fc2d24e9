"""Helpers shared by the .onnxz unit tests."""
from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib

import numpy as np
import onnx
import zstandard as zstd
from onnx import TensorProto, helper

import passes
import passes.onnxz
from passes.onnxz import codecs, format as fmt, writer


@contextlib.contextmanager
def ans_decoder(level: int, loads: int):
    """The C rANS decoder pinned to one ans_simd level and AVX2 lookup kind, restored afterwards."""
    c = codecs._fast
    before = c.ans_simd(), c.ans_avx2_loads()
    c.ans_simd(level)
    c.ans_avx2_loads(loads)
    try:
        yield
    finally:
        c.ans_simd(before[0])
        c.ans_avx2_loads(before[1])


def pack_as(src, dst, *, catalog: bool):
    """passes.pack(src, dst) at 1 thread, with (True: the writer's default) or without format 1.3's
    catalog (ONNXZ_NO_CATALOG, the variable restored after); returns dst."""
    before = os.environ.pop("ONNXZ_NO_CATALOG", None)
    try:
        if not catalog:
            os.environ["ONNXZ_NO_CATALOG"] = "1"
        passes.pack(src, dst, threads=1)
    finally:
        os.environ.pop("ONNXZ_NO_CATALOG", None)
        if before is not None:
            os.environ["ONNXZ_NO_CATALOG"] = before
    return dst


def pack_and_read_index(folder, inits, catalog=False):
    """A model holding `inits` packed in `folder`: (src, dst, decoded index object, header).
    catalog=False: written with the whole tensor table in the index (as before format 1.3's
    catalog: the index these tests check); True: as the writer does by default."""
    src = folder / "m.onnx"
    src.write_bytes(helper.make_model(helper.make_graph([], "g", [], [], inits)).SerializeToString())
    dst = pack_as(src, folder / "m.onnxz", catalog=catalog)
    size = os.path.getsize(dst)
    with open(dst, "rb") as f:
        header = fmt.parse_header(f.read(fmt.HEADER_SIZE), size)
        f.seek(header.index_offset)
        obj = fmt.decode_index(f.read(header.index_length), header)
    return src, dst, obj, header


def external_ranges_model(folder, ranges, data_bytes: int, location: str = "w.bin"):
    """folder/model.onnx: initializers W0..Wn of float32 (each data_bytes / 4 values), stored in
    folder/w.bin (named by `location`) at the (offset, length) strings given, each read by an
    Identity node."""
    (folder / "w.bin").write_bytes(np.arange(data_bytes // 4, dtype=np.float32).tobytes())
    inits, nodes, outs = [], [], []
    for i, (offset, length) in enumerate(ranges):
        t = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[data_bytes // 4],
                        data_location=TensorProto.EXTERNAL)
        for k, v in (("location", location), ("offset", offset), ("length", length)):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
        nodes.append(helper.make_node("Identity", [f"W{i}"], [f"y{i}"]))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    m = helper.make_model(helper.make_graph(nodes, "g", [], outs, inits), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save_model(m, folder / "model.onnx")
    return folder / "model.onnx"


def external_ranges_packed(folder, ranges, data_bytes, monkeypatch=None, location="w.bin"):
    """external_ranges_model(...) and its pack folder/p.onnxz: (src, pack). pack keeps files byte
    for byte but refuses a range outside its file itself: with `monkeypatch`, its wire walk is told
    every range is the whole file while packing (undone after), so the pack holds what another
    writer could have written (FORMAT.md asks nothing of the ranges)."""
    src = external_ranges_model(folder, ranges, data_bytes, location)
    if monkeypatch is not None:
        real = writer.find_tensors

        def whole_files(data):
            refs = real(data)
            for r in refs:
                if r.field == "external":
                    r.offset, r.length = 0, -1
                    r.external = dict(r.external, offset="0", length="")
            return refs

        monkeypatch.setattr(writer, "find_tensors", whole_files)
    passes.onnxz.pack(src, folder / "p.onnxz")
    if monkeypatch is not None:
        monkeypatch.undo()
    return src, folder / "p.onnxz"


def rewrite_index(data: bytes, mutate, version=None) -> bytes:
    """The pack `data` with its index object changed by mutate(obj) and its header saying format
    `version` (major, minor; None: the version it says now), every checksum valid again."""
    fields = struct.unpack_from("<8sHHIQQQQI", data)
    ioff, ilen = fields[4], fields[5]
    obj = json.loads(zstd.ZstdDecompressor().decompress(data[ioff:ioff + ilen]))
    mutate(obj)
    text = json.dumps(obj).encode()
    frame = zstd.ZstdCompressor(write_checksum=True, write_content_size=True).compress(text)
    return fmt.pack_header(ioff, len(frame), len(text), ioff + len(frame), zlib.crc32(frame),
                           version or (fields[1], fields[2]), fields[3]) \
        + data[64:ioff] + frame


def first_stream(obj, codec: str):
    """The stream object of the first tensor in index `obj` coded with `codec`."""
    return next(t["stream"] for t in obj["tensors"] if t.get("stream") and t["stream"]["codec"] == codec)
