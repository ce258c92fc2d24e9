"""Format 1.3's catalog (FORMAT.md 4.1): the entries of the tensors left in the skeleton are stored
apart from the index, checked (XXH3-64) when the file is opened and parsed only when the tensor
entries are asked for; an unpack never parses them. Same entries, order and bytes as a file
written without it; every damaged or inconsistent catalog refused with CorruptFileError."""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import xxhash
import zstandard as zstd
from onnx import TensorProto, helper, numpy_helper
from onnxz_helpers import pack_as

import passes
from passes import CorruptFileError, LimitExceededError, NewerFormatError
from passes.onnxz import format as fmt
from passes.onnxz.reader import PackedFile

RNG = np.random.default_rng(13)


def _model():
    w = RNG.standard_normal(3000).astype(np.float32)
    q = np.clip(np.round(RNG.standard_normal(4000) * 9), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(q, "q")]
    inits += [numpy_helper.from_array(np.full(3, i, np.float32), f"small{i}") for i in range(12)]  # skeleton
    inits.insert(1, numpy_helper.from_array(np.arange(5, dtype=np.int64), "shape_like"))  # between coded ones
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(w[:600].astype(np.float16)))
    tiny = helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.ones(2, np.float32)))
    g = helper.make_graph([const, tiny], "g", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT16, [600]),
                                                   helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])], inits)
    return helper.make_model(g)


def _pack(path, src, catalog=True):
    return pack_as(src, path, catalog=catalog)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("catalog")
    src = d / "m.onnx"
    src.write_bytes(_model().SerializeToString())
    return src, _pack(d / "new.onnxz", src), _pack(d / "old.onnxz", src, catalog=False)


def _fields(e):
    return (e.key, e.name, e.dtype, e.shape, e.field, e.file, e.offset, e.length, e.stream is None)


def _parts(data: bytes):
    """(header fields, index object, catalog items) of a 1.3 file."""
    fields = struct.unpack_from("<8sHHIQQQQI", data)
    ioff, ilen = fields[4], fields[5]
    obj = json.loads(zstd.ZstdDecompressor().decompress(data[ioff:ioff + ilen]))
    off, stored, raw, _ = obj["catalog"]
    return fields, obj, json.loads(zstd.ZstdDecompressor().decompress(data[off:off + stored]))


def _rebuild(data: bytes, mutate_index=None, mutate_items=None, catalog_frame=None, flags=None, raw=None) -> bytes:
    """The file with its catalog and/or index changed, every checksum (XXH3-64 of the catalog, index
    CRC, header CRC) valid again: the damage is in the content only."""
    fields, obj, items = _parts(data)
    off = obj["catalog"][0]
    if mutate_items is not None:
        items = mutate_items(items) or items
    text = json.dumps(items).encode()
    frame = catalog_frame if catalog_frame is not None else \
        zstd.ZstdCompressor(write_checksum=True, write_content_size=True).compress(text)
    obj["catalog"] = [off, len(frame), len(text) if raw is None else raw, xxhash.xxh3_64_intdigest(frame)]
    if mutate_index is not None:
        mutate_index(obj)
    itext = json.dumps(obj).encode()
    iframe = zstd.ZstdCompressor(write_checksum=True, write_content_size=True).compress(itext)
    ioff = off + len(frame)
    head = fmt.pack_header(ioff, len(iframe), len(itext), ioff + len(iframe), zlib.crc32(iframe), (1, 3),
                           fmt.FLAG_CATALOG if flags is None else flags)
    return head + data[64:off] + frame + iframe


def test_entries_order_and_bytes_equal_a_file_without_catalog(files, tmp_path):
    src, new, old = files
    with PackedFile(new) as a, PackedFile(old) as b:
        assert a.index.version == (1, 3) and b.index.version == (1, 2)
        assert a.index.catalog is not None and b.index.catalog is None
        assert 0 < len(a.index.coded) < len(a.index.tensors)
        assert [_fields(e) for e in a.index.tensors] == [_fields(e) for e in b.index.tensors]
        for e in a.index.tensors:
            assert a.tensor_bytes(e.key).tobytes() == b.tensor_bytes(e.key).tobytes()
    assert struct.unpack_from("<I", new.read_bytes(), 12)[0] == fmt.FLAG_CATALOG
    assert passes.verify(new).ok
    assert passes.unpack(new, tmp_path / "r.onnx").read_bytes() == src.read_bytes()
    model = passes.load(new)
    assert model.SerializeToString() == src.read_bytes()
    with passes.open_packed(new) as pm, passes.open_packed(old) as pm_old:
        assert pm.keys() == pm_old.keys() and len(pm.keys()) == 1 + 12 + 1 + 1 + 2
        for k in pm.keys():
            assert pm.get_tensor(k).tobytes() == pm_old.get_tensor(k).tobytes()
        assert pm.metadata()["format_version"] == "1.3"


