"""Reading a model for the runtime as a skeleton plus weights, never as a full ModelProto.

- `.onnx`: the file (and any external data file) is memory-mapped; the skeleton is cut from the
  mapping without reading the weights (`runtime_wire`), and each weight is a read-only numpy view
  of the mapping: no copy at all until a rewrite (fold, int8 forms, float16) makes its own array.
- `.onnxz`: the pack's model file is restored with only its graph bytes and small tensors
  decoded (`restore_file(skip=)`: the big payload ranges stay untouched zero pages), the skeleton
  is cut the same way, and the big tensors are decoded together (`tensors_bytes`: all their
  chunks on the reader's thread pool at once), each straight into the array the session keeps.
  Only the pack reader's public API is used.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._fileio import _safe_external_path, check_readable, parse_model_bytes
from .errors import CorruptFileError, FileAccessError, InvalidModelError
from .runtime_feed import INLINE_MAX_BYTES, SplitModel, is_placeholder, placeholder

PACKED_MAGIC = b"ONNXZ"


def is_packed(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(PACKED_MAGIC)) == PACKED_MAGIC
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_split(path, threads=None, max_bytes=None, packed=None) -> SplitModel:
    """`max_bytes` caps what a packed file may restore to (the pack reader's limit; None: its
    default); a plain .onnx is read where it lies, nothing to cap. `packed`: the file already
    opened with open_packed (read and closed here)."""
    if packed is not None:
        return read_packed(path, packed=packed)
    p = check_readable(path)
    if is_packed(p):
        return read_packed(p, threads=threads, max_bytes=max_bytes)
    return read_onnx(p)


def _map_file(path: Path):
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def _cut_skeleton(buf, name: str):
    from .onnxz.protowire import WireError
    from .runtime_wire import strip_main_graph_payloads

    try:
        skeleton_bytes, stripped = strip_main_graph_payloads(buf, INLINE_MAX_BYTES)
    except (WireError, IndexError, ValueError) as exc:
        raise InvalidModelError(f"{name} is not an ONNX model ({exc})") from None
    return parse_model_bytes(skeleton_bytes, name), stripped


def _assemble(model: onnx.ModelProto, stripped, arrays: dict) -> SplitModel:
    """The skeleton with a placeholder for each stripped tensor (Constant nodes become initializers)."""
    graph = model.graph
    by_name = {s.name: s for s in stripped if not s.constant_node}
    for i, t in enumerate(graph.initializer):
        if t.name in by_name and t.name in arrays:
            graph.initializer[i].CopyFrom(placeholder(t.name, arrays[t.name]))
    constants = {s.name for s in stripped if s.constant_node}
    if constants:
        keep = [n for n in graph.node if not (n.op_type == "Constant" and n.output and n.output[0] in constants)]
        del graph.node[:]
        graph.node.extend(keep)
        for name in sorted(constants):
            graph.initializer.append(placeholder(name, arrays[name]))
    return SplitModel(model, arrays)


def read_onnx(path: Path) -> SplitModel:
    buf = _map_file(path)
    model, stripped = _cut_skeleton(buf, str(path))
    arrays = {s.name: s.view(buf) for s in stripped}
    _map_external(model, path.parent, arrays)
    return _assemble(model, stripped, arrays)


def _external_info(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _map_external(model: onnx.ModelProto, base: Path, arrays: dict) -> None:
    """Main-graph initializers in external data files become views of those files (mapped once);
    tensors elsewhere (subgraphs, attributes) are read into the skeleton."""
    from ._fileio import external_tensors

    maps = {}
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = _external_info(t)
        target = _safe_external_path(base, info.get("location", ""))
        if target not in maps:
            if not target.is_file():
                raise InvalidModelError(f"external data file {info.get('location')!r} of tensor {t.name!r} is missing")
            maps[target] = _map_file(target)
        buf = maps[target]
        array = _view_external(t, info, buf)
        arrays[t.name] = array
    for t in model.graph.initializer:
        if t.name in arrays and t.data_location == TensorProto.EXTERNAL:
            t.CopyFrom(placeholder(t.name, arrays[t.name]))
    for t in external_tensors(model):  # subgraph / attribute tensors: read into the skeleton
        if is_placeholder(t):
            continue
        info = _external_info(t)
        target = _safe_external_path(base, info.get("location", ""))
        if target not in maps:
            maps[target] = _map_file(target)
        value = _view_external(t, info, maps[target])
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), t.name))


def _view_external(t: TensorProto, info: dict, buf) -> np.ndarray:
    try:
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if info.get("length") else len(buf) - offset
    except ValueError:
        raise InvalidModelError(f"tensor {t.name!r} has a malformed external data offset or length") from None
    if offset < 0 or length < 0 or offset + length > len(buf):
        raise InvalidModelError(f"tensor {t.name!r} declares external data beyond the end of its file")
    np_type = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4) or count * np.dtype(np_type).itemsize != length:
        proto = TensorProto()
        proto.CopyFrom(t)
        del proto.external_data[:]
        proto.data_location = TensorProto.DEFAULT
        proto.raw_data = bytes(buf[offset:offset + length])
        return numpy_helper.to_array(proto)
    return np.frombuffer(buf, dtype=np_type, count=count, offset=offset).reshape(tuple(t.dims))


# ---------------------------------------------------------------------- packed files

def read_packed(path: Path, threads=None, max_bytes=None, packed=None) -> SplitModel:
    from .onnxz import open_packed

    if packed is None:
        packed = open_packed(path, threads=threads, max_bytes=max_bytes)
    with packed:
        pf = packed.packed_file  # the pack reader's public file layer (whole files, tensor bytes)
        model, stripped, buf = _packed_skeleton(pf, str(path))
        entries = _entries(pf)
        arrays, coded = {}, []
        for s in stripped:
            entry = entries.get((0, s.offset))
            if entry is not None and entry.length == s.length:
                coded.append((s.name, entry, helper.tensor_dtype_to_np_dtype(s.dtype), s.shape))
            else:  # payload kept in the pack's skeleton: already restored in `buf`
                arrays[s.name] = s.view(buf).copy()
        del buf
        _packed_external(model, pf, packed, entries, arrays, coded)
        _decode_together(pf, coded, arrays)
        return _assemble(model, stripped, arrays)


def _entries(pf) -> dict:
    """(file, offset) -> the pack's entry of the tensor whose payload starts there."""
    return {(t.file, t.offset): t for t in pf.index.tensors}


