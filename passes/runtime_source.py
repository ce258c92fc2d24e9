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
from .errors import CorruptFileError, FileAccessError, InvalidArgumentError, InvalidModelError
from .onnxz.protowire import WireError
from .runtime_arena import anonymous_array
from .runtime_feed import INLINE_MAX_BYTES, SplitModel, is_placeholder, placeholder
from .runtime_verbatim import file_pieces, verbatim_kind
# (imported with this module, not in the first session's clock: every read goes through it)
from .runtime_wire import strip_main_graph_payloads

PACKED_MAGIC = b"ONNXZ"


def is_packed(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(PACKED_MAGIC)) == PACKED_MAGIC
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_split(path, threads=None, max_bytes=None, background=False) -> SplitModel:
    """`max_bytes` caps what a packed file may restore to (the pack reader's limit; None: its
    default); a plain .onnx is read where it lies, nothing to cap. `background`: a packed file's
    big tensors may still be decoding on a worker thread when this returns (their arrays exist,
    their values do not): the caller must call `split.wait_weights()` before reading any value."""
    return start_read(path, threads=threads, max_bytes=max_bytes, background=background).finish()


def start_read(path, threads=None, max_bytes=None, background=False, shared_chunks=True):
    """read_split in two steps: this opens the file (a packed one: its index read, the big weights
    decoding aside with `background`, its model file restored but for them), `.finish()` then
    cuts and walks the graph into the SplitModel. In between, a packed file's `verbatim_pieces()`
    can be handed to onnxruntime while another thread finishes (runtime_verbatim); on a failure
    before finish(), `abandon()`. `shared_chunks`: small payloads decoded aside share large arrays
    (BackgroundDecode), for callers that keep or drop them all together."""
    p = check_readable(path)
    if is_packed(p):
        return PackedRead(p, threads=threads, max_bytes=max_bytes, background=background,
                          shared_chunks=shared_chunks)
    return _OnnxRead(p)


class _OnnxRead:
    """start_read of a plain .onnx: everything happens in finish()."""

    def __init__(self, path: Path):
        self.path = path

    def verbatim_kind(self):
        return None

    def finish(self) -> SplitModel:
        return read_onnx(self.path)

    def abandon(self) -> None:
        pass


def _map_file(path: Path):
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def _cut_skeleton(buf, name: str):
    """(skeleton, stripped tensors, whether any tensor may name an external data file)."""
    try:
        skeleton_bytes, stripped = strip_main_graph_payloads(buf, INLINE_MAX_BYTES)
    except (WireError, IndexError, ValueError) as exc:
        raise InvalidModelError(f"{name} is not an ONNX model ({exc})") from None
    # a tensor can name a file only through an external_data entry keyed "location": without those
    # bytes anywhere, the walk over every attribute and subgraph tensor can be skipped (onnx's
    # walk cost more than the rest of the read of a 900-node graph)
    return parse_model_bytes(skeleton_bytes, name), stripped, b"location" in skeleton_bytes


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
    model, stripped, names_files = _cut_skeleton(buf, str(path))
    arrays = {s.name: s.view(buf) for s in stripped}
    _map_external(model, path.parent, arrays, attributes=names_files)
    return _assemble(model, stripped, arrays)


def _external_info(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _map_external(model: onnx.ModelProto, base: Path, arrays: dict, attributes: bool = True) -> None:
    """Main-graph initializers in external data files become views of those files (mapped once);
    tensors elsewhere (subgraphs, attributes) are read into the skeleton (attributes=False: the
    caller knows none names a file). Every range passes _fileio.ExternalRanges' checks, as
    load_model's: views cost nothing here, but onnxruntime makes its own copy of each, so a
    thousand initializers naming one 4 MiB range took 4 GB."""
    from ._fileio import ExternalRanges, external_tensors

    maps = {}
    ranges = ExternalRanges()

    def view(t):
        info = _external_info(t)
        target = _safe_external_path(base, info.get("location", ""))
        buf = maps.get(target)
        if buf is None:
            if not target.is_file():
                raise InvalidModelError(f"external data file {info.get('location')!r} of tensor {t.name!r} is missing")
            buf = maps[target] = _map_file(target)
        offset, length = ranges.check(t, info, target, len(buf))
        return _view_external(t, offset, length, buf)

    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            arrays[t.name] = view(t)
    for t in model.graph.initializer:
        if t.name in arrays and t.data_location == TensorProto.EXTERNAL:
            t.CopyFrom(placeholder(t.name, arrays[t.name]))
    for t in external_tensors(model) if attributes else ():  # subgraph / attribute tensors: into the skeleton
        if is_placeholder(t):
            continue
        value = view(t)
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), t.name))


