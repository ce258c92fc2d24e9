"""The index's tensor entries checked in C (_planes.index_rows) and in Python (format._rows_py,
where the extension was not built): the same rows for a good index, the same first failure and
message for every damaged entry, and parse_index refusing each with CorruptFileError."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import numpy_helper

from passes import CorruptFileError
from onnxz_helpers import pack_and_read_index
from passes.onnxz import codecs, format as fmt

_planes = codecs._fast
pytestmark = pytest.mark.skipif(_planes is None or not hasattr(_planes, "index_rows"), reason="_planes.index_rows not built")


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("idx")
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((40, 30)).astype(np.float32), "w"),
             numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 6, 9000)), -127, 127).astype(np.int8), "q"),
             numpy_helper.from_array(np.arange(6, dtype=np.int64).reshape(2, 3), "shape_like")]
    _, _, obj, header = pack_and_read_index(tmp, inits)
    return obj, header


def _both(tensors, last_file=0):
    c = _planes.index_rows(tensors, last_file, fmt._PAYLOAD_FIELDS)
    py = fmt._rows_py(tensors, last_file)
    assert c == py
    # the coded-only mode parse_index uses: the same verdict, the coded rows and each file's end
    coded = _planes.index_rows(tensors, last_file, fmt._PAYLOAD_FIELDS, True)
    if isinstance(c, str):
        assert coded == c
    else:
        ends = [max([r[6] + r[7] for r in c if r[5] == f], default=0) for f in range(last_file + 1)]
        assert coded == ([(i, r) for i, r in enumerate(c) if r[8] is not None], ends)
    return c


def test_rows_of_a_good_index_are_the_entries_fields(index):
    obj, header = index
    rows = _both(obj["tensors"])
    assert len(rows) == len(obj["tensors"]) >= 3
    for row, t in zip(rows, obj["tensors"]):
        assert row == (t["key"], t.get("name", ""), t["dtype"], t["shape"], t["field"], t["file"], t["offset"],
                       t["length"], t.get("stream"))
        assert row[3] is not t["shape"]  # a copy: the record never aliases the JSON
    parsed = fmt.parse_index(obj, header, 1 << 40)
    assert [t.key for t in parsed.tensors] == [t["key"] for t in obj["tensors"]]


DAMAGE = [
    (lambda t: t.pop("key"), "key/name/shape"),
    (lambda t: t.update(key=7), "key/name/shape"),
    (lambda t: t.update(name=None), "key/name/shape"),
    (lambda t: t.update(shape=(1, 2)), "key/name/shape"),
    (lambda t: t.update(shape=[1, True]), "dim = True"),
    (lambda t: t.update(shape=[1, 1 << 63]), "dim = "),
    (lambda t: t.update(shape=[-(1 << 62) - 1]), "dim = "),
    (lambda t: t.update(shape=[2.0]), "dim = 2.0"),
    (lambda t: t.update(field="bytes"), "field 'bytes'"),
    (lambda t: t.pop("field"), "field None"),
    (lambda t: t.update(length=-1), "tensor length = -1"),
    (lambda t: t.update(length=1 << 62 + 1), "tensor length = "),
    (lambda t: t.pop("length"), "tensor length = None"),
    (lambda t: t.update(dtype=(1 << 16) + 1), "dtype = 65537"),
    (lambda t: t.update(dtype=False), "dtype = False"),
    (lambda t: t.update(file=1), "tensor file = 1"),
    (lambda t: t.update(file=-1), "tensor file = -1"),
    (lambda t: t.update(offset="0"), "tensor offset = '0'"),
    (lambda t: t.update(offset=1 << 70), "tensor offset = "),
]


@pytest.mark.parametrize("at", [0, -1])
@pytest.mark.parametrize("damage,message", DAMAGE)
def test_each_damaged_entry_is_refused_the_same_way(index, damage, message, at):
    obj, header = index
    bad = copy.deepcopy(obj)
    damage(bad["tensors"][at])
    got = _both(bad["tensors"])
    assert isinstance(got, str) and message in got
    with pytest.raises(CorruptFileError, match="damaged .onnxz index"):
        fmt.parse_index(bad, header, 1 << 40)


def test_non_object_entry_and_repeated_key(index):
    obj, header = index
    bad = copy.deepcopy(obj)
    bad["tensors"].append([1, 2])
    assert _both(bad["tensors"]) == f"tensor {len(obj['tensors'])}"
    bad = copy.deepcopy(obj)
    bad["tensors"].append(copy.deepcopy(bad["tensors"][0]))
    assert _both(bad["tensors"]) == f"tensor key {obj['tensors'][0]['key']!r} repeated"
    with pytest.raises(CorruptFileError, match="repeated"):
        fmt.parse_index(bad, header, 1 << 40)


def test_python_rows_are_used_without_the_extension(index, monkeypatch):
    obj, header = index
    with_c = fmt.parse_index(obj, header, 1 << 40)
    monkeypatch.setattr(codecs, "_fast", None)
    without = fmt.parse_index(obj, header, 1 << 40)
    assert [(t.key, t.shape, t.offset, t.length, t.stream is None) for t in with_c.tensors] == \
        [(t.key, t.shape, t.offset, t.length, t.stream is None) for t in without.tensors]


def test_coded_rows_without_the_coded_only_mode_are_the_same(index, monkeypatch):
    """An extension built before coded_only (index_rows of three arguments): format._coded_rows
    makes the same pairs and file ends from the full rows; so does the Python twin."""
    obj, _ = index
    want = _planes.index_rows(obj["tensors"], 0, fmt._PAYLOAD_FIELDS, True)
    assert want[0] and len(want[0]) < len(obj["tensors"])  # coded and uncoded entries both

    class Older:
        @staticmethod
        def index_rows(tensors, last_file, fields, *more):
            if more:
                raise TypeError("index_rows() takes exactly 3 arguments (4 given)")
            return _planes.index_rows(tensors, last_file, fields)

    monkeypatch.setattr(codecs, "_fast", Older)
    assert fmt._coded_rows(obj["tensors"], 0) == want
    monkeypatch.setattr(codecs, "_fast", None)
    assert fmt._coded_rows(obj["tensors"], 0) == want


def test_entry_past_its_file_is_named_and_uncoded_records_match_the_index(index):
    obj, header = index
    parsed = fmt.parse_index(obj, header, 1 << 40)
    for rec, t in zip(parsed.tensors, obj["tensors"]):
        assert (rec.key, rec.name, rec.dtype, rec.shape, rec.field, rec.file, rec.offset, rec.length) == \
            (t["key"], t.get("name", ""), t["dtype"], t["shape"], t["field"], t["file"], t["offset"], t["length"])
        assert rec.shape is not t["shape"]  # a copy: the record never aliases the JSON
        assert (rec.stream is None) == (t.get("stream") is None)
    size = obj["files"][0]["size"]
    uncoded = [i for i, t in enumerate(obj["tensors"]) if t.get("stream") is None]
    for first in (uncoded[0], uncoded[-1]):
        bad = copy.deepcopy(obj)
        for i in (first, uncoded[-1]):  # two past the end: the first in index order is named
            bad["tensors"][i]["offset"] = size - bad["tensors"][i]["length"] + 1
        key = bad["tensors"][first]["key"]
        with pytest.raises(CorruptFileError, match=f"tensor {key!r} lies outside its file"):
            fmt.parse_index(bad, header, 1 << 40)
