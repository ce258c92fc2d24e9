"""The index's `ans` / `ans_shared` streams checked and built in C (_planes.stream_ans) and in
Python (format._stream): the same records for a good index; for a damaged stream C declines
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


def test_c_builds_ans_streams_and_declines_other_codecs(index):
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
    skeleton = obj["files"][0]["skeleton"]
    assert skeleton["codec"] != "ans"
    spans = list(ext.spans)
    assert _planes.stream_ans(skeleton, ext.lo, ext.hi, ext.spans, resolved, fmt.Chunk, fmt.Stream, 1 << 26, (1 << 26) + 65536) is None
    assert ext.spans == spans


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