def test_every_coded_file_stays_1_2(tmp_path):
    inits = [numpy_helper.from_array(RNG.standard_normal(2000).astype(np.float32), "w")]
    src = tmp_path / "m.onnx"
    src.write_bytes(helper.make_model(helper.make_graph([], "g", [], [], inits)).SerializeToString())
    with PackedFile(_pack(tmp_path / "m.onnxz", src)) as pf:
        assert pf.index.version == (1, 2) and pf.index.catalog is None and len(pf.index.tensors) == 1


def test_unpack_never_parses_the_catalog(files, tmp_path, monkeypatch):
    src, new, _ = files

    def refuse(self):
        raise AssertionError("catalog parsed")
    monkeypatch.setattr(fmt.Index, "_catalog_tensors", refuse)
    assert passes.unpack(new, tmp_path / "r.onnx", threads=1).read_bytes() == src.read_bytes()
    assert passes.unpack(new.read_bytes(), tmp_path / "r2.onnx", threads=2).read_bytes() == src.read_bytes()


def test_a_1_2_reader_refuses_it_as_newer(files, tmp_path, monkeypatch):
    _, new, _ = files
    monkeypatch.setattr(fmt, "FLAG_CATALOG", 0)  # a reader that knows no flag
    with pytest.raises(NewerFormatError, match="newer version"):
        PackedFile(new)


def test_index_entries_the_catalog_does_not_name_follow_its_own(files, tmp_path):
    src, new, _ = files
    data = new.read_bytes()
    _, obj, items = _parts(data)
    first = obj["tensors"][0]["key"]
    extra = {k: v for k, v in next(x for x in items if isinstance(x, dict)).items()}
    bad = tmp_path / "moved.onnxz"

    def move(o):  # an entry without a stream moved from the catalog into the index, and coded tensor 0 not named
        o["tensors"].append(dict(extra, stream=None))
    bad.write_bytes(_rebuild(data, mutate_index=move, mutate_items=lambda it: [x for x in it if x != 0 and x != extra]))
    keys = [e.key for e in _entries(bad)]
    want = [e.key for e in _entries(new)]
    assert sorted(keys) == sorted(want) and keys[-2:] == [first, extra["key"]]
    assert passes.unpack(bad, tmp_path / "r.onnx").read_bytes() == src.read_bytes()


def test_the_rebuilt_file_is_valid(files, tmp_path):
    src, new, _ = files
    bad = tmp_path / "same.onnxz"
    bad.write_bytes(_rebuild(new.read_bytes()))
    with PackedFile(bad) as pf:
        assert len(pf.index.tensors) == 17
    assert passes.verify(bad).ok


def _entries(path):
    with PackedFile(path) as pf:
        return pf.index.tensors


def _first_other(items):
    return next(i for i, it in enumerate(items) if isinstance(it, dict))


def _set(i, value):
    def change(items):
        items[i] = value
    return change


@pytest.mark.parametrize("mutate, message", [
    (lambda it: it.append(0), "catalog names tensor 0"),
    (lambda it: it.append(99), "catalog names tensor 99"),
    (lambda it: it.append(-1), "catalog names tensor -1"),
    (lambda it: it.append("w"), "catalog entry"),
    (lambda it: it.append(True), "catalog entry"),
    (lambda it: {"a": it}, "catalog"),
    (lambda it: it[_first_other(it)].update(stream={"codec": "bytes", "params": {}, "chunks": []}), "with a stream"),
    (lambda it: it[_first_other(it)].update(key="w"), "repeated"),
    (lambda it: it.append(dict(it[_first_other(it)])), "repeated"),
    (lambda it: it[_first_other(it)].update(offset=1 << 40), "lies outside its file"),
    (lambda it: it[_first_other(it)].update(file=1), "tensor file"),
    (lambda it: it[_first_other(it)].update(field="bogus"), "field"),
    (lambda it: it[_first_other(it)].update(shape=[1.5]), "dim"),
    (lambda it: it[_first_other(it)].pop("key") and None, "key/name/shape"),
])
def test_inconsistent_catalogs_are_refused_when_read(files, tmp_path, mutate, message):
    src, new, _ = files
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(_rebuild(new.read_bytes(), mutate_items=mutate))
    # restoring does not need the entries: the file still restores, and is refused where they are read
    assert passes.unpack(bad, tmp_path / "r.onnx").read_bytes() == src.read_bytes()
    with pytest.raises(CorruptFileError, match=message):
        _entries(bad)
    with pytest.raises(CorruptFileError):
        with passes.open_packed(bad) as pm:
            pm.keys()
    with pytest.raises(CorruptFileError, match=message):
        passes.verify(bad)


