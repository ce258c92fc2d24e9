"""The index's `ans` / `ans_shared` / `bytes` / `transpose` streams checked and built in C
(_planes.stream_ans) and in Python (format._stream), a file entry's cuts (_planes.check_cuts and
format._checked_cuts): the same records for a good index; for a damaged stream C declines
(returns None, leaves the chunk extents as they were) and _stream gives its own verdict, so every
damaged index is refused the same way with and without the C path."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from onnx import numpy_helper

from passes import CorruptFileError, SurgeonError
from onnxz_helpers import pack_and_read_index
from passes.onnxz import codecs, format as fmt

_planes = codecs._fast
pytestmark = pytest.mark.skipif(_planes is None or not hasattr(_planes, "stream_ans"), reason="_planes.stream_ans not built")


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """An index with `ans` streams (int8 of width 1, float32 with the sign move) and `ans_shared`
    ones (many small int8 and float32 tensors sharing tables), and a `bytes` skeleton."""
    tmp = tmp_path_factory.mktemp("streams")
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(rng.standard_normal((300, 200)).astype(np.float32), "big_f32"),
             numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 6, 90000)), -127, 127).astype(np.int8), "big_q")]
    for i in range(24):
        inits.append(numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 5, 1500)), -127, 127).astype(np.int8), f"q{i}"))
        inits.append(numpy_helper.from_array((rng.standard_normal(400) * 0.05).astype(np.float32), f"b{i}"))
    _, _, obj, header = pack_and_read_index(tmp, inits)
    codecs_used = {t["stream"]["codec"] for t in obj["tensors"] if t.get("stream")}
    assert {"ans", "ans_shared"} <= codecs_used, codecs_used
    return obj, header


def _records(index):
    out = [(ti, te.stream.codec, te.stream.params, te.stream.raw_length, te.stream.tables,
            [(c.offset, c.raw_length, c.planes, c.xxh3, c.spec) for c in te.stream.chunks])
           for ti, te in sorted(index.coded.items())]
    for f in index.files:
        out.append((f.skeleton.codec, [(c.offset, c.raw_length, c.planes, c.xxh3, c.spec) for c in f.skeleton.chunks]))
    return out


def _verdict(obj, header, monkeypatch, fast):
    monkeypatch.setattr(fmt, "_stream_ans", fast)
    try:
        return _records(fmt.parse_index(obj, header, 1 << 40))
    except SurgeonError as exc:
        return type(exc).__name__, str(exc)


def test_good_index_gives_the_records_of_the_python_path(index, monkeypatch):
    obj, header = index
    with_c = _verdict(obj, header, monkeypatch, _planes.stream_ans)
    assert with_c == _verdict(obj, header, monkeypatch, None)
    assert isinstance(with_c, list)


def test_c_builds_ans_bytes_and_transpose_streams_and_declines_other_codecs(index):
    obj, header = index
    resolved = {}
    ext = fmt._Extents(fmt.HEADER_SIZE, header.index_offset)
    tables = fmt._shared_tables(obj)
    built = {}
    for t in obj["tensors"]:
        s = t.get("stream")
        if s is None:
            continue
        got = _planes.stream_ans(s, ext.lo, ext.hi, ext.spans, resolved, fmt.Chunk, fmt.Stream,
                                 codecs.MAX_CHUNK_BYTES, codecs.MAX_CHUNK_BYTES + (1 << 16))
        if got is None:  # an ans_shared stream whose table list _stream has not resolved yet
            got = fmt._stream(s, ext, "t", tables, resolved)
        else:
            built[s["codec"]] = built.get(s["codec"], 0) + 1
        assert isinstance(got, fmt.Stream)
    assert built.get("ans") and built.get("ans_shared")
    # the `bytes` skeleton (and `transpose` streams: the same path) built in C too, as _stream builds it
    skeleton = obj["files"][0]["skeleton"]
    assert skeleton["codec"] == "bytes"
    spans = list(ext.spans)
    got = _planes.stream_ans(skeleton, ext.lo, ext.hi, ext.spans, resolved, fmt.Chunk, fmt.Stream, 1 << 26, (1 << 26) + 65536)
    assert type(got) is fmt.Stream and got.tables is None and all(c.spec is None for c in got.chunks)
    assert len(ext.spans) == len(spans) + len(got.chunks)
    again = fmt._Extents(fmt.HEADER_SIZE, header.index_offset)
    assert got == fmt._stream(copy.deepcopy(skeleton), again, "skeleton") and again.spans == ext.spans[len(spans):]
    transpose = dict(skeleton, codec="transpose", params={"width": 1, "cols": 2})
    if all(c[1] % 2 == 0 and c[1] for c in skeleton["chunks"]):
        got = _planes.stream_ans(transpose, ext.lo, ext.hi, [], resolved, fmt.Chunk, fmt.Stream, 1 << 26, (1 << 26) + 65536)
        assert got == fmt._stream(transpose, fmt._Extents(fmt.HEADER_SIZE, header.index_offset), "t")
    # any other codec: declined, the extents untouched
    spans = list(ext.spans)
    for other in ("planes", "fpairs", "narrow", "bpairs"):
        relabelled = dict(skeleton, codec=other, params={"width": 2})
        assert _planes.stream_ans(relabelled, ext.lo, ext.hi, ext.spans, resolved, fmt.Chunk, fmt.Stream, 1 << 26, (1 << 26) + 65536) is None
    assert ext.spans == spans


SKELETON_DAMAGES = [
    lambda s: s.pop("params"),  # absent: {} for _stream (C declines; the same record)
    lambda s: s.__setitem__("params", []),
    lambda s: s.__setitem__("codec", "transpose"),  # no width / cols
    lambda s: s.__setitem__("params", {"width": 3, "cols": 4}),
    lambda s: s.__setitem__("params", {"width": 1, "cols": 1}),
    lambda s: s.__setitem__("params", {"width": 1, "cols": True}),
    lambda s: (s.__setitem__("codec", "transpose"), s.__setitem__("params", {"width": 8, "cols": 1 << 20})),
    lambda s: (s.__setitem__("codec", "transpose"), s.__setitem__("params", {"width": 1, "cols": 7})),
    lambda s: s["chunks"][0].__setitem__(1, 0),
    lambda s: s["chunks"][0].__setitem__(1, 5),
    lambda s: s["chunks"][0].__setitem__(1, (64 << 20) + 1),
    lambda s: s["chunks"][0][2].append(3),
    lambda s: s["chunks"][0][2].__setitem__(0, 0),
    lambda s: s["chunks"][0].__setitem__(0, 3),
    lambda s: s["chunks"][0].__setitem__(3, -1),
]


@pytest.mark.parametrize("damage", range(len(SKELETON_DAMAGES)))
def test_each_damaged_skeleton_gets_the_python_verdict(index, monkeypatch, damage):
    """The skeleton (`bytes`; as `transpose` once relabelled) built in C or refused as _stream refuses it."""
    obj, header = index
    bad = copy.deepcopy(obj)
    SKELETON_DAMAGES[damage](bad["files"][0]["skeleton"])
    with_c = _verdict(bad, header, monkeypatch, _planes.stream_ans)
    assert with_c == _verdict(bad, header, monkeypatch, None)


CUT_DAMAGES = [
    lambda cuts: cuts[0].__setitem__(0, cuts[0][0] + 1),
    lambda cuts: cuts[0].__setitem__(1, cuts[0][1] - 1),
    lambda cuts: cuts[0].__setitem__(1, 0),
    lambda cuts: cuts[0].__setitem__(2, 10 ** 6),
    lambda cuts: cuts[0].__setitem__(2, -1),
    lambda cuts: cuts[0].__setitem__(0, True),
    lambda cuts: cuts[0].__setitem__(0, 1 << 63),
    lambda cuts: cuts[0].append(0),
    lambda cuts: cuts.__setitem__(0, tuple(cuts[0])),
    lambda cuts: cuts.reverse(),
    lambda cuts: cuts.append(list(cuts[-1])),
    lambda cuts: cuts.pop(),
    lambda cuts: cuts[-1].__setitem__(0, 1 << 40),
]


@pytest.mark.parametrize("damage", range(len(CUT_DAMAGES)))
def test_each_damaged_cut_list_gets_the_python_verdict(index, monkeypatch, damage):
    """A file entry's cuts checked in C (_planes.check_cuts) or by the Python loop: the same cuts for a
    good list; for a damaged one C declines and the loop gives its verdict."""
    obj, header = index
    bad = copy.deepcopy(obj)
    CUT_DAMAGES[damage](bad["files"][0]["cuts"])
    results = []
    for check in (_planes.check_cuts, None):
        monkeypatch.setattr(fmt, "_check_cuts", check)
        try:
            results.append([f.cuts for f in fmt.parse_index(bad, header, 1 << 40).files])
        except SurgeonError as exc:
            results.append((type(exc).__name__, str(exc)))
    assert results[0] == results[1] and isinstance(results[0], tuple)


def test_good_cuts_and_records_are_those_of_the_python_path(index, monkeypatch):
    obj, header = index
    monkeypatch.setattr(fmt, "_check_cuts", _planes.check_cuts)
    monkeypatch.setattr(fmt, "_record", _planes.record)
    fast = fmt.parse_index(obj, header, 1 << 40)
    monkeypatch.setattr(fmt, "_check_cuts", None)
    monkeypatch.setattr(fmt, "_record", None)
    slow = fmt.parse_index(obj, header, 1 << 40)
    assert [f.cuts for f in fast.files] == [f.cuts for f in slow.files]
    assert all(type(c) is tuple for f in fast.files for c in f.cuts)
    assert fast.coded == slow.coded and all(type(te) is fmt.TensorEntry for te in fast.coded.values())


def test_record_builds_the_dataclass_and_calls_any_other_class():
    made = _planes.record(fmt.Chunk, 1, 2, [3], 4, (1, 3, (3,), 4, 0))
    assert made == fmt.Chunk(1, 2, [3], 4, (1, 3, (3,), 4, 0)) and type(made) is fmt.Chunk
    calls = []

    class Plain:
        def __init__(self, *values):
            calls.append(values)

    assert type(_planes.record(Plain, 5, 6)) is Plain and calls == [(5, 6)]
    import dataclasses

    @dataclasses.dataclass
    class Checked:
        a: int

        def __post_init__(self):
            calls.append(self.a)

    assert _planes.record(Checked, 7) == Checked(7) and calls[-2:] == [7, 7]
    with pytest.raises(TypeError):
        _planes.record(fmt.Chunk, 1, 2)  # too few fields: the class is called, and refuses


def _first_stream(obj, codec):
    return next(t["stream"] for t in obj["tensors"] if t.get("stream") and t["stream"]["codec"] == codec)


DAMAGES = [
    ("ans", lambda s: s["params"].__setitem__("width", 3)),
    ("ans", lambda s: s["params"].__setitem__("width", True)),
    ("ans", lambda s: s["params"].__setitem__("sign", 1)),
    ("ans", lambda s: s["params"].__setitem__("pairs", True)),
    ("ans", lambda s: s["params"].__setitem__("pairs", "yes")),
    ("ans", lambda s: s.pop("params")),
    ("ans", lambda s: s.__setitem__("chunks", {})),
    ("ans", lambda s: s["chunks"][0].__setitem__(0, -1)),
    ("ans", lambda s: s["chunks"][0].__setitem__(0, 1 << 40)),
    ("ans", lambda s: s["chunks"][0].__setitem__(1, 0)),
    ("ans", lambda s: s["chunks"][0].__setitem__(1, 7)),
    ("ans", lambda s: s["chunks"][0].__setitem__(1, (64 << 20) + 1)),
    ("ans", lambda s: s["chunks"][0].__setitem__(3, -5)),
    ("ans", lambda s: s["chunks"][0].__setitem__(3, 1 << 64)),
    ("ans", lambda s: s["chunks"][0].__setitem__(3, 1.5)),
    ("ans", lambda s: s["chunks"][0][2].append(3)),
    ("ans", lambda s: s["chunks"][0][2].__setitem__(0, 0)),
    ("ans", lambda s: s["chunks"][0][2].__setitem__(0, False)),
    ("ans", lambda s: s["chunks"][0].pop()),
    ("ans", lambda s: s["chunks"].append(list(s["chunks"][0]))),  # the same bytes twice: chunks overlap
    ("ans_shared", lambda s: s["params"].__setitem__("tables", [-1] * len(s["params"]["tables"]))),
    ("ans_shared", lambda s: s["params"].__setitem__("tables", [99] + s["params"]["tables"][1:])),
    ("ans_shared", lambda s: s["params"].__setitem__("tables", [1 << 70] + s["params"]["tables"][1:])),
    ("ans_shared", lambda s: s["params"].__setitem__("tables", s["params"]["tables"] + [0])),
    ("ans_shared", lambda s: s["params"].__setitem__("pairs", False)),  # allowed: the same as absent
    ("ans_shared", lambda s: s["params"].__setitem__("pairs", True)),
    ("ans_shared", lambda s: s["chunks"][0][2].__setitem__(0, 0)),
]


@pytest.mark.parametrize("codec,damage", DAMAGES)
def test_each_damaged_stream_gets_the_python_verdict(index, monkeypatch, codec, damage):
    obj, header = index
    bad = copy.deepcopy(obj)
    damage(_first_stream(bad, codec))
    with_c = _verdict(bad, header, monkeypatch, _planes.stream_ans)
    assert with_c == _verdict(bad, header, monkeypatch, None)


def test_random_damage_gets_the_python_verdict(index, monkeypatch):
    obj, header = index
    rng = random.Random(17)
    values = [None, True, False, -2, -1, 0, 1, 2, 4, 8, 15, 1 << 62, (1 << 62) + 1, (1 << 64) - 1, 1 << 64, 0.5, "4", [], {}]
    refused = 0
    for _ in range(300):
        bad = copy.deepcopy(obj)
        s = rng.choice([t["stream"] for t in bad["tensors"] if t.get("stream")])
        where = rng.randrange(4)
        if where == 0:
            s["params"][rng.choice(["width", "sign", "pairs", "tables"])] = rng.choice(values + [[0, -1, -1, -1], [-1]])
        elif where == 1:
            c = rng.choice(s["chunks"])
            c[rng.randrange(4)] = rng.choice(values + [rng.randrange(1 << 20)])
        elif where == 2:
            planes = rng.choice(s["chunks"])[2]
            planes[rng.randrange(len(planes))] = rng.choice(values + [rng.randrange(1 << 17)])
        else:
            s["codec"] = rng.choice(["ans", "ans_shared", "bytes", "planes", 3])
        with_c = _verdict(bad, header, monkeypatch, _planes.stream_ans)
        assert with_c == _verdict(bad, header, monkeypatch, None)
        refused += isinstance(with_c, tuple)
    assert refused > 100


def test_python_path_is_used_without_the_extension(index, monkeypatch):
    obj, header = index
    monkeypatch.setattr(codecs, "_fast", None)
    assert fmt._stream_ans_fast() is None
    monkeypatch.setattr(codecs, "_fast", _planes)
    monkeypatch.setenv("ONNXZ_NO_STREAM_C", "1")
    assert fmt._stream_ans_fast() is None
    monkeypatch.delenv("ONNXZ_NO_STREAM_C")
    assert fmt._stream_ans_fast() is _planes.stream_ans


def test_damaged_stream_is_refused(index, monkeypatch):
    obj, header = index
    bad = copy.deepcopy(obj)
    _first_stream(bad, "ans")["chunks"][0][1] = 7
    monkeypatch.setattr(fmt, "_stream_ans", _planes.stream_ans)
    with pytest.raises(CorruptFileError):
        fmt.parse_index(bad, header, 1 << 40)
