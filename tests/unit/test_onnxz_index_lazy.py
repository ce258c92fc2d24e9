"""format.Index makes the TensorEntry of a coded tensor while parsing (restoring reads those
only, through `coded`) and every other entry on the first use of `tensors`; the checks on all
entries still run while parsing."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
from onnx import numpy_helper

import passes
from passes import CorruptFileError
from onnxz_helpers import pack_and_read_index
from passes.onnxz import format as fmt
from passes.onnxz.reader import PackedFile


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lazy")
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "w"),
             numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 6, 9000)), -127, 127).astype(np.int8), "q")]
    inits += [numpy_helper.from_array(np.full(3, i, np.float32), f"small{i}") for i in range(20)]  # left in the skeleton
    return pack_and_read_index(tmp, inits)


def test_entries_match_the_json_and_coded_ones_are_the_same_objects(packed):
    _, _, obj, header = packed
    idx = fmt.parse_index(copy.deepcopy(obj), header, 1 << 40)
    wanted_coded = {i for i, t in enumerate(obj["tensors"]) if t["stream"] is not None}
    assert set(idx.coded) == wanted_coded and 2 <= len(wanted_coded) < len(obj["tensors"])
    entries = idx.tensors
    assert idx.tensors is entries  # made once
    for i, (e, t) in enumerate(zip(entries, obj["tensors"])):
        assert (e.key, e.name, e.dtype, e.shape, e.field, e.file, e.offset, e.length) == \
            (t["key"], t.get("name", ""), t["dtype"], t["shape"], t["field"], t["file"], t["offset"], t["length"])
        if i in wanted_coded:
            assert e is idx.coded[i] and e.stream.raw_length == e.length
        else:
            assert e.stream is None


def test_one_list_for_every_thread(packed):
    _, _, obj, header = packed
    idx = fmt.parse_index(copy.deepcopy(obj), header, 1 << 40)
    seen, start = [], threading.Barrier(4)

    def grab():
        start.wait()
        seen.append(idx.tensors)
    workers = [threading.Thread(target=grab) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(seen) == 4 and all(s is seen[0] for s in seen)


def test_unpack_and_load_restore_without_making_every_entry(packed, tmp_path):
    src, dst, _, _ = packed
    with PackedFile(dst, threads=1) as pf:
        restored = pf.restore_file(0)
        assert pf.index._tensors is None  # only the coded entries were read
        assert restored.tobytes() == src.read_bytes()
        assert pf.tensor("small3").stream is None  # asked for: made then
        assert pf.index._tensors is not None
    out = passes.unpack(dst, tmp_path / "r.onnx", threads=1)
    assert out.read_bytes() == src.read_bytes()


def _uncoded(obj):
    return next(i for i, t in enumerate(obj["tensors"]) if t["stream"] is None)


def test_checks_on_entries_that_are_not_made_still_run(packed):
    _, _, obj, header = packed
    bad = copy.deepcopy(obj)  # an uncoded tensor reaching past the end of its file
    i = _uncoded(bad)
    bad["tensors"][i]["offset"] = bad["files"][0]["size"] - 1
    key = bad["tensors"][i]["key"]
    with pytest.raises(CorruptFileError, match=f"tensor '{key}' lies outside its file"):
        fmt.parse_index(bad, header, 1 << 40)
    bad = copy.deepcopy(obj)  # a cut naming a tensor without a stream
    i = _uncoded(bad)
    bad["files"][0]["cuts"][0][2] = i
    key = bad["tensors"][i]["key"]
    with pytest.raises(CorruptFileError, match=f"does not match tensor '{key}'"):
        fmt.parse_index(bad, header, 1 << 40)
    bad = copy.deepcopy(obj)  # a coded tensor whose stream decodes to another length
    j = next(iter(i for i, t in enumerate(bad["tensors"]) if t["stream"] is not None))
    bad["tensors"][j]["length"] += 1
    with pytest.raises(CorruptFileError, match="stream decodes to"):
        fmt.parse_index(bad, header, 1 << 40)