def _view_external(t: TensorProto, offset: int, length: int, buf) -> np.ndarray:
    """The values of `t` from `buf[offset:offset + length]` (a range ExternalRanges checked)."""
    np_type = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4) or count * np.dtype(np_type).itemsize != length:
        proto = TensorProto()
        proto.CopyFrom(t)
        del proto.external_data[:]
        proto.data_location = TensorProto.DEFAULT
        proto.raw_data = bytes(buf[offset:offset + length])
        try:
            return numpy_helper.to_array(proto)
        except ValueError:  # (its bytes are not what its dims and type need)
            raise InvalidModelError(f"tensor {t.name!r} has {length} bytes of external data, "
                                    f"which its type and shape {list(t.dims)} do not fit") from None
    return np.frombuffer(buf, dtype=np_type, count=count, offset=offset).reshape(tuple(t.dims))


# ---------------------------------------------------------------------- packed files

class PackedRead:
    """A packed file being read (see start_read): the index open, the big payloads decoding aside
    (`background`), the model file restored but for them."""

    def __init__(self, path: Path, threads=None, max_bytes=None, background=False, shared_chunks=True):
        from .onnxz import open_packed

        self.path = path
        self._packed = open_packed(path, threads=threads, max_bytes=max_bytes)
        self._early = None
        try:
            self._pf = pf = self._packed.packed_file  # the pack reader's public file layer
            self._big = _big_entries(pf)
            # the graph bytes are restored before the big payloads start decoding: the restore
            # runs its tasks on the reader's pool too, and its wait for them queued behind a whole
            # batch of that decode (4-22 MB): 1-2 ms of this thread's CPU took 6-14 ms of wall
            # (minilm_fp16, open_nsfw_fp16 packs), all of it before onnxruntime could start
            self._buf = _restored_model_file(pf, self._big.get(0, []))
            if background and self._big:
                # the big payloads decode (C, GIL released) while this thread walks the graph and
                # the runtime plans the session
                self._early = BackgroundDecode(pf, [t for ts in self._big.values() for t in ts], self._packed,
                                               shared_chunks=shared_chunks)
        except BaseException:
            self.abandon()
            raise

    def verbatim_kind(self) -> str | None:
        """runtime_verbatim.verbatim_kind of the pack when its big payloads decode aside, else None."""
        return None if self._early is None else verbatim_kind(self._pf.index)

    def verbatim_pieces(self) -> list:
        """The restored model file as buffers in file order (its big payloads: the arrays they
        decode into, `ready` says when); only where verbatim_kind() is not None."""
        return file_pieces(self._buf, self._big.get(0, []), self._early.outputs())

    def ready(self, array, block: bool = True) -> bool:
        """BackgroundDecode.ready of the decode aside (always True without one)."""
        return True if self._early is None else self._early.ready(array, block)

    def abandon(self) -> None:
        """On a failure before finish() returned: the decode aside stops, the pack closes."""
        if self._early is not None:
            self._early.abandon()
        else:
            self._packed.close()

    def finish(self) -> SplitModel:
        pf, early = self._pf, self._early
        try:
            model, stripped, buf, names_files = _packed_skeleton(pf, str(self.path), self._big.get(0, []), self._buf)
            self._buf = None
            entries = _entries(pf)
            arrays, coded = {}, []
            for s in stripped:
                entry = entries.get((0, s.offset))
                if entry is not None and entry.length == s.length:
                    coded.append((s.name, entry, helper.tensor_dtype_to_np_dtype(s.dtype), s.shape))
                else:  # payload kept in the pack's skeleton: already restored in `buf`
                    arrays[s.name] = s.view(buf).copy()
            del buf
            _packed_external(model, pf, self._packed, entries, arrays, coded, names_files)
            if early is not None:
                coded = early.take(coded, arrays)
            _decode_together(pf, coded, arrays)
            split = _assemble(model, stripped, arrays)
        except BaseException:
            self.abandon()
            raise
        if early is None:
            self._packed.close()
        else:
            split.pending = early
        return split