def _decode_together(pf, coded, arrays) -> None:
    """Decode the tensors [(name, entry, numpy dtype, shape)] in one go (every chunk of every
    tensor on the reader's thread pool at once), each straight into the array the session keeps."""
    if not coded:
        return
    outs = pf.tensors_bytes([entry for _, entry, _, _ in coded])
    for (name, _, dtype, shape), out in zip(coded, outs):
        arrays[name] = out.view(dtype).reshape(shape)


def _packed_skeleton(pf, name: str):
    """(skeleton ModelProto, stripped tensors, restored buffer) of the pack's model file.

    File 0 is restored into fresh zero pages without the payloads of its big tensors
    (`restore_file(skip=)`): untouched pages of anonymous memory (huge pages refused, see
    _sparse_zeros) cost nothing, so a big payload never decoded costs no memory. The tensors the walk then strips are decoded later, together. A big
    payload the walk keeps inline (in a subgraph, or a layout that cannot be viewed) is decoded
    into the buffer too and the walk repeated (rare)."""
    from .onnxz.protowire import WireError
    from .runtime_wire import strip_main_graph_payloads

    size = pf.index.files[0].size
    buf = _sparse_zeros(size)
    big = [t for t in pf.index.tensors if t.file == 0 and t.stream is not None and t.length > INLINE_MAX_BYTES]
    pf.restore_file(0, buf, skip=big)
    for attempt in range(2):
        try:
            skeleton_bytes, stripped = strip_main_graph_payloads(buf, INLINE_MAX_BYTES)
        except (WireError, IndexError, ValueError) as exc:
            raise CorruptFileError(f"damaged .onnxz file: its model does not parse ({exc})") from None
        taken = {(s.offset, s.length) for s in stripped}
        missing = [t for t in big if (t.offset, t.length) not in taken]
        if not missing or attempt:
            break
        pf.tensors_bytes(missing, [buf[t.offset:t.offset + t.length] for t in missing])
    return parse_model_bytes(skeleton_bytes, name), stripped, buf


