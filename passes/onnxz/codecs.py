"""The codecs of `.onnxz` (FORMAT.md section 3): tensor bytes <-> planes <-> zstd frames.

Encoding picks, per tensor, the smallest of the candidate codecs that fit its data type (byte
planes with the float sign moved out of the exponent, 4-bit exponent ranks paired per byte, the
sign/top-mantissa plane split by exponent, exact narrowing, low-entropy bytes as paired ranks, an
LZ pass where a probe says it wins); decoding fills a caller-provided buffer chunk by chunk.
zstandard does the entropy coding (Huffman literals, FSE for sequences) in compiled code that
releases the GIL, so chunks decode in parallel threads; the byte shuffles run in the small C
extension _planes.c (GIL released too) or, when it was not built, in numpy (same bytes).
The writer's own loops (byte histograms, Huffman costs, size estimates, the plane split, the rANS
coders) run in _encode.c when it was built, else in numpy: same choices, same bytes. One payload's
codec choice computes each plane, histogram, floor and probe once (_Memo), however many candidate
codecs ask for it.
"""
from __future__ import annotations

import base64
import contextlib
import functools
import heapq
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import zstandard as zstd

from ..errors import CorruptFileError, NewerFormatError
from . import ans as _ans

# ONNX TensorProto.DataType numbers used here
FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL, FLOAT16, DOUBLE, UINT32, UINT64 = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
COMPLEX64, COMPLEX128, BFLOAT16 = 14, 15, 16

# element width of the types whose bytes we treat as fixed-width numbers
FLOAT_WIDTH = {FLOAT: 4, FLOAT16: 2, BFLOAT16: 2, DOUBLE: 8, COMPLEX64: 4, COMPLEX128: 8}
INT_WIDTH = {INT16: 2, UINT16: 2, INT32: 4, UINT32: 4, INT64: 8, UINT64: 8}
WIDTHS = (2, 4, 8)
ANS_WIDTHS = (1, 2, 4, 8)
TRANSPOSE_OVER_ENTROPY = 0.9  # `transpose` (LZ) replaces an entropy coding only where 10% smaller than it
TRANSPOSE_PROBE_BYTES = 1 << 20  # payloads up to this size get their columns probed where rows failed the LZ probe
ANS_MIN_GAIN = 0.005  # an ans plane is stored coded only when that saves at least this share of it
ANS_INT, ANS_FLOAT, ANS_PAIRS = 0, 1, 2  # `ans` variants in the writer's spec tuples
ANS_PREFERENCE = 0.997  # the writer takes `ans` unless another codec is > 0.3% smaller
SAMPLE_BYTES = 1 << 19  # tensors above 2x this choose their codec on a sample of this size

CHUNK_BYTES = 1 << 20  # raw bytes per chunk written (readers accept any size up to MAX_CHUNK_BYTES)
MAX_CHUNK_BYTES = 64 << 20
SHARED_MAX_BYTES = 64 << 10  # payloads up to this size may code planes with a file-wide table (1.2)
SHARED_MIN_BYTES = 64
# True: the writer would keep a short blob, once its table is put back, shorter than its plane
# (what the C `ans_decode` takes). False since _planes has ans_decode_shared, which takes the table
# apart; without the extension numpy decodes either (same checks, ~1000x slower)
SHARED_WHOLE_BELOW_PLANE = False
SPLIT = 6  # fpairs "split": exponent classes given their own sign/mantissa plane (effort="max" only)
EFFORTS = ("default", "max")
PAIR_TABLE = 15  # fpairs: the 15 most frequent exponent bytes of a chunk get 4-bit ranks, 15 escapes
NARROW = {(FLOAT, FLOAT16), (FLOAT, BFLOAT16), (DOUBLE, FLOAT)}
_SIZE = {FLOAT: 4, FLOAT16: 2, BFLOAT16: 2, DOUBLE: 8}


@dataclass
class EncodedChunk:
    raw_length: int
    planes: List[bytes]


@dataclass
class EncodedStream:
    codec: str
    params: Dict = field(default_factory=dict)
    # a list of EncodedChunk, or a container a `chunks` factory made (encode_tensor): one that
    # takes each chunk as it is made (appends) and says its own `stored` size
    chunks: List[EncodedChunk] = field(default_factory=list)

    @property
    def stored(self) -> int:
        own = getattr(self.chunks, "stored", None)
        if own is not None:
            return own
        return sum(len(p) for c in self.chunks for p in c.planes)


def _new_chunks(chunks) -> list:
    """The chunk container of a stream about to be encoded: a list, or what the factory
    `chunks` makes (the writer's: each chunk written out as it comes, not held)."""
    return [] if chunks is None else chunks()


# ---------------------------------------------------------------- transforms
# The C version (_planes.c, built by `pip install -e .` when a compiler is there) runs at memory
# speed; the numpy one below gives the same bytes at about a third of the speed.
try:
    from . import _planes as _fast
except ImportError:  # not built: numpy does it
    _fast = None
try:  # the writer's helpers (_encode.c): histograms, Huffman costs; numpy gives the same figures
    from . import _encode as _enc
except ImportError:
    _enc = None