class BackgroundDecode:
    """Tensors of a pack decoded on a worker thread into arrays made up front, in file order and
    in batches of about BATCH_BYTES, so that a consumer can use the first ones while the rest
    decode (`ready(array)`); `wait()` joins it, closes the pack and raises the decode's error, if any."""

    # bytes per batch: each batch is one tensors_bytes call (all its chunks on the reader's pool)
    BATCH_BYTES = 4 << 20

    def __init__(self, pf, entries, packed, shared_chunks=True):
        import threading

        from .runtime_arena import Arena, MemoryOwners

        self._packed = packed
        entries = sorted(entries, key=lambda t: (t.file, t.offset))
        # small payloads share large arrays (huge pages: see runtime_arena), in file order; not
        # where the caller frees some of them and keeps others (int8 mode re-lays MatMul weights
        # out and drops the decoded ones): a chunk goes back only with its last tensor, and the
        # dropped ones' memory stayed held (minilm_fp32 q8.onnxz int8: added 51 -> 62 MB)
        arena = Arena() if shared_chunks else Arena(own_bytes=0)
        self._outs = {(t.file, t.offset): (t, arena.take(t.length)) for t in entries}
        batches, size = [[]], 0
        for t in entries:
            if batches[-1] and size >= self.BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(t)
            size += t.length
        self._position = MemoryOwners()  # output array -> (batch, order in the file)
        order = 0
        for k, batch in enumerate(batches):
            for t in batch:
                self._position.add(self._outs[(t.file, t.offset)][1], (k, order))
                order += 1
        self._done = [threading.Event() for _ in batches]
        self._error = None
        self._stop = False  # abandon(): the batches not started are not decoded

        def run():
            try:
                for batch, done in zip(batches, self._done):
                    if self._stop:
                        raise InvalidArgumentError("the weights' decode was abandoned (a failed load)")
                    pf.tensors_bytes(batch, [self._outs[(t.file, t.offset)][1] for t in batch])
                    done.set()
            except BaseException as exc:  # reported by ready() and wait()
                self._error = exc
            finally:
                for done in self._done:  # (nobody waits forever on a batch after an error)
                    done.set()

        self._thread = threading.Thread(target=run, name="passes-weight-decode", daemon=True)
        self._thread.start()

    def outputs(self) -> dict:
        """(file, offset) -> the array each tensor decodes into (values only once `ready`)."""
        return {key: out for key, (_, out) in self._outs.items()}

    def take(self, coded, arrays) -> list:
        """Put the arrays being decoded here for the `coded` tensors they cover into `arrays`;
        returns the others (to decode now)."""
        rest = []
        for name, entry, dtype, shape in coded:
            hit = self._outs.get((entry.file, entry.offset))
            if hit is not None and hit[0] is entry:
                arrays[name] = hit[1].view(dtype).reshape(shape)
            else:
                rest.append((name, entry, dtype, shape))
        return rest

    def _where(self, array):
        """(batch, order) of the decode output holding `array`'s memory, or None."""
        return self._position.find(array)

    def order(self, array) -> int:
        """Rank of `array` in decode order (arrays not decoded here: -1, they are ready)."""
        hit = self._where(array)
        return -1 if hit is None else hit[1]

    def ready(self, array, block: bool = True) -> bool:
        """Whether `array` (a view of a decode output, or anything else: always ready) holds its
        values; with `block`, waits until it does. Raises the decode's error."""
        hit = self._where(array)
        if hit is not None:
            done = self._done[hit[0]]
            if not block and not done.is_set():
                return False
            done.wait()
        if self._error is not None:
            raise self._error
        return True

    def wait(self) -> None:
        self._thread.join()
        self._packed.close()
        self._outs = {}
        self._position.clear()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def abandon(self) -> None:
        """On a failed load: the batch being decoded finishes, the others are skipped (a large
        model's whole decode no longer runs before the error or Ctrl-C reaches the caller)."""
        self._stop = True
        try:
            self.wait()
        except BaseException:
            pass


def _big_entries(pf) -> dict:
    """file -> the coded tensors of that file too big to stay inline in the skeleton."""
    out = {}
    for t in pf.index.tensors:
        if t.stream is not None and t.length > INLINE_MAX_BYTES:
            out.setdefault(t.file, []).append(t)
    return out


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