def _sparse_zeros(size: int) -> np.ndarray:
    """A zero-filled buffer whose untouched pages cost no memory: anonymous memory with huge
    pages refused where the kernel allows it (with transparent huge pages on "always", writing the
    ~140 graph pieces of a 24 MB model into np.zeros made 20 MB resident: one 2 MB page each)."""
    if size == 0:
        return np.zeros(0, np.uint8)
    area = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            area.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(area, np.uint8)


def _packed_external(model, pf, packed, entries, arrays, coded) -> None:
    """Main-graph initializers in the pack's external data files: coded ones join `coded` (decoded
    together later), others are read from their range."""
    names = {f.name: fi for fi, f in enumerate(pf.index.files)}
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = _external_info(t)
        fi = names.get(info.get("location", ""))
        if fi is None or fi == 0:
            raise CorruptFileError(f"damaged .onnxz file: external data {info.get('location')!r} of {t.name!r} is not in the pack")
        offset = int(info.get("offset", 0) or 0)
        entry = entries.get((fi, offset))
        shape = list(t.dims)
        if entry is not None and _plain_layout(t, entry.length):
            coded.append((t.name, entry, helper.tensor_dtype_to_np_dtype(t.data_type), shape))
            arrays[t.name] = None  # decoded later; the placeholder needs only dtype and shape
            t.CopyFrom(_placeholder_for(t.name, t.data_type, shape, entry.length))
            continue
        if entry is not None:
            value = packed.get_tensor(entry.key)
            arrays[t.name] = (value if value.flags.writeable else value.copy()).reshape(shape)
        else:
            length = int(info["length"]) if info.get("length") else pf.index.files[fi].size - offset
            # (the range read starts at the tensor: its offset in that buffer is 0)
            arrays[t.name] = _view_external(t, {**info, "offset": "0", "length": str(length)},
                                            pf.read_range(fi, offset, length))
        t.CopyFrom(placeholder(t.name, arrays[t.name]))


def _plain_layout(t: TensorProto, length: int) -> bool:
    """Whether an external payload of `length` bytes is the tensor's values as they lie in memory."""
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4, TensorProto.STRING, TensorProto.UNDEFINED):
        return False
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return False
    return itemsize * int(np.prod(t.dims, dtype=np.int64)) == length


def _placeholder_for(name: str, data_type: int, shape: list, length: int) -> TensorProto:
    from .runtime_feed import PLACEHOLDER_LOCATION

    t = TensorProto()
    t.name, t.data_type = name, data_type
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", PLACEHOLDER_LOCATION), ("offset", "0"), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


# ---------------------------------------------------------------------- packed files handed over whole

# op types whose presence means the graph needs our rewrite in fold mode (passes.fold's folders
# and palettes need integer tensors; DequantizeLinear is named in the graph bytes)
_REWRITE_MARKERS = (b"DequantizeLinear",)
_INTEGER_WEIGHT_TYPES = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4}
# raw bytes decoded per step while streaming a whole model (the decoder runs this far ahead)
STREAM_BATCH_BYTES = 4 << 20


