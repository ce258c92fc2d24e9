"""Helpers shared by the .onnxz unit tests."""
from __future__ import annotations

import contextlib
import os

from onnx import helper

import passes
from passes.onnxz import codecs, format as fmt


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