def _restored_model_file(pf, big) -> np.ndarray:
    """The pack's model file, restored but for the payloads of the `big` tensors (see _packed_skeleton)."""
    buf = _sparse_zeros(pf.index.files[0].size)
    pf.restore_file(0, buf, skip=big)
    return buf


def _packed_skeleton(pf, name: str, big, buf=None):
    """(skeleton ModelProto, stripped tensors, restored buffer, whether any tensor may name an
    external data file: see _cut_skeleton) of the pack's model file (`buf`: already restored by
    _restored_model_file).

    File 0 is restored into fresh zero pages without the payloads of its big tensors
    (`restore_file(skip=)`): untouched pages of anonymous memory (huge pages refused, see
    _sparse_zeros) cost nothing, so a big payload never decoded costs no memory. The tensors the walk then strips are decoded later, together. A big
    payload the walk keeps inline (in a subgraph, or a layout that cannot be viewed) is decoded
    into the buffer too and the walk repeated (rare)."""

    if buf is None:
        buf = _restored_model_file(pf, big)
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
    return parse_model_bytes(skeleton_bytes, name), stripped, buf, b"location" in skeleton_bytes


def _sparse_zeros(size: int) -> np.ndarray:
    """A zero-filled buffer whose untouched pages cost no memory: private anonymous memory with
    huge pages refused where the kernel allows it (with transparent huge pages on "always",
    writing the ~140 graph pieces of a 24 MB model into np.zeros made 20 MB resident: one 2 MB
    page each). See runtime_arena.anonymous_array."""
    if size == 0:
        return np.zeros(0, np.uint8)
    return anonymous_array(size, huge_pages=False)


def _packed_external(model, pf, packed, entries, arrays, coded, attributes: bool = True) -> None:
    """Main-graph initializers in the pack's external data files: coded ones join `coded` (decoded
    together later), others are read from their range. Tensors elsewhere in the external files
    (subgraph initializers, Constant attributes: onnx's convert_attribute layout) are read into the
    skeleton, as _map_external does for a plain .onnx (onnxruntime cannot open the pack's files;
    attributes=False: the caller knows none names a file). A tensor naming a file the pack does not
    hold (a pack of one file too: onnxruntime, given the model's bytes, would look for it beside
    the process's working folder) is refused as load refuses it."""
    from ._fileio import ExternalRanges, external_tensors
    from .onnxz.format import normal_data_name

    names = {f.name: fi for fi, f in enumerate(pf.index.files)}
    # load()'s checks of each range (inside its file, offset and length well formed) and of the
    # bytes all ranges read (many tensors naming one range would each get a copy: a 1 MB pack of
    # 1000 tensors naming one 4 MiB range took 8 GB here)
    ranges = ExternalRanges()

    def where(t):
        """(file index, offset, length, the pack's tensor entry of that range or None) of an external tensor."""
        info = _external_info(t)
        try:  # the index names each file by its normal name (FORMAT.md 4): "./w3.bin" is "w3.bin"
            fi = names.get(normal_data_name(info.get("location", "")))
        except CorruptFileError:  # ".." or absolute: no file of the pack has that name
            fi = None
        if fi is None or fi == 0:
            raise InvalidModelError(f"tensor {t.name!r} references external data {info.get('location')!r} not in the packed file")
        offset, length = ranges.check(t, info, fi, pf.index.files[fi].size)
        entry = entries.get((fi, offset))
        return fi, offset, length, entry if entry is not None and entry.length == length else None

    def read_range(t, fi, offset, length):
        """The tensor's values from its byte range."""
        return _view_external(t, 0, length, pf.read_range(fi, offset, length))

    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        fi, offset, length, entry = where(t)
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
            arrays[t.name] = read_range(t, fi, offset, length)
        t.CopyFrom(placeholder(t.name, arrays[t.name]))
    # (a walk over every attribute of every node: only where some tensor may name a file)
    for t in external_tensors(model) if attributes else ():
        if is_placeholder(t):  # (the main graph's, made above or by _placeholder_for)
            continue
        fi, offset, length, entry = where(t)
        if entry is not None and _plain_layout(t, entry.length):
            value = np.asarray(packed.get_tensor(entry.key)).reshape(list(t.dims))
        else:
            value = read_range(t, fi, offset, length)
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), t.name))


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