class WholePack:
    """A packed model file handed to onnxruntime as it is: nothing to fold, rewrite or share.

    Why: for a lossless pack in fold mode the skeleton walk, its protobuf, the fold planning and
    the re-serialisation only rebuild the bytes the pack restores anyway (open_nsfw: ~20 ms CPU of
    a ~190 ms load). Here the model file is restored straight into the pipe onnxruntime parses:
    its graph bytes first (without the big payloads, `restore_file(skip=)`), then the payloads,
    decoded in batches by a decoder thread that runs one batch ahead of the writer (the decode
    overlaps onnxruntime's parsing), each range released (madvise) once written. Integrity: every
    chunk's checksum, as for the split path (the whole-file sha256 is not computed: it would cost
    more than the decode)."""

    def __init__(self, packed, pf, size: int, big: list, float_dtype, names: set):
        self._packed, self._pf = packed, pf
        self.size, self.float_dtype, self.tensor_names = size, np.dtype(float_dtype), names
        self._big = sorted(big, key=lambda e: e.offset)

    def detach(self):
        """The open PackedModel, handed over (to read_split(packed=...)); this object is spent."""
        packed, self._packed, self._pf = self._packed, None, None
        return packed

    def close(self) -> None:
        if self._packed is not None:
            self._packed.close()
            self._packed = self._pf = None

    def pieces(self):
        """The model's bytes as consecutive buffers (a generator: run it in the writer thread)."""
        import queue
        import threading

        pf, size = self._pf, self.size
        area = mmap.mmap(-1, size) if size else None
        if area is not None and hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                area.madvise(mmap.MADV_NOHUGEPAGE)
            except OSError:
                pass
        buf = np.frombuffer(area, np.uint8) if area is not None else np.zeros(0, np.uint8)
        batches, current, length = [], [], 0
        for e in self._big:
            current.append(e)
            length += e.length
            if length >= STREAM_BATCH_BYTES:
                batches.append(current)
                current, length = [], 0
        if current:
            batches.append(current)
        done: queue.Queue = queue.Queue()
        ahead = threading.Semaphore(2)  # at most two batches decoded and not yet written
        stop = threading.Event()

        def decode():
            try:
                for batch in batches:
                    ahead.acquire()
                    if stop.is_set():
                        return
                    pf.tensors_bytes(batch, [buf[e.offset:e.offset + e.length] for e in batch])
                    done.put(batch[-1].offset + batch[-1].length)
            except BaseException as exc:  # reported by the writer
                done.put(exc)

        decoder = threading.Thread(target=decode, name="passes-pack-decoder", daemon=True)
        try:
            pf.restore_file(0, buf, skip=self._big)  # graph bytes and small tensors
            decoder.start()
            position = 0
            for batch in batches:
                end = batch[0].offset  # everything before this batch's first payload is ready
                if end > position:
                    yield buf[position:end]
                    _release(area, position, end)
                    position = end
                item = done.get()
                ahead.release()
                if isinstance(item, BaseException):
                    raise item
                yield buf[position:item]
                _release(area, position, item)
                position = item
            if position < size:
                yield buf[position:size]
        finally:  # (also when the writer gives up: the decoder stops before the pack closes)
            stop.set()
            ahead.release()
            ahead.release()
            if decoder.is_alive():
                decoder.join()
            del buf
            self.close()


def _release(area, start: int, end: int) -> None:
    """Give back the whole pages of [start, end) of the anonymous mapping (already written)."""
    if area is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        try:
            area.madvise(mmap.MADV_DONTNEED, first, last - first)
        except (OSError, ValueError):
            pass


def read_whole_packed(path, threads=None, max_bytes=None, max_size=None):
    """(WholePack, None) when `path` is a packed model onnxruntime can take as it is in fold mode
    (one file, no DequantizeLinear named in its graph bytes, no integer tensors a palette could
    index with); else (None, the open PackedModel for read_split(packed=...), or None for a
    plain .onnx). The test is conservative: a false "needs rewriting" only means the split path."""
    from .onnxz import open_packed

    p = check_readable(path)
    if not is_packed(p):
        return None, None
    packed = open_packed(p, threads=threads, max_bytes=max_bytes)
    try:
        pf = packed.packed_file
        files = pf.index.files
        if len(files) != 1 or (max_size is not None and files[0].size > max_size):
            return None, packed
        tensors = [t for t in pf.index.tensors if t.file == 0]
        skeleton = pf.skeleton(0).tobytes()
        if any(marker in skeleton for marker in _REWRITE_MARKERS) or any(t.dtype in _INTEGER_WEIGHT_TYPES for t in tensors):
            return None, packed
        weights = {TensorProto.FLOAT: 0, TensorProto.FLOAT16: 0}
        for t in tensors:
            if t.dtype in weights:
                weights[t.dtype] += t.length
        dtype = np.float16 if weights[TensorProto.FLOAT16] > weights[TensorProto.FLOAT] else np.float32
        big = [t for t in tensors if t.stream is not None and t.length > INLINE_MAX_BYTES]
        return WholePack(packed, pf, files[0].size, big, dtype, {t.name or t.key for t in big}), None
    except BaseException:
        packed.close()
        raise