@pytest.mark.parametrize("case", ["not-zstd", "size-mismatch", "trailing", "bad-json"])
def test_unreadable_catalogs_are_refused(files, tmp_path, case):
    _, new, _ = files
    data = new.read_bytes()
    _, _, items = _parts(data)
    text = json.dumps(items).encode()
    frame = zstd.ZstdCompressor(write_checksum=True, write_content_size=True).compress(text)
    kw = {}
    if case == "not-zstd":
        kw["catalog_frame"] = b"\x01" * 40
    elif case == "size-mismatch":
        kw["catalog_frame"], kw["raw"] = frame, len(text) - 1
    elif case == "trailing":
        kw["catalog_frame"], kw["raw"] = frame + b"\0\0\0\0", len(text)
    else:
        bad_text = text[:-3]
        kw["catalog_frame"] = zstd.ZstdCompressor(write_checksum=True, write_content_size=True).compress(bad_text)
        kw["raw"] = len(bad_text)
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(_rebuild(data, **kw))
    with pytest.raises(CorruptFileError):
        _entries(bad)


@pytest.mark.parametrize("change, exc", [
    (lambda o: o.pop("catalog"), CorruptFileError),                       # flag without the key
    (lambda o: o.__setitem__("catalog", [64, 10, 20]), CorruptFileError),
    (lambda o: o.__setitem__("catalog", [64, 10, 20, "x"]), CorruptFileError),
    (lambda o: o["catalog"].__setitem__(0, 10), CorruptFileError),          # inside the header
    (lambda o: o["catalog"].__setitem__(0, 64), CorruptFileError),          # over the first chunk
    (lambda o: o["catalog"].__setitem__(1, 0), CorruptFileError),
    (lambda o: o["catalog"].__setitem__(1, 1 << 40), CorruptFileError),     # past the data area
    (lambda o: o["catalog"].__setitem__(2, 1), CorruptFileError),
    (lambda o: o["catalog"].__setitem__(2, 1 << 30), LimitExceededError),   # a bomb, refused unread
    (lambda o: o["catalog"].__setitem__(3, -1), CorruptFileError),
    (lambda o: o["catalog"].__setitem__(3, o["catalog"][3] ^ 1), CorruptFileError),  # checksum
    (lambda o: o["tensors"].append(dict(o["tensors"][0], key="w", stream=None)), CorruptFileError),  # key twice
])
def test_bad_catalog_references_are_refused_on_opening(files, tmp_path, change, exc):
    _, new, _ = files
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(_rebuild(new.read_bytes(), mutate_index=change))
    with pytest.raises(exc):
        PackedFile(bad)
    with pytest.raises(exc):
        passes.unpack(bad, tmp_path / "r.onnx")


def test_the_key_without_the_flag_is_refused(files, tmp_path):
    _, new, _ = files
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(_rebuild(new.read_bytes(), flags=0))
    with pytest.raises(CorruptFileError, match="catalog without its header flag"):
        PackedFile(bad)


def test_the_flag_on_a_file_without_catalog_is_refused(files, tmp_path):
    _, _, old = files
    data = bytearray(old.read_bytes())
    struct.pack_into("<I", data, 12, fmt.FLAG_CATALOG)
    struct.pack_into("<I", data, 60, zlib.crc32(bytes(data[:60])))
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(data)
    with pytest.raises(CorruptFileError, match="catalog"):
        PackedFile(bad)


def test_every_byte_flip_of_the_catalog_and_index_detected(files, tmp_path):
    src, new, _ = files
    data = new.read_bytes()
    _, obj, _ = _parts(data)
    cat = obj["catalog"][0]
    bad = tmp_path / "bad.onnxz"
    for pos in list(range(0, 64)) + list(range(cat, len(data))):
        damaged = bytearray(data)
        damaged[pos] ^= 0x41
        bad.write_bytes(damaged)
        with pytest.raises(CorruptFileError):  # on opening: header CRC, catalog XXH3-64, index CRC
            PackedFile(bad)
        with pytest.raises(CorruptFileError):
            passes.unpack(bad, tmp_path / "r.onnx", force=True)