def byte_counts(data: np.ndarray, block: Optional[int] = None) -> np.ndarray:
    """Histograms (int64, 256 per row) of each `block`-byte slice of a uint8 array, or (block
    None) of the whole array as one row of 256. np.bincount widens every byte to an intp first
    (~0.3 GB/s); the C loop counts at ~3 GB/s."""
    n = data.size
    if block is None:
        block = max(n, 1)
    rows = max(1, -(-n // block))
    if _enc is not None:
        out = np.empty((rows, 256), np.int64)
        _enc.hist(np.ascontiguousarray(data), block, out)
        return out if block < n else out[0] if n else np.zeros(256, np.int64)
    if block >= n:
        return np.bincount(data, minlength=256).astype(np.int64)
    return np.stack([np.bincount(data[i:i + block], minlength=256) for i in range(0, n, block)]).astype(np.int64)


def split_planes(data: np.ndarray, width: int, sign_move: bool) -> np.ndarray:
    """Byte planes of little-endian elements, most significant first (FORMAT.md 3), back to back
    in one array of width rows."""
    n = data.size // width
    out = np.empty((width, n), np.uint8)
    if _enc is not None:  # one pass over the elements
        _enc.split(data, width, sign_move, out)
        return out
    x = data.reshape(-1, width)
    for i in range(width):
        out[i] = x[:, width - 1 - i]
    if sign_move:
        t, m = out[0].copy(), out[1].copy()
        out[0] = (t << 1) | (m >> 7)
        out[1] = (t & 0x80) | (m & 0x7F)
    return out


def merge_planes(planes: np.ndarray, width: int, sign_move: bool, out: np.ndarray) -> None:
    """Inverse of split_planes: `planes` (width*n bytes, plane after plane) into `out` (uint8)."""
    if _fast is not None:
        _fast.merge(planes, width, sign_move, out)
        return
    n = planes.size // width
    p = planes.reshape(width, n)
    x = out.reshape(-1, width)
    start = 0
    if sign_move:
        tp, mp = p[0], p[1]
        tmp = np.empty(n, np.uint8)
        np.bitwise_and(mp, 0x80, out=tmp)
        x[:, width - 1] = tmp
        np.right_shift(tp, 1, out=tmp)
        x[:, width - 1] |= tmp
        np.left_shift(tp, 7, out=tmp)
        x[:, width - 2] = tmp
        np.bitwise_and(mp, 0x7F, out=tmp)
        x[:, width - 2] |= tmp
        start = 2
    for i in range(start, width):
        x[:, width - 1 - i] = p[i]


def merge_plane_list(planes, sign_move: bool, out: np.ndarray) -> None:
    """merge_planes from w separate planes (each n bytes, any buffer: raw planes are read where
    they lie in the file buffer)."""
    if _fast is not None:
        _fast.merge_list(planes, sign_move, out)
        return
    w = len(planes)
    n = out.size // w
    buf = scratch("merge").get(n * w)
    for i, p in enumerate(planes):
        buf[i * n:(i + 1) * n] = np.frombuffer(p, np.uint8)
    merge_planes(buf, w, sign_move, out)


def pairs_merge(table, ranks, escapes, rest, out: np.ndarray) -> bool:
    """An `fpairs` chunk into `out`: the top byte from the ranks, planes 1..w-1 from `rest`;
    False if escapes and ranks disagree."""
    if _fast is not None:
        return _fast.pairs_merge(table, ranks, escapes, rest, out)
    w = len(rest) + 1
    n = out.size // w
    buf = scratch("merge").get(n * w)
    if not expand_ranks(np.frombuffer(table, np.uint8), np.frombuffer(ranks, np.uint8), np.frombuffer(escapes, np.uint8), buf[:n]):
        return False
    for i, p in enumerate(rest, 1):
        buf[i * n:(i + 1) * n] = np.frombuffer(p, np.uint8)
    merge_planes(buf, w, True, out)
    return True


def expand_ranks(table: np.ndarray, ranks: np.ndarray, escapes: np.ndarray, out: np.ndarray) -> bool:
    """The exponent plane of `fpairs` (FORMAT.md 3) into `out`; False if escapes and ranks disagree."""
    if _fast is not None:
        return _fast.expand(table, ranks, escapes, out)
    n = out.size
    r = np.empty(2 * ranks.size, np.uint8)
    r[0::2] = ranks >> 4
    r[1::2] = ranks & 15
    r = r[:n]
    escape = r == PAIR_TABLE
    if int(escape.sum()) != escapes.size:
        return False
    lut = np.zeros(16, np.uint8)
    lut[:PAIR_TABLE] = table
    np.take(lut, r, out=out)
    out[escape] = escapes
    return True


def unsplit_plane(ranks: np.ndarray, classes: int, sub: np.ndarray, counts, out: np.ndarray) -> bool:
    """Plane 1 of a split `fpairs` chunk from its class sub-planes; False if the sizes disagree."""
    sizes = np.asarray(counts, np.int64)
    if _fast is not None:
        return _fast.unsplit(ranks, classes, sub, sizes, out)
    n = out.size
    r = np.empty(2 * ranks.size, np.uint8)
    r[0::2] = ranks >> 4
    r[1::2] = ranks & 15
    cls = np.minimum(r[:n], classes)
    if not np.array_equal(np.bincount(cls, minlength=classes + 1), sizes):
        return False
    out[np.argsort(cls, kind="stable")] = sub
    return True


def split_plane(b: np.ndarray, ranks: np.ndarray, classes: int) -> List[np.ndarray]:
    """Inverse of unsplit_plane: the bytes of `b` grouped by min(rank, classes), in element order."""
    n = b.size
    r = np.empty(2 * ranks.size, np.uint8)
    r[0::2] = ranks >> 4
    r[1::2] = ranks & 15
    cls = np.minimum(r[:n], classes)
    counts = np.bincount(cls, minlength=classes + 1)
    grouped = b[np.argsort(cls, kind="stable")]
    return np.split(grouped, np.cumsum(counts)[:-1])


def rank_planes(t: np.ndarray):
    """(table, ranks, escapes) of an exponent plane: inverse of expand_ranks."""
    if _enc is not None:  # one pass after the histogram (~5x the numpy below)
        table, ranks, escapes = np.empty(PAIR_TABLE, np.uint8), np.empty((t.size + 1) // 2, np.uint8), np.empty(t.size, np.uint8)
        k = _enc.rank_pairs(np.ascontiguousarray(t), table, ranks, escapes)
        return table, ranks, escapes[:k].copy()
    counts = byte_counts(t)
    order = np.argsort(-counts, kind="stable")[:PAIR_TABLE]
    table = order.astype(np.uint8)
    lut = np.full(256, PAIR_TABLE, np.uint8)
    lut[order] = np.arange(PAIR_TABLE, dtype=np.uint8)
    r = lut[t]
    escapes = t[r == PAIR_TABLE]
    if r.size % 2:
        r = np.append(r, np.uint8(0))
    ranks = ((r[0::2] << 4) | r[1::2]).astype(np.uint8)
    return table, ranks, escapes


# ---------------------------------------------------------------- zstd planes

_ENTROPY_PARAMS = zstd.ZstdCompressionParameters(
    # an optimal parser with a short search: it keeps literals (Huffman-coded) unless a match
    # really pays, which on weight bytes is what wins; found by measurement on the corpus
    window_log=17, hash_log=12, chain_log=12, search_log=1, min_match=4, target_length=16,
    strategy=zstd.STRATEGY_BTOPT, write_checksum=False, write_content_size=True)
_local = threading.local()


def _compressor(kind: str) -> zstd.ZstdCompressor:
    c = getattr(_local, kind, None)
    if c is None:
        if kind == "entropy":
            c = zstd.ZstdCompressor(compression_params=_ENTROPY_PARAMS)
        elif kind == "lz":
            c = zstd.ZstdCompressor(level=19, write_checksum=False, write_content_size=True)
        elif kind == "probe3":  # _lz_promising's probe
            c = zstd.ZstdCompressor(level=3)
        elif kind == "probe1":  # its quick pre-probe
            c = zstd.ZstdCompressor(level=1)
        else:  # "fast": planes that are noise; zstd stores them as raw blocks
            c = zstd.ZstdCompressor(level=1, write_checksum=False, write_content_size=True)
        setattr(_local, kind, c)
    return c


def compress_plane(data, kind: str = "entropy", fixed: bool = False):
    """The stored form of one plane. A plane of fixed size (FORMAT.md 2) is stored raw when zstd
    does not make it smaller (noise: the mantissa bytes): the reader then uses it in place."""
    if fixed and len(data):
        if kind == "fast":  # noise: zstd would store it as raw blocks anyway
            return data
        frame = _compressor(kind).compress(data)
        return frame if len(frame) < len(data) else data
    return _compressor(kind).compress(data)


def _decompressor() -> zstd.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstd.ZstdDecompressor()
    return d


def decompress_plane(frame, expected: int, dest: np.ndarray, at_most: Optional[int] = None) -> int:
    """Decode one zstd frame of exactly `expected` bytes (or, with expected None, of the size its
    header declares, up to `at_most`) straight into dest (no intermediate copy); returns the size.
    A plane of exactly `expected` (> 0) stored bytes is raw (FORMAT.md 2): copied as it is.
    CorruptFileError when the frame is damaged, short, long or unchecked."""
    if expected and len(frame) == expected:
        dest[:expected] = np.frombuffer(frame, np.uint8)
        return expected
    try:
        fp = zstd.get_frame_parameters(frame)
    except zstd.ZstdError:
        raise CorruptFileError("damaged chunk: not a zstd frame") from None
    if expected is None:
        expected = fp.content_size
        if not 0 <= expected <= at_most:
            raise CorruptFileError(f"damaged chunk: plane declares {fp.content_size} bytes, at most {at_most} expected")
    if fp.content_size != expected:
        raise CorruptFileError(f"damaged chunk: plane declares {fp.content_size} bytes, expected {expected}")
    try:
        reader = _decompressor().stream_reader(frame)
        view = memoryview(dest)[:expected]
        got = 0
        while got < expected:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        # nothing may follow (the chunk's XXH3-64 already vouches for the stored bytes)
        if got != expected or reader.read(1):
            raise CorruptFileError("damaged chunk: plane decodes to the wrong size")
    except zstd.ZstdError as exc:
        raise CorruptFileError(f"damaged chunk: {exc}") from None
    return expected


def plane_bytes(frame, expected: Optional[int], at_most: int = 0):
    """One plane as a buffer, with the checks of decompress_plane: a raw plane is the frame itself
    (no copy); a small zstd frame is decoded in one call (cheaper per chunk than a stream reader
    for the ranks and escapes of fpairs)."""
    if expected and len(frame) == expected:
        return frame
    try:
        size = zstd.get_frame_parameters(frame).content_size
    except zstd.ZstdError:
        raise CorruptFileError("damaged chunk: not a zstd frame") from None
    if expected is None:
        if not 0 <= size <= at_most:
            raise CorruptFileError(f"damaged chunk: plane declares {size} bytes, at most {at_most} expected")
        expected = size
    if size != expected:
        raise CorruptFileError(f"damaged chunk: plane declares {size} bytes, expected {expected}")
    if not expected:
        return b""
    try:
        data = _decompressor().decompress(frame, max_output_size=expected, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise CorruptFileError(f"damaged chunk: {exc}") from None
    if len(data) != expected:
        raise CorruptFileError("damaged chunk: plane decodes to the wrong size")
    return data


# ---------------------------------------------------------------- plane layout per codec

def plane_sizes(codec: str, params: dict, raw_length: int) -> List[int]:
    """Sizes of the planes (before zstd) of one chunk; CorruptFileError if they cannot fit."""
    if codec == "bytes":
        return [raw_length]
    if codec in ("ans", "ans_shared"):
        w = params["width"]
        if raw_length % w or not raw_length:
            raise CorruptFileError(f"damaged index: ans chunk of {raw_length} bytes for width {w}")
        n = raw_length // w
        if params.get("pairs"):  # table, ranks, escapes (as many as the ranks say), planes 1..w-1
            return [PAIR_TABLE, (n + 1) // 2, None] + [n] * (w - 1)
        return [n] * w
    if codec in ("planes", "fplanes"):
        w = params["width"]
        if raw_length % w:
            raise CorruptFileError(f"damaged index: chunk of {raw_length} bytes is not a multiple of width {w}")
        return [raw_length // w] * w
    if codec == "bpairs":
        return [PAIR_TABLE, (raw_length + 1) // 2, None]
    if codec == "fpairs":
        w = params["width"]
        if raw_length % w:
            raise CorruptFileError(f"damaged index: chunk of {raw_length} bytes is not a multiple of width {w}")
        n = raw_length // w
        split = params.get("split", 0)
        if split:  # plane 1 as split+1 sub-planes, sized by the ranks
            return [PAIR_TABLE, (n + 1) // 2, None] + [None] * (split + 1) + [n] * (w - 2)
        return [PAIR_TABLE, (n + 1) // 2, None] + [n] * (w - 1)  # None: as many as the ranks say
    if codec == "transpose":  # 1.3: one plane, the r x cols matrix of width-byte elements column by column
        step = params["width"] * params["cols"]
        if raw_length % step or not raw_length:
            raise CorruptFileError(f"damaged index: transpose chunk of {raw_length} bytes is not whole rows of {step}")
        return [raw_length]
    if codec == "narrow":
        inner, frm, to = params["inner"], params["from"], params["to"]
        if raw_length % _SIZE[frm]:
            raise CorruptFileError("damaged index: narrow chunk length is not a multiple of its element size")
        return plane_sizes(inner["codec"], inner.get("params", {}), raw_length // _SIZE[frm] * _SIZE[to])
    raise NewerFormatError(f"codec {codec!r} is unknown to this reader (written by a newer version)")


def check_params(codec: str, params) -> None:
    """Validate codec parameters read from an untrusted index."""
    if not isinstance(params, dict):
        raise CorruptFileError("damaged index: codec params are not an object")
    if codec in ("bytes", "bpairs"):
        return
    if codec == "ans":
        if type(params.get("width")) is not int or params.get("width") not in ANS_WIDTHS:
            raise CorruptFileError(f"damaged index: bad ans width {params.get('width')!r}")
        if type(params.get("sign")) is not bool or (params["sign"] and params["width"] == 1):
            raise CorruptFileError(f"damaged index: bad ans sign {params.get('sign')!r}")
        pairs = params.get("pairs", False)
        if type(pairs) is not bool or (pairs and (not params["sign"] or params["width"] not in (2, 4))):
            raise CorruptFileError(f"damaged index: bad ans pairs {pairs!r}")
        return
    if codec == "ans_shared":
        w = params.get("width")
        if type(w) is not int or w not in ANS_WIDTHS:
            raise CorruptFileError(f"damaged index: bad ans_shared width {w!r}")
        if type(params.get("sign")) is not bool or (params["sign"] and w == 1) or params.get("pairs", False) is not False:
            raise CorruptFileError("damaged index: bad ans_shared sign / pairs")
        tables = params.get("tables")
        # a loop, not any() over a generator: this runs once per small tensor when a file is opened
        if type(tables) is not list or len(tables) != w:
            raise CorruptFileError(f"damaged index: bad ans_shared tables {tables!r}")
        top = -1
        for t in tables:
            if type(t) is not int or t < -1:
                raise CorruptFileError(f"damaged index: bad ans_shared tables {tables!r}")
            if t > top:
                top = t
        if top < 0:
            raise CorruptFileError(f"damaged index: bad ans_shared tables {tables!r}")
        return
    if codec in ("planes", "fplanes", "fpairs"):
        if type(params.get("width")) is not int or params.get("width") not in WIDTHS:
            raise CorruptFileError(f"damaged index: bad width {params.get('width')!r}")
        if codec == "fpairs" and params.get("width") == 8:
            raise CorruptFileError("damaged index: fpairs of width 8")
        split = params.get("split", 0)
        if codec == "fpairs" and (type(split) is not int or not 0 <= split <= 14):
            raise CorruptFileError(f"damaged index: bad split {split!r}")
        return
    if codec == "transpose":
        w, cols = params.get("width"), params.get("cols")
        if type(w) is not int or w not in (1, 2, 4, 8) or type(cols) is not int or not 2 <= cols <= MAX_CHUNK_BYTES:
            raise CorruptFileError(f"damaged index: bad transpose parameters {params!r}")
        return
    if codec == "narrow":
        inner = params.get("inner")
        if type(params.get("from")) is not int or type(params.get("to")) is not int \
                or (params.get("from"), params.get("to")) not in NARROW or not isinstance(inner, dict):
            raise CorruptFileError("damaged index: bad narrow parameters")
        if inner.get("codec") in ("narrow", "ans_shared", "transpose"):
            raise CorruptFileError(f"damaged index: {inner.get('codec')} inside narrow")
        check_params(inner.get("codec"), inner.get("params", {}))
        return
    raise NewerFormatError(f"codec {codec!r} is unknown to this reader (written by a newer version)")


# ---------------------------------------------------------------- decode

class Scratch:
    """Per-thread reusable buffers: fresh allocations are page-fault bound."""

    def __init__(self):
        self.buf = np.empty(0, np.uint8)

    def get(self, n: int) -> np.ndarray:
        if self.buf.size < n:
            self.buf = np.empty(max(n, 1 << 20), np.uint8)
        return self.buf[:n]


def scratch(name: str = "planes") -> Scratch:
    s = getattr(_local, "scratch_" + name, None)
    if s is None:
        s = Scratch()
        setattr(_local, "scratch_" + name, s)
    return s


def decode_chunk(codec: str, params: dict, frames: List[memoryview], raw_length: int, out: np.ndarray) -> None:
    """Decode one chunk's planes (zstd frames) into `out` (uint8, raw_length bytes)."""
    sizes = plane_sizes(codec, params, raw_length)
    if len(frames) != len(sizes):
        raise CorruptFileError(f"damaged index: {codec} chunk has {len(frames)} planes, expected {len(sizes)}")
    if codec == "bytes":
        decompress_plane(frames[0], raw_length, out)
        return
    if codec == "transpose":
        w, cols = params["width"], params["cols"]
        buf = scratch("transpose").get(raw_length)
        decompress_plane(frames[0], raw_length, buf)
        untranspose(buf, w, cols, out)
        return
    if codec == "ans":
        err = ans_decode(frames, params["sign"], out, params.get("pairs", False))
        if err:
            raise CorruptFileError(f"damaged chunk: {err}")
        return
    if codec == "ans_shared":
        # a blob of a plane with a shared table is made whole (its table put back after byte 0)
        # and decoded as an `ans` chunk: the same checks, the same decoders
        n = sizes[0]
        tables = params.get("table_data")
        if tables is None:
            raise CorruptFileError("damaged index: ans_shared stream without its tables")
        if _fast is not None and hasattr(_fast, "ans_decode_shared"):
            err = _fast.ans_decode_shared(frames, [None if t is None else _table_bytes(t) for t in tables],
                                          params["sign"], out)
            if err:
                raise CorruptFileError(f"damaged chunk: {err}")
            return
        whole, err = [], None
        buf = scratch("shared").get(n * len(frames))
        for i, (f, t) in enumerate(zip(frames, tables)):
            if t is None or len(f) == n:
                whole.append(f)
                continue
            if len(f) > n:
                err = "ans plane larger than its raw size"
                break
            blob = _ans.with_table(f, _table_bytes(t))
            if len(blob) < n:  # as an `ans` plane
                whole.append(blob)
                continue
            # (no C extension) the table made it as large as the plane: ans_decode would take it
            # for a raw plane or refuse it, so it is decoded here and passed on as raw
            try:
                _decode_plane(blob, n, buf[i * n:(i + 1) * n])
            except _ans.Damaged as exc:
                err = str(exc)
                break
            whole.append(buf[i * n:(i + 1) * n])
        err = err or ans_decode(whole, params["sign"], out, False)
        if err:
            raise CorruptFileError(f"damaged chunk: {err}")
        return
    if codec in ("planes", "fplanes"):
        w = params["width"]
        n = sizes[0]
        buf = scratch().get(n * w)
        merge_plane_list(_fixed_planes(frames, n, buf, 0), codec == "fplanes", out)
        return
    if codec == "bpairs":
        n = raw_length
        buf = scratch().get(2 * n + 16)
        table, ranks, escapes = buf[:PAIR_TABLE], buf[16:16 + sizes[1]], buf[16 + sizes[1]:]
        decompress_plane(frames[0], PAIR_TABLE, table)
        decompress_plane(frames[1], sizes[1], ranks)
        ne = decompress_plane(frames[2], None, escapes, at_most=n)
        if not expand_ranks(table, ranks, escapes[:ne], out):
            raise CorruptFileError("damaged chunk: escapes do not match their ranks")
        return
    if codec == "fpairs":
        w = params["width"]
        n = raw_length // w
        buf = scratch().get(n * w + 2 * n + 16)
        planes, table = buf[:n * w], buf[n * w:n * w + PAIR_TABLE]
        ranks = buf[n * w + 16:n * w + 16 + sizes[1]]
        escapes = buf[n * w + 16 + sizes[1]:]
        split = params.get("split", 0)
        rest = frames[3:]
        if not split:  # one pass: top byte from the ranks, the other planes where they lie
            ok = pairs_merge(plane_bytes(frames[0], PAIR_TABLE), plane_bytes(frames[1], sizes[1]),
                             plane_bytes(frames[2], None, n), _fixed_planes(rest, n, planes, 1), out)
            if not ok:
                raise CorruptFileError("damaged chunk: exponent escapes do not match their ranks")
            return
        decompress_plane(frames[0], PAIR_TABLE, table)
        decompress_plane(frames[1], sizes[1], ranks)
        ne = decompress_plane(frames[2], None, escapes, at_most=n)
        if not expand_ranks(table, ranks, escapes[:ne], planes[:n]):
            raise CorruptFileError("damaged chunk: exponent escapes do not match their ranks")
        sub = escapes  # free again: the escapes are expanded
        counts, pos = [], 0
        for frame in rest[:split + 1]:
            got = decompress_plane(frame, None, sub[pos:], at_most=n - pos)
            counts.append(got)
            pos += got
        if pos != n or not unsplit_plane(ranks, split, sub[:n], counts, planes[n:2 * n]):
            raise CorruptFileError("damaged chunk: split plane sizes do not match the ranks")
        for i, frame in zip(range(2, w), rest[split + 1:]):
            decompress_plane(frame, n, planes[i * n:(i + 1) * n])
        merge_planes(planes, w, True, out)
        return
    if codec == "narrow":
        inner = params["inner"]
        frm, to = params["from"], params["to"]
        narrow_len = raw_length // _SIZE[frm] * _SIZE[to]
        tmp = scratch("narrow").get(narrow_len)
        decode_chunk(inner["codec"], inner.get("params", {}), frames, narrow_len, tmp)
        widen(tmp, frm, to, out)
        return
    raise NewerFormatError(f"codec {codec!r} is unknown to this reader (written by a newer version)")


def _decode_plane(blob: bytes, n: int, dst: np.ndarray) -> None:
    """One whole ans blob of n symbols into dst whatever its length (Damaged when it cannot be
    right): numpy, for blobs the C `ans` entry cannot take (see decode_chunk)."""
    _ans.decode_numpy(blob, n, dst)


@functools.lru_cache(maxsize=4096)
def _table_bytes(text: str) -> bytes:
    """A shared table as the index holds it (base64, checked by format.parse_index) -> bytes."""
    return base64.b64decode(text)


def ans_decode(frames, sign: bool, out: np.ndarray, pairs: bool = False) -> Optional[str]:
    """An `ans` chunk (FORMAT.md 3.1) into out: all its planes in one C call (GIL released), or
    the numpy mirror when the extension was not built. None, or what is damaged."""
    if _fast is not None:
        return _fast.ans_decode(frames, sign, pairs, out)
    w = len(frames) - 2 if pairs else len(frames)
    n = out.size // w
    buf = scratch("ans").get(n * w + (n + 1) // 2)
    if pairs:
        table, ranks, escapes = frames[:3]
        nr = (n + 1) // 2
        if len(table) != PAIR_TABLE:
            return "exponent table of the wrong size"
        if len(escapes) > n:
            return "more exponent escapes than elements"
        if len(ranks) > nr:
            return "ans ranks plane larger than its raw size"
        if len(ranks) != nr:
            try:
                _ans.decode_numpy(ranks, nr, buf[n * w:])
            except _ans.Damaged as exc:
                return str(exc)
            ranks = buf[n * w:]
        rest = []
        for i, frame in enumerate(frames[3:]):
            err = _ans_plane(frame, n, buf[i * n:(i + 1) * n], rest)
            if err:
                return err
        if len(out) and not pairs_merge(table, ranks, escapes, rest, out):
            return "exponent escapes do not match their ranks"
        return None
    planes = []
    for i, frame in enumerate(frames):
        err = _ans_plane(frame, n, buf[i * n:(i + 1) * n], planes)
        if err:
            return err
    if w == 1:
        out[:] = np.frombuffer(planes[0], np.uint8)
    else:
        merge_plane_list(planes, sign, out)
    return None


def _ans_plane(frame, n: int, dst: np.ndarray, planes: list) -> Optional[str]:
    """numpy path: one plane of n bytes, raw (used in place) or an ans blob (decoded into dst),
    appended to planes; None or what is damaged."""
    if len(frame) == n:  # raw (FORMAT.md 2)
        planes.append(frame)
        return None
    if len(frame) > n:
        return "ans plane larger than its raw size"
    try:
        _ans.decode_numpy(frame, n, dst)
    except _ans.Damaged as exc:
        return str(exc)
    planes.append(dst)
    return None


def _fixed_planes(frames, n: int, buf: np.ndarray, first: int) -> list:
    """Planes of n bytes each: a raw plane is used where it lies (no copy), a zstd frame is decoded
    into slot `first + i` of `buf`."""
    out = []
    for i, frame in enumerate(frames, first):
        if n and len(frame) == n:
            out.append(frame)
        else:
            dst = buf[i * n:(i + 1) * n]
            decompress_plane(frame, n, dst)
            out.append(dst)
    return out


def widen(narrow: np.ndarray, frm: int, to: int, out: np.ndarray) -> None:
    if (frm, to) == (FLOAT, FLOAT16):
        out.view(np.float32)[:] = narrow.view(np.float16)
    elif (frm, to) == (FLOAT, BFLOAT16):
        o = out.view(np.uint32)
        o[:] = narrow.view(np.uint16)
        o <<= 16
    elif (frm, to) == (DOUBLE, FLOAT):
        out.view(np.float64)[:] = narrow.view(np.float32)
    else:
        raise CorruptFileError("damaged index: bad narrow parameters")


# ---------------------------------------------------------------- encode

NARROW_BLOCK = 1 << 20  # elements per step of the narrowing checks: no whole-payload temporaries


def _f16_exact(u: np.ndarray):
    """float16 values of the float32 bits u when every one survives the round trip, else None.
    Checked and converted NARROW_BLOCK values at a time into the one float16 result (the
    whole-array conversion held a float32 round trip and a comparison mask of the payload too:
    ~2x a float32 table beside it)."""
    h = np.empty(u.size, np.float16)
    for start in range(0, u.size, NARROW_BLOCK):
        block = u[start:start + NARROW_BLOCK]
        with np.errstate(over="ignore"):  # values beyond float16 fail the round trip below
            hb = block.view(np.float32).astype(np.float16)
        if not np.array_equal(hb.astype(np.float32).view(np.uint32), block):
            return None
        h[start:start + hb.size] = hb
    return h


def _low_half_zero(u: np.ndarray) -> bool:
    """Whether every uint32 of u has its low 16 bits zero (block by block)."""
    return not any(np.any(u[s:s + NARROW_BLOCK] & 0xFFFF) for s in range(0, u.size, NARROW_BLOCK))


def _bfloat16_of(u: np.ndarray) -> np.ndarray:
    """The top halves of the uint32 u, as uint16 (block by block)."""
    out = np.empty(u.size, np.uint16)
    for s in range(0, u.size, NARROW_BLOCK):
        out[s:s + NARROW_BLOCK] = u[s:s + NARROW_BLOCK] >> 16
    return out


def _float32_exact(u: np.ndarray):
    """float32 values of the float64 bits u when every one survives the round trip, else None
    (block by block)."""
    f = np.empty(u.size, np.float32)
    for s in range(0, u.size, NARROW_BLOCK):
        block = u[s:s + NARROW_BLOCK]
        fb = block.view(np.float64).astype(np.float32)
        if not np.array_equal(fb.astype(np.float64).view(np.uint64), block):
            return None
        f[s:s + fb.size] = fb
    return f


def _narrowed(data: np.ndarray, dtype: int):
    """(to-type, narrow bytes) when every value survives the round trip bit for bit, else None.
    The first 1024 values, then 1024 spread over the tensor, are tried first: almost every tensor
    that does not narrow fails there (the full conversion cost ~5% of pack time; a word embedding
    whose first rows are zeros passed the first test and cost 73 ms of minilm_fp32's 540).
    The full checks run NARROW_BLOCK values at a time: the narrow copy is the one whole-payload
    array they make."""
    if dtype == FLOAT and data.size % 4 == 0 and data.size:
        u = data.view(np.uint32)
        if np.any(u[:1024] & 0x1FFF):
            # a float32 holding a float16 (or bfloat16) value has its 13 low mantissa bits zero
            # (float16 subnormals, infinities and NaN payloads too): neither test can pass
            return None
        spread = u[::max(1, u.size // 1024)]
        if not np.any(u[:1024] & 0xFFFF) and not np.any(spread & 0xFFFF) and _low_half_zero(u):
            return BFLOAT16, _bfloat16_of(u).view(np.uint8)
        if _f16_exact(u[:1024]) is not None and _f16_exact(spread) is not None:
            h = _f16_exact(u)
            if h is not None:
                return FLOAT16, h.view(np.uint8)
    if dtype == DOUBLE and data.size % 8 == 0 and data.size:
        u = data.view(np.uint64)
        for part in (u[:1024], u[::max(1, u.size // 1024)], u):
            f = _float32_exact(part)
            if f is None:
                return None
        return FLOAT, f.view(np.uint8)
    return None


RAW_SURE_MIN = 4096  # from this size a plane's histogram may spare its trial encode (below: cheap anyway)


def _ans_blob_or_raw(p: np.ndarray, counts: Optional[np.ndarray] = None):
    """The plane as an ans blob, or itself (raw) when the blob would not save ANS_MIN_GAIN of it.
    Noise planes (float mantissas, ~3/4 of float bytes) are known raw from their histogram
    without encoding them: the blob is at most the estimate (order-0 cost under the normalised
    table + table + 4 bytes a lane) and never more than 2 bytes a lane below it (measured over
    2149 corpus planes: -2.01..0 bytes a lane), so an estimate 3 bytes a lane (+8) above the
    limit is raw for sure; closer ones are encoded as before (same bytes either way)."""
    limit = p.size * (1 - ANS_MIN_GAIN)
    if p.size >= RAW_SURE_MIN:
        if counts is None:
            counts = byte_counts(p)
        if np.count_nonzero(counts) >= 2:
            lanes = 1 << _ans.lanes_log2_for(p.size)
            freq = _ans.normalise(counts)
            estimate = _ans.coded_bits(counts, freq) / 8 + _ans.table_size(freq) + 1 + 4 * lanes
            if estimate - 3 * lanes - 8 >= limit:
                return p
    if counts is not None and _enc is not None:  # the coder need not count the plane again
        blob = _enc.ans_encode(p, _ans.lanes_log2_for(p.size), np.ascontiguousarray(counts, np.int64))
    else:
        blob = _ans.encode(p)
    return blob if len(blob) < limit else p


def _ans_planes(part: np.ndarray, width: int, sign: bool, pairs: bool = False, planes=None, counts=None) -> list:
    """The stored planes of one `ans` chunk: each an ans blob, or raw when coding saves less than
    ANS_MIN_GAIN of the plane (a float32 sign/mantissa plane saves ~0.4% for ~35% more decode
    time: one coded plane costs about as much as merging four raw ones). `planes`, `counts`: the
    chunk's split planes and their histograms (None per plane) when already known."""
    if planes is None:
        planes = [part] if width == 1 else list(split_planes(part, width, sign))
    if counts is None:
        counts = [None] * len(planes)
    if pairs:
        table, ranks, escapes = rank_planes(planes[0])
        return [table, _ans_blob_or_raw(ranks), escapes] + [_ans_blob_or_raw(p, c) for p, c in zip(planes[1:], counts[1:])]
    return [_ans_blob_or_raw(p, c) for p, c in zip(planes, counts)]


def _encode_planes(data: np.ndarray, codec: str, width: int, chunk_bytes: int, split: int = 0,
                   memo: Optional["_Memo"] = None, keep: bool = False, chunks=None) -> EncodedStream:
    """One codec over all chunks of data. `split`: the fpairs split, or for `ans` ANS_INT (no sign
    move), ANS_FLOAT (sign move) or ANS_PAIRS (sign move, exponents as pairs of 4-bit ranks).
    `memo`: planes and histograms the codec choice already computed for this data; keep=True:
    `ans` leaves its planes and histograms there for the specs tried after it (the zstd floors
    and trial encodes split and count the same planes). `chunks`: see encode_tensor."""
    step = max(width, chunk_bytes // width * width)
    if codec == "ans":
        stream = EncodedStream(codec, {"width": width, "sign": split != ANS_INT}, _new_chunks(chunks))
        if split == ANS_PAIRS:
            stream.params["pairs"] = True
        memo = memo or _Memo()
        base_codec_ = "bytes" if width == 1 else "planes" if split == ANS_INT else "fplanes"
        for start in range(0, data.size, step):
            part = data[start:start + step]
            items = _plane_items(data, base_codec_, width, start, step, memo, store=keep)
            planes = [p for _, p in items]
            # the per-block histograms the floors use, summed (the raw shortcut needs the
            # counts of planes from RAW_SURE_MIN bytes; smaller ones are coded without them)
            counts = [memo.get(k + ("hist",), lambda p=p: _block_counts(p), keep).sum(axis=0)
                      if p.size >= RAW_SURE_MIN or k + ("hist",) in memo.d else None for k, p in items]
            stream.chunks.append(EncodedChunk(part.size, _ans_planes(part, width, split != ANS_INT, split == ANS_PAIRS,
                                                                     planes, counts)))
        if chunks is None and len(stream.chunks) == 1 and split != ANS_PAIRS:  # encode_tensor's shared-table try reuses them
            memo.d[(id(data), "ans planes", width, split != ANS_INT)] = stream.chunks[0].planes
        return stream
    stream = EncodedStream(codec, {"width": width} if codec not in ("bytes", "bpairs") else {}, _new_chunks(chunks))
    if split:
        stream.params["split"] = split
    memo = memo or _Memo()
    for start in range(0, data.size, step):
        part = data[start:start + step]
        # the planes (and histograms) the floors and probes of this choice already made, where
        # they did: same planes, same bytes (a final encode of a large payload keeps none)
        base = (id(data), start, step)
        counts = {}
        if codec == "bytes":
            planes = [part]
            counts[0] = memo.d.get(base + ("raw", "hist"))
        elif codec == "bpairs":
            planes = list(memo.get(base + ("branks",), lambda: rank_planes(part), False))
            counts[1] = memo.d.get(base + ("branks", "hist"))
        elif codec == "fpairs":
            rest = memo.get(base + ("split", width, True), lambda: split_planes(part, width, True), False)
            table, ranks, escapes = memo.get(base + ("ranks", width), lambda: rank_planes(rest[0]), False)
            if split:
                planes = [table, ranks, escapes] + split_plane(rest[1], ranks, split) + list(rest[2:])
            else:
                planes = [table, ranks, escapes] + list(rest[1:])
                counts = {2 + i: memo.d.get(base + ("plane", width, True, i, "hist")) for i in range(1, width)}
            counts[1] = memo.d.get(base + ("ranks", width, "hist"))
        else:
            sign = codec == "fplanes"
            planes = list(memo.get(base + ("split", width, sign), lambda: split_planes(part, width, sign), False))
            counts = {i: memo.d.get(base + ("plane", width, sign, i, "hist")) for i in range(width)}
        sizes = plane_sizes(codec, stream.params, part.size)  # None: a plane sized by the ranks
        stored = [compress_plane(p, _plane_kind(p, counts.get(i)), size is not None) if i or codec not in ("fpairs", "bpairs")
                  else p  # the rank table: 15 distinct bytes, no match, no Huffman gain: a frame is never smaller
                  for i, (p, size) in enumerate(zip(planes, sizes))]
        stream.chunks.append(EncodedChunk(part.size, stored))
    return stream


def _low_entropy(data: np.ndarray) -> bool:
    if data.size < 4096:
        return False
    sample = data[:: max(1, data.size // (1 << 18))]
    counts = np.sort(byte_counts(sample))[::-1]
    return counts[:PAIR_TABLE].sum() >= 0.9 * sample.size


def _plane_kind(plane: np.ndarray, block_counts: Optional[np.ndarray] = None) -> str:
    """'fast' for planes that are noise (order-0 entropy above 7.97 bits/byte: Huffman cannot gain
    enough to pay for its table, and zstd stores them as raw blocks quickly), else 'entropy'.
    `block_counts`: the plane's _block_counts when known."""
    if plane.size < 4096:
        return "entropy"
    counts = byte_counts(plane) if block_counts is None else block_counts.sum(axis=0)
    p = counts[counts > 0] / plane.size
    return "fast" if -(p * np.log2(p)).sum() > 7.97 else "entropy"


def _encode_lz(data: np.ndarray, chunk_bytes: int, chunks=None) -> EncodedStream:
    stream = EncodedStream("bytes", {}, _new_chunks(chunks))
    for start in range(0, data.size, chunk_bytes):
        part = data[start:start + chunk_bytes]
        stream.chunks.append(EncodedChunk(part.size, [compress_plane(part, "lz", True)]))
    return stream


def base_codec(dtype: int, field: str, length: int):
    """(codec, width) that suits a payload of this type and field."""
    if field in ("int32_data", "int64_data", "uint64_data"):  # varints
        return "bytes", 1
    if field == "float_data":
        dtype = FLOAT
    elif field == "double_data":
        dtype = DOUBLE
    w = FLOAT_WIDTH.get(dtype)
    if w and length % w == 0:
        return "fplanes", w
    w = INT_WIDTH.get(dtype)
    if w and length % w == 0:
        return "planes", w
    return "bytes", 1


def _sample(data: np.ndarray, width: int, chunk_bytes: int) -> np.ndarray:
    """Four half-chunk slices spread over a large payload (element-aligned), to choose a codec by."""
    step = (data.size // 4) // width * width
    size = chunk_bytes // 2 // width * width
    return np.concatenate([data[i * step:i * step + size] for i in range(4)])


def _rank(stream: EncodedStream) -> float:
    """What _best minimises: the stored size, with `ans` (1.5-3x faster to decode than the zstd
    codecs) preferred unless another codec is more than 1 - ANS_PREFERENCE smaller."""
    return stream.stored * (ANS_PREFERENCE if stream.codec in ("ans", "ans_shared") else 1.0)


_write_ans = True
_write_transpose = True  # the `transpose` try (1.3); False: files a 1.2 reader can read (tests)


@contextlib.contextmanager
def without_ans():
    """While active, the writer chooses among the codecs of format 1.0 only (no `ans`): a test
    tool, so that fuzz samples and golden files keep exercising the 1.0 decoders, which readers
    must keep forever. Not thread-safe against other packs running meanwhile."""
    global _write_ans
    saved, _write_ans = _write_ans, False
    try:
        yield
    finally:
        _write_ans = saved


ZSTD_BLOCK = 128 << 10  # zstd's largest block: each may carry its own Huffman table


def _huffman_bits(counts: np.ndarray) -> int:
    """Bits of an optimal Huffman code for these symbol counts (the sum of the merged weights)."""
    heap = [int(c) for c in counts if c]
    if len(heap) < 2:
        return 0
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        total += merged
        heapq.heappush(heap, merged)
    return total


def _huffman_bits_rows(counts: np.ndarray) -> List[int]:
    """_huffman_bits of each row of (k, 256) int64 counts (in C: heapq cost ~0.6 ms a row)."""
    if _enc is not None:
        out = np.empty(counts.shape[0], np.int64)
        _enc.huffman_bits(np.ascontiguousarray(counts, np.int64), out)
        return out.tolist()
    return [_huffman_bits(c) for c in counts]


class _Memo:
    """What the codec choice of one payload computes more than once, computed once: the byte
    planes of each chunk (the zstd floors of fplanes and fpairs, and the ans estimate, split the
    same planes), each plane's per-block histograms (the entropy floor, then the Huffman floor),
    its floors and its repetition probe. Keys name the array by id(): one _Memo lives for one
    _best() call, while the arrays it saw are alive."""

    def __init__(self):
        self.d: Dict[tuple, object] = {}

    def get(self, key, make, store: bool = True):
        v = self.d.get(key)
        if v is None:
            v = make()
            if store:
                self.d[key] = v
        return v


def _plane_items(data: np.ndarray, codec: str, width: int, start: int, step: int, memo: _Memo, store: bool = True):
    """[(plane key, plane)] of the chunk at `start` as the zstd spec `codec` (no split) stores
    its fixed-size planes (fpairs: the ranks, then planes 1..w-1); keys equal for equal planes.
    store=False: planes not already in the memo are not kept there (a final encode of a large
    payload: the memo would hold a copy of all of it)."""
    part = data[start:start + step]
    base = (id(data), start, step)
    if codec == "bytes":
        return [(base + ("raw",), part)]
    if codec == "bpairs":
        return [(base + ("branks",), memo.get(base + ("branks",), lambda: rank_planes(part))[1])]
    sign = codec != "planes"
    planes = memo.get(base + ("split", width, sign), lambda: split_planes(part, width, sign), store)
    items = [(base + ("plane", width, sign, i), p) for i, p in enumerate(planes)]
    if codec == "fpairs":  # the memo keeps (table, ranks, escapes): the encode stores all three
        items[0] = (base + ("ranks", width), memo.get(base + ("ranks", width), lambda: rank_planes(planes[0]), store)[1])
    return items


def _block_counts(plane: np.ndarray) -> np.ndarray:
    """Histograms of the plane's 128 KiB blocks, (k, 256) (one row of zeros for an empty plane)."""
    if plane.size <= ZSTD_BLOCK:
        return byte_counts(plane)[None, :]
    return byte_counts(plane, ZSTD_BLOCK)


def _block_entropy(plane: np.ndarray, huffman: bool, counts: Optional[np.ndarray] = None) -> float:
    """A floor under zstd's stored size of one plane coded without matches, from each 128 KiB
    block's histogram: its order-0 entropy, or (huffman=True, tighter) its optimal Huffman code
    (zstd's literals are Huffman-coded per block, with a new or the previous table: neither beats
    the block's optimal code); table bytes not counted; at most the plane's size (zstd stores it
    raw when nothing is gained). `counts`: the plane's _block_counts when known."""
    n = plane.size
    if counts is None:
        counts = _block_counts(plane)
    bits = 0.0
    if huffman:
        for b in _huffman_bits_rows(counts):
            bits += b
    else:
        for c in counts:
            c = c[c > 0]
            m = int(c.sum())
            if m:
                bits += float(m * np.log2(m) - (c * np.log2(c)).sum())
    return min(float(n), bits / 8)


def _zstd_floor(data: np.ndarray, codec: str, width: int, split: int, chunk_bytes: int,
                huffman: bool = False, memo: Optional[_Memo] = None, probe: bool = True) -> Optional[float]:
    """A floor under the stored size of a zstd-coded spec, from histograms: a few ms where a
    trial encode with zstd's optimal parser costs ~30 MB/s. None: no floor known (the fpairs
    "split" layout, or a plane where matches pay, which a histogram cannot see): encode it.
    probe=False: the sum of the plane floors without asking whether matches pay."""
    if codec == "fpairs" and split:
        return None
    memo = memo or _Memo()
    step = max(width, chunk_bytes // width * width)
    total = 0.0
    for start in range(0, data.size, step):
        for key, p in _plane_items(data, codec, width, start, step, memo):
            counts = memo.get(key + ("hist",), lambda: _block_counts(p))
            floor = memo.get(key + ("floor", huffman), lambda: _block_entropy(p, huffman, counts))
            if probe and floor < 0.99 * p.size and _matches_pay(p, floor, memo, key):
                return None
            total += floor
    return total


def _matches_pay(plane: np.ndarray, floor: float, memo: Optional[_Memo] = None, key=None) -> bool:
    """A repetition probe (zstd level 1, ~250 MB/s): do matches take this plane below its
    Huffman floor? Then the floor says nothing (piper_joe's conv exponents: fplanes 2% below the
    floor of their ans size). The probe's size is kept in `memo` under `key`."""
    if memo is None:
        return len(_compressor("fast").compress(plane)) < floor
    return memo.get(key + ("probe",), lambda: len(_compressor("fast").compress(plane))) < floor


FLOOR_MIN_BYTES = 32 << 10  # below this a trial encode costs less than the floors


def _hopeless(data: np.ndarray, spec, chunk_bytes: int, to_beat: float, memo: Optional[_Memo] = None) -> bool:
    """True when the zstd spec cannot come out below `to_beat` (matches aside): its entropy
    floor, then its Huffman floor, already reach it."""
    if data.size < FLOOR_MIN_BYTES:
        return False
    memo = memo or _Memo()
    # the floors first; the repetition probes (zstd level 1 of each plane, most of this test's
    # time) only where a floor reaches to_beat: below it the spec is tried whatever they say.
    # The same answer as probing within each floor: True iff the entropy floor reaches to_beat
    # with no plane's matches below its entropy floor, or the Huffman floor reaches it with no
    # plane's matches below either floor
    entropy = _zstd_floor(data, *spec, chunk_bytes, huffman=False, memo=memo, probe=False)
    if entropy is None:
        return False
    if entropy >= to_beat:
        return _zstd_floor(data, *spec, chunk_bytes, huffman=False, memo=memo) is not None
    if _zstd_floor(data, *spec, chunk_bytes, huffman=True, memo=memo, probe=False) < to_beat:
        return False
    return (_zstd_floor(data, *spec, chunk_bytes, huffman=False, memo=memo) is not None
            and _zstd_floor(data, *spec, chunk_bytes, huffman=True, memo=memo) is not None)


def _choose(data: np.ndarray, specs, chunk_bytes: int, memo: Optional[_Memo] = None, chunks=None):
    """The smallest encoding among `specs` (see _rank; the first of equals). `ans` specs are
    encoded (fast, and their size is what the zstd specs must beat); a zstd spec is trial-encoded
    only when its floor (_zstd_floor) leaves it a chance: on float planes it almost never does,
    and those trials were ~2/3 of pack time."""
    best = won = None
    memo = memo or _Memo()
    for spec in specs:
        c, w, sp = spec
        if best is not None and c != "ans" and _hopeless(data, spec, chunk_bytes, _rank(best), memo):
            continue
        enc = _encode_planes(data, c, w, chunk_bytes, sp, memo, keep=len(specs) > 1, chunks=chunks)
        if best is None or _rank(enc) < _rank(best):
            best, won = enc, spec
    return best, won


def _best(data: np.ndarray, specs, chunk_bytes: int, memo: Optional[_Memo] = None, chunks=None) -> EncodedStream:
    """The smallest encoding among `specs` ((codec, width, split) tuples; see _rank). A large
    payload is encoded in full only with the spec that wins on a sample of it (pack time / 2.5)."""
    if not _write_ans:
        specs = [sp for sp in specs if sp[0] != "ans"]
    specs = sorted(specs, key=lambda sp: sp[0] != "ans")  # ans first: its size bounds the trials
    memo = _Memo() if memo is None else memo
    if len(specs) > 1 and data.size > 2 * SAMPLE_BYTES:
        # four slices of SAMPLE_BYTES / 4, each coded as a chunk of its own (one table for slices
        # from distant parts of a tensor favoured zstd's per-block tables: ddddocr_old): zstd's
        # optimal parser (~30 MB/s) on the whole tensor was 70% of pack time
        width = max(w for _, w, _ in specs)
        piece = SAMPLE_BYTES // 4 // width * width
        sample = _sample(data, width, 2 * piece)
        ans_specs = [sp for sp in specs if sp[0] == "ans"]
        if len(ans_specs) == 1 and ans_specs[0][2] != ANS_PAIRS:
            # the ans size is known from the histograms: when no other spec can beat it on the
            # sample, the sample need not be encoded at all
            estimate = _ans_estimate(sample, ans_specs[0][1], ans_specs[0][2] != ANS_INT, piece, memo) * ANS_PREFERENCE
            if all(_hopeless(sample, sp, piece, estimate, memo) for sp in specs if sp[0] != "ans"):
                return _encode_planes(data, *ans_specs[0][:2], chunk_bytes, ans_specs[0][2], chunks=chunks)
        specs = [_choose(sample, specs, piece, memo)[1]]
    return _choose(data, specs, chunk_bytes, memo, chunks)[0]


def _ans_estimate(data: np.ndarray, width: int, sign: bool, chunk_bytes: int, memo: Optional[_Memo] = None) -> float:
    """The stored size of `ans` (no pairs) from histograms, a little above what the coder writes
    (rANS codes within a word per lane of the order-0 cost under its normalised table)."""
    memo = memo or _Memo()
    step = max(width, chunk_bytes // width * width)
    total = 0.0
    for start in range(0, data.size, step):
        items = _plane_items(data, "bytes" if width == 1 else "fplanes" if sign else "planes", width, start, step, memo)
        for key, p in items:
            counts = memo.get(key + ("hist",), lambda: _block_counts(p)).sum(axis=0)
            cost = _own_cost(counts, p.size)
            total += cost + 2 * (1 << _ans.lanes_log2_for(p.size)) if cost < p.size else cost
    return total


# ---------------------------------------------------------------- shared tables (1.2)

def _shared_kind(data: np.ndarray, dtype: int, field: str):
    """(kind, width, sign) of a payload that may use shared tables: planes of one kind (same
    type, width, sign move and plane number) share one table; None for other payloads."""
    if not SHARED_MIN_BYTES <= data.size <= SHARED_MAX_BYTES:
        return None
    codec, width = base_codec(dtype, field, data.size)
    value_type = FLOAT if field == "float_data" else DOUBLE if field == "double_data" else dtype
    if codec == "fplanes":
        return (value_type, "f"), width, True
    if codec == "planes":
        return (value_type, "i"), width, False
    if field in ("int32_data", "int64_data", "uint64_data"):
        return (value_type, field), 1, False
    return (value_type, "b"), 1, False


def _shared_lanes_log2(n: int) -> int:
    """Lanes of a blob with a shared table: those of an `ans` plane of n symbols (1 below 256,
    4 below 8192, 32 up to the 64 KiB of SHARED_MAX_BYTES), so that a plane decodes as fast
    with a shared table as with its own. (4 lanes on planes of 16K-64K symbols, the rule until
    several tables per kind made shared tables win there: silero_vad_v6.int8's cut tensors
    decoded ~40% slower, latency-bound. Measured on rapidocr_cls.int8: 1 lane below 8192 saved
    0.14% of the int8 bytes but decoded its cut tensors at 169 MB/s against 244 with 4 lanes.)"""
    return _ans.lanes_log2_for(n)


def _own_cost(counts: np.ndarray, n: int) -> float:
    """Estimated stored size of a plane coded as an `ans` plane of its own (blob with its table,
    or raw when that saves under ANS_MIN_GAIN)."""
    if np.count_nonzero(counts) < 2:
        return 2.0
    freq = _ans.normalise(counts)
    blob = _ans.coded_bits(counts, freq) / 8 + _ans.table_size(freq) + 1 + 4 * (1 << _ans.lanes_log2_for(n))
    return blob if blob < n * (1 - ANS_MIN_GAIN) else float(n)


# a shared table is charged this many times its bytes against what it saves the planes that take
# it: base64 in the index, mostly won back by the index's zstd (measured: +1.0-1.2 index bytes per
# table byte). 1.25 rather than 1.5: 316 bytes smaller over the 17 corpus packs, none larger;
# 1.0 made silero_vad_v6 and open_nsfw_fp16 larger (tables for tensors that then took LZ)
TABLE_COST = 1.25
MAX_TABLES_PER_KIND = 16
MAX_TABLES = 16  # per file: CACHED_TABLES of _ans.c, the decode tables a batch keeps built
GROUPING_ROUNDS = 8


def _shared_costs(members: np.ndarray, freqs: List[np.ndarray]) -> np.ndarray:
    """Estimated stored bytes (members x tables) of each member plane (its byte counts, one row
    each) as a short blob with each table: rANS bits under the table + states;
    inf where the table lacks a symbol of the plane or the blob would not save ANS_MIN_GAIN.
    (+3: the lanes byte and up to a word of padding.)
    numpy's pairwise sums (no BLAS: the same figures whatever the threads)."""
    n = members.sum(axis=1)
    lanes = np.array([4 * (1 << _shared_lanes_log2(int(k))) + 3 for k in n], np.float64)
    out = np.empty((len(members), len(freqs)), np.float64)
    for j, freq in enumerate(freqs):
        with np.errstate(divide="ignore"):
            price = np.where(freq > 0, _ans.PROB_BITS - np.log2(np.maximum(freq, 1)), np.inf)
        present = members > 0
        bits = np.where(present, members * np.where(np.isinf(price), 0.0, price), 0.0).sum(axis=1)
        missing = (present & np.isinf(price)).any(axis=1)
        cost = bits / 8 + lanes
        cost[missing | (cost >= n * (1 - ANS_MIN_GAIN))] = np.inf
        out[:, j] = cost
    return out


def _grouping_gain(members: np.ndarray, own: np.ndarray, freqs: List[np.ndarray]):
    """(net saving, table each member takes or -1 for its own plane) of a set of shared tables:
    what the members save over their own planes, less TABLE_COST x each table's bytes."""
    if not freqs:
        return 0.0, np.full(len(members), -1)
    costs = _shared_costs(members, freqs)
    pick = np.argmin(costs, axis=1)
    best = costs[np.arange(len(members)), pick]
    takes = best < own
    saving = float(np.where(takes, own - best, 0.0).sum())
    return saving - TABLE_COST * sum(_ans.table_size(f) for f in freqs), np.where(takes, pick, -1)


def _smoothed(group: np.ndarray, cover: np.ndarray) -> np.ndarray:
    """A group's table with every symbol of `cover` given a little weight: grouping compares
    members by how well a table fits them, which a table lacking one of their symbols (cost
    inf) cannot say."""
    return _ans.normalise(group * 64 + cover)


def _regroup(members: np.ndarray, groups: List[np.ndarray], cover: np.ndarray) -> List[np.ndarray]:
    """k-means on coding cost: each member to the group whose (smoothed) table codes it in the
    fewest bits, each group's counts summed again, until the groups settle (empty ones dropped)."""
    pick = None
    for _ in range(GROUPING_ROUNDS):
        new_pick = np.argmin(_shared_costs(members, [_smoothed(g, cover) for g in groups]), axis=1)
        if pick is not None and np.array_equal(new_pick, pick):
            break
        pick = new_pick
        groups = [members[pick == j].sum(axis=0) for j in range(len(groups)) if np.any(pick == j)]
    return groups


def _exact_tables(members: np.ndarray, own: np.ndarray, groups: List[np.ndarray]):
    """(gain, tables) of a grouping: each group's table, then once more from the members that
    take it (those better off with their own plane leave it) when that gains more."""
    freqs = [_ans.normalise(g) for g in groups if np.count_nonzero(g) >= 2]
    gain, pick = _grouping_gain(members, own, freqs)
    refit = [_ans.normalise(g) for g in (members[pick == j].sum(axis=0) for j in range(len(freqs)))
             if np.count_nonzero(g) >= 2]
    refit_gain, _ = _grouping_gain(members, own, refit)
    return (refit_gain, refit) if refit_gain > gain else (gain, freqs)


def _table_groups(members: np.ndarray) -> List[np.ndarray]:
    """The shared tables (normalised frequencies) for one kind of plane, given the byte counts
    of its member planes (one row each): one table from all of them, then, while that pays by
    the estimates, one more (a group apart: the depthwise kernels of a model, tensors of another
    scale), seeded with the member coded worst against its own symbols' cost, the members
    regrouped by coding cost (k-means) and each table fitted to its group. Deterministic: the
    same tables for the same members, whatever the thread count."""
    n = members.sum(axis=1)
    own = np.array([_own_cost(c, int(k)) for c, k in zip(members, n)], np.float64)
    total = members.sum(axis=0)
    if np.count_nonzero(total) < 2:
        return []
    cover = (total > 0).astype(np.int64)
    # what each member's symbols would cost under a table of its own (no table, no states)
    ideal = np.array([_ans.coded_bits(c, _ans.normalise(c)) / 8 if np.count_nonzero(c) >= 2 else 0.0
                      for c in members])
    groups = [total]
    gain, freqs = _exact_tables(members, own, groups)
    while len(groups) < MAX_TABLES_PER_KIND:
        cost = np.minimum(_shared_costs(members, [_smoothed(g, cover) for g in groups]).min(axis=1), own)
        seed = members[int(np.argmax(cost - ideal))]
        new_groups = _regroup(members, groups + [seed], cover)
        if len(new_groups) <= len(groups):
            break
        new_gain, new_freqs = _exact_tables(members, own, new_groups)
        if new_gain <= gain:
            break
        groups, gain, freqs = new_groups, new_gain, new_freqs
    return freqs if gain > 0 else []


class SharedTables:
    """The frequency tables a file's small payloads share (FORMAT.md 3.2): per kind of plane, a
    few tables, each fitted to the group of that kind's planes it codes best (_table_groups), kept
    where the estimated saving over per-plane tables pays for them. Built once per file before
    encoding; read-only after."""

    def __init__(self):
        # per kind of plane, the tables its planes may take: (table id, frequencies, table bytes)
        self.choices: Dict[tuple, List[tuple]] = {}
        self.tables: List[bytes] = []

    @classmethod
    def build(cls, payloads) -> "SharedTables":
        """payloads: (uint8 array, dtype, field) of every payload that will be cut."""
        counts: Dict[tuple, list] = {}
        for data, dtype, payload_field in payloads:
            kind = _shared_kind(data, dtype, payload_field)
            if kind is None:
                continue
            key, width, sign = kind
            planes = [data] if width == 1 else split_planes(data, width, sign)
            for i, p in enumerate(planes):
                counts.setdefault(key + (width, i), []).append(byte_counts(p))
        self = cls()
        groups = {key: _table_groups(np.array(counts[key], np.int64)) for key in sorted(counts, key=repr)
                  if len(counts[key]) >= 2}
        # at most MAX_TABLES tables in all, taken round-robin over the kinds (each kind's tables in
        # the order found, the ones that save most first): the C decoder keeps that many decode
        # tables built over a batch; a plane coded with one more would build its own each time
        for rank in range(MAX_TABLES_PER_KIND):
            for key, freqs in groups.items():
                if rank < len(freqs) and len(self.tables) < MAX_TABLES:
                    freq = freqs[rank]
                    table = _enc.write_table(freq) if _enc is not None else _ans.write_table(freq)
                    self.choices.setdefault(key, []).append((len(self.tables), freq, len(table)))
                    self.tables.append(table)
        return self

    def __bool__(self) -> bool:
        return bool(self.tables)

    def for_planes(self, data: np.ndarray, dtype: int, field: str):
        """(width, sign, [the tables the plane may take (see choices), or None, per plane]) for
        this payload, or None."""
        kind = _shared_kind(data, dtype, field)
        if kind is None:
            return None
        key, width, sign = kind
        per_plane = [self.choices.get(key + (width, i)) for i in range(width)]
        return (width, sign, per_plane) if any(per_plane) else None


def _encode_shared(data: np.ndarray, width: int, sign: bool, per_plane, chunk_bytes: int,
                   own_planes: Optional[list] = None) -> Optional[EncodedStream]:
    """The payload as one `ans_shared` chunk: each plane coded with its shared table where that
    is smaller than its own `ans` plane (and saves ANS_MIN_GAIN of it), else as in `ans`. None
    when no plane gains or the payload spans several chunks. `own_planes`: the stored planes of
    the payload's one-chunk `ans` encoding (same width and sign) when the codec choice made it."""
    if data.size > max(width, chunk_bytes // width * width) or data.size % width:
        return None
    planes = [data] if width == 1 else list(split_planes(data, width, sign))
    if own_planes is None or len(own_planes) != len(planes):
        own_planes = [None] * len(planes)
    stored, ids = [], []
    for p, shared, own in zip(planes, per_plane, own_planes):
        if own is None:
            own = _ans_blob_or_raw(p)
        best, best_id = own, -1
        if shared and len(own) > 2:
            counts = byte_counts(p)
            n = p.size
            lanes_log2 = _shared_lanes_log2(n)
            # the table that codes this plane in the fewest bits (the first of equals)
            bits = [_ans.coded_bits(counts, freq) for _, freq, _ in shared]
            tid, freq, table_len = shared[int(np.argmin(bits))]
            # what the blob must stay under: its own ans plane and the gain asked of any coded
            # plane (and, with SHARED_WHOLE_BELOW_PLANE, the plane's size with the table back)
            limit = min(len(own), n * (1 - ANS_MIN_GAIN), n - table_len if SHARED_WHOLE_BELOW_PLANE else n)
            estimate = min(bits) / 8 + 1 + 4 * (1 << lanes_log2)
            if estimate + 2 < limit:
                blob = _ans.encode_shared(p, freq, lanes_log2)
                if len(blob) < limit:
                    best, best_id = blob, tid
        stored.append(best)
        ids.append(best_id)
    if max(ids) < 0:
        return None
    return EncodedStream("ans_shared", {"width": width, "sign": sign, "tables": ids}, [EncodedChunk(data.size, stored)])


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def untranspose(plane: np.ndarray, width: int, cols: int, out: np.ndarray) -> None:
    """`transpose` (1.3): out's r x cols matrix of width-byte elements from plane, which holds it
    column by column (plane and out: uint8 of the same size, a multiple of width * cols). Width 1
    in C where the extension has it (numpy's strided byte copy: ~0.8 GB/s; the C one ~9 GB/s)."""
    if width == 1 and _fast is not None and hasattr(_fast, "untranspose1"):
        _fast.untranspose1(plane, cols, out)
        return
    t = _UINT[width]
    rows = plane.size // (width * cols)
    out.view(t).reshape(rows, cols)[...] = plane.view(t).reshape(cols, rows).T


def transpose_cols(shape, length: int):
    """(width, cols) of the `transpose` try for a payload of this shape, or None: the last
    dimension as columns, elements of length / count bytes, at least 2 rows and 2 columns."""
    if not shape or len(shape) < 2 or any(type(d) is not int or d <= 0 for d in shape):
        return None
    count = int(np.prod(shape, dtype=np.int64))
    if count <= 0 or length % count:
        return None
    w, cols = length // count, shape[-1]
    if w not in _UINT or cols < 2 or count // cols < 2:
        return None
    return w, cols


def _encode_transposed(data: np.ndarray, width: int, cols: int, chunk_bytes: int, chunks=None) -> Optional[EncodedStream]:
    """The payload's r x cols matrix stored column by column, LZ-coded (FORMAT.md 3, `transpose`):
    structured tables (an STFT basis: w(n) cos(2 pi k n / N), row k) repeat down their columns far
    more than along their rows. Chunks of whole rows."""
    row = width * cols
    step = chunk_bytes // row * row
    if not step:
        return None
    t = _UINT[width]
    stream = EncodedStream("transpose", {"width": width, "cols": cols}, _new_chunks(chunks))
    for start in range(0, data.size, step):
        part = data[start:start + step]
        cm = np.ascontiguousarray(part.view(t).reshape(-1, cols).T).view(np.uint8).ravel()
        stream.chunks.append(EncodedChunk(part.size, [compress_plane(cm, "lz", True)]))
    return stream


def encode_tensor(data: np.ndarray, dtype: int, field: str, *, chunk_bytes: int = CHUNK_BYTES,
                  try_lz: Optional[bool] = None, effort: str = "default",
                  shared: Optional[SharedTables] = None, shape=None, chunks=None) -> EncodedStream:
    """The smallest encoding found for one payload (uint8 array). effort="max" also tries the
    fpairs "split" layout (~0.1% smaller float32, ~30% slower float32 decode). `shape`: the
    tensor's dims, for the `transpose` try where LZ is tried.
    `chunks`: None (each candidate encoding's chunks kept in a list), or a factory called once
    per candidate encoded in full, whose container takes each EncodedChunk as it is made
    (`append`) and gives back records with `raw_length` (mutable), plus `stored` and `len()`:
    the writer's, which writes a large payload's chunks to the output as they come instead of
    holding the whole encoding (~1x the payload) in memory. The returned stream's `chunks` is
    the winner's container; the other containers it made are the losers. Same choices, same
    bytes either way."""
    codec, width = base_codec(dtype, field, data.size)
    value_type = FLOAT if field == "float_data" else DOUBLE if field == "double_data" else dtype
    narrowed = _narrowed(data, value_type) if codec == "fplanes" else None
    if narrowed is not None:
        to, ndata = narrowed
        w = _SIZE[to]
        inner_chunk = chunk_bytes * w // _SIZE[value_type]
        inner = _best(ndata, _float_specs(w, to, ndata.size, effort), inner_chunk, chunks=chunks)
        narrowed, ndata = (to, None), None  # the narrow copy freed before the LZ tries on `data`
        for c in inner.chunks:  # raw lengths in the outer type's bytes (the inner encoding is not used apart)
            c.raw_length = c.raw_length * _SIZE[value_type] // w
        best = EncodedStream(
            "narrow", {"from": value_type, "to": to, "inner": {"codec": inner.codec, "params": inner.params}},
            inner.chunks)
    else:
        if codec == "fplanes":
            specs = _float_specs(width, value_type, data.size, effort)
        elif codec == "bytes" and _low_entropy(data):
            # few distinct values (2-5 bits): Huffman on single bytes loses several % there;
            # pairs of 4-bit ranks per byte halve its redundancy (and the symbols to decode)
            specs = [("ans", 1, ANS_INT), ("bytes", 1, 0), ("bpairs", 1, 0)]
        else:
            specs = [("ans", width, ANS_INT), (codec, width, 0)]
        if codec != "bytes" and data.size <= 1 << 16:  # small: one frame may beat several planes
            specs.append(("bytes", 1, 0))
        memo = _Memo()  # also lends _lz_promising the level-1 probe of the raw bytes, where taken
        best = _best(data, specs, chunk_bytes, memo, chunks)
        plan = shared.for_planes(data, dtype, field) if shared and _write_ans else None
        if plan is not None:
            candidate = _encode_shared(data, *plan, chunk_bytes, memo.d.get((id(data), "ans planes", plan[0], plan[1])))
            if candidate is not None and _rank(candidate) < _rank(best):
                best = candidate
    if try_lz is None:
        try_lz = data.size >= 1024 and _lz_promising(data, best.stored / max(1, data.size),
                                                      memo if narrowed is None else None, chunk_bytes)
    lz = None
    if try_lz:
        lz = _encode_lz(data, chunk_bytes, chunks)
        if lz.stored < best.stored:
            best = lz
    # The same LZ on the columns (FORMAT.md 3, `transpose`): against the LZ coding, kept where
    # smaller; against an entropy coding (ans, Huffman planes: faster to decode than zstd's LZ)
    # only where it saves TRANSPOSE_OVER_ENTROPY of it. Tried where LZ is, and on payloads up to
    # TRANSPOSE_PROBE_BYTES whose LZ probe failed but whose columns pass it (a level-1 frame of them
    # already under the bar: on minilm_int8's matrices it is ~1.0x their ans coding, on silero-vad's
    # int8 STFT bases 0.63-0.68x): silero-vad's int8 STFT basis [258, 1, 256] looks hopeless
    # to LZ by rows (57947 bytes of Huffman) and is 29784 by columns, decoded in about the same
    # time (52-76 us against 51-58, with the C untranspose; numpy's byte transpose alone was ~0.3 ms).
    # Two column widths: the elements (w bytes) of the last dimension, and the bytes of its rows
    # (width 1, w * last dim columns: each byte of an element down the rows). silero-vad's float32
    # STFT basis [258, 1, 256]: 40824 bytes by float columns, 39697 by byte columns, and zstd
    # decodes the byte columns 5x faster (38 against 200 us: one byte column is a few long runs and
    # repeats, a float column a mix of short matches and literals)
    bar = best.stored if best is lz else best.stored * TRANSPOSE_OVER_ENTROPY
    tc = transpose_cols(shape, data.size) if _write_transpose and field in ("raw_data", "float_data", "double_data", "external") else None
    if tc is not None and not try_lz and not 1024 <= data.size <= TRANSPOSE_PROBE_BYTES:
        tc = None
    for w, cols in ([tc] + ([(1, tc[0] * tc[1])] if tc[0] > 1 else [])) if tc is not None else []:
        if not try_lz:
            t = _UINT[w]
            columns = np.ascontiguousarray(data.view(t).reshape(-1, cols).T).view(np.uint8).ravel()
            if len(_compressor("probe1").compress(columns)) >= bar:  # level 1 must already beat the bar
                continue
        tr = _encode_transposed(data, w, cols, chunk_bytes, chunks)
        if tr is not None and tr.stored < bar:
            best, bar = tr, tr.stored
    return best


def _float_specs(width: int, value_type: int, size: int, effort: str = "default"):
    specs = [("ans", width, ANS_FLOAT), ("fplanes", width, 0)]
    if width in (2, 4) and value_type in (FLOAT, BFLOAT16, COMPLEX64):
        if effort == "max":
            # ans on pairs of 4-bit exponent ranks: ~0.3% smaller exponents (the pair model sees
            # neighbouring exponents) but ~10% slower to decode than one exponent per symbol
            specs.append(("ans", width, ANS_PAIRS))
        # 8-bit exponents: 4-bit ranks paired in a byte halve the Huffman symbols (faster) and its
        # redundancy (smaller); with "split", one table per frequent exponent for the sign and top
        # mantissa bits, which depend on it (~0.1% of float32 sizes, but ~30% of float32 decode
        # time: only when asked for)
        specs.append(("fpairs", width, 0))
        if effort == "max" and size >= 1 << 16:
            specs.append(("fpairs", width, SPLIT))
    return specs


def _lz_promising(data: np.ndarray, ratio: float, memo: Optional[_Memo] = None, chunk_bytes: int = 0) -> bool:
    """A cheap probe: does a fast LZ pass on a sample already beat the plane coding?"""
    if data.size > 1 << 20:  # 8 slices across the tensor: its start alone can mislead (padding rows)
        step = data.size // 8
        sample = np.concatenate([data[i * step:i * step + (1 << 17)] for i in range(8)])
    else:
        sample = data
    # zstd level 1 runs at twice the speed of level 3; where it leaves the sample at 85% or more,
    # level 3 came within 0.75% of it on every corpus payload (1673: float, int8, LZ-friendly),
    # so level 1 with 3% to spare already says "no" (the probe was ~20% of the encode time)
    # (the zstd floor of the "bytes" spec may have taken this very probe of the whole payload
    # already: same level, same frame parameters, same bytes)
    known = memo.d.get((id(data), 0, chunk_bytes, "raw", "probe")) if memo is not None and data.size <= chunk_bytes \
        and sample is data else None
    quick = known if known is not None else len(_compressor("probe1").compress(sample))
    if quick >= LZ_QUICK_FLOOR * sample.size and quick * (1 - LZ_QUICK_SLACK) >= ratio * 0.99 * sample.size:
        return False
    probe = len(_compressor("probe3").compress(sample)) / max(1, sample.size)
    return probe < ratio * 0.99


LZ_QUICK_FLOOR = 0.85
LZ_QUICK_SLACK = 0.03
