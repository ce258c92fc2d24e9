"""Hostile `.onnxz` files: crafted by hand, every checksum and length recomputed so that they pass
the integrity checks and reach the parser's validation (fuzz/mutators.write_with_index).

What must hold: a documented error (SurgeonError) or a correct result; sizes are checked before
anything is allocated; the caller's `max_bytes` cap holds; nothing outside the destination
folder is written and nothing outside the packed file is read.

Regression tests of findings fixed by the pack stage (commit e3f4442): the index bomb, unhashable
`field` values, shape products beyond int64, 'proto' entries reading ./ files through onnx's
external data, a trailing newline in a data file name, a symlinked subfolder in the destination,
bare OSError from unpack's folder creation.
"""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

import passes
from passes import CorruptFileError, LimitExceededError, NewerFormatError, SurgeonError

from fuzz.mutators import read_index, with_header, write_with_index, write_with_index_text

from ._audit import outside, recording_opens


@pytest.fixture
def base(samples):
    return samples["all_families"].packed


def _craft(tmp_path, packed, change, name="crafted.onnxz"):
    index, _ = read_index(packed)
    change(index)
    path = tmp_path / name
    path.write_bytes(write_with_index(packed, index))
    return path


def _every_reader(path, tmp_path):
    """Run every reader; return {api: exception or None}. Foreign exceptions are returned too."""
    results = {}

    def run(api, fn):
        try:
            fn()
            results[api] = None
        except Exception as exc:  # noqa: BLE001 - the caller inspects the class
            results[api] = exc

    run("load", lambda: passes.load(path, threads=1))

    def tensors():
        with passes.open_packed(path, threads=1) as pm:
            for k in pm.keys():
                pm.get_tensor(k)
            pm.metadata()

    run("get_tensor", tensors)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    run("unpack", lambda: passes.unpack(path, out / "m.onnx", threads=1, force=True))
    run("verify", lambda: passes.verify(path, threads=1))
    return results


def _assert_documented(results):
    foreign = {api: f"{type(e).__name__}: {e}" for api, e in results.items() if e is not None and not isinstance(e, SurgeonError)}
    assert not foreign, foreign


# ---------------------------------------------------------------------- format versions

def test_newer_major_version_says_so(tmp_path, base):
    path = tmp_path / "v2.onnxz"
    path.write_bytes(with_header(base, major=2))
    for api, exc in _every_reader(path, tmp_path).items():
        assert isinstance(exc, NewerFormatError), (api, exc)
        assert "newer version" in str(exc), str(exc)


def test_nonzero_flags_say_newer(tmp_path, base):
    path = tmp_path / "flags.onnxz"
    path.write_bytes(with_header(base, flags=1))
    for api, exc in _every_reader(path, tmp_path).items():
        assert isinstance(exc, NewerFormatError), (api, exc)


def test_newer_minor_version_still_reads(tmp_path, samples, base):
    path = tmp_path / "minor.onnxz"
    path.write_bytes(with_header(base, minor=7))
    with passes.open_packed(path, threads=1) as pm:
        for key, want in samples["all_families"].tensors.items():
            got = pm.get_tensor(key)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_unknown_codec_names_the_codec(tmp_path, base):
    def change(index):
        next(t for t in index["tensors"] if t.get("stream"))["stream"]["codec"] = "rans-v9"

    path = _craft(tmp_path, base, change)
    for api, exc in _every_reader(path, tmp_path).items():
        assert isinstance(exc, NewerFormatError), (api, exc)
        assert "rans-v9" in str(exc) and "newer version" in str(exc)


def test_index_format_field_newer(tmp_path, base):
    def change(index):
        index["format"] = [3, 0]

    path = _craft(tmp_path, base, change)
    for api, exc in _every_reader(path, tmp_path).items():
        assert isinstance(exc, NewerFormatError), (api, exc)


# ---------------------------------------------------------------------- limits

def _bomb(tmp_path, packed, declared):
    """A file whose model file claims `declared` bytes, its skeleton chunks zero-filled frames of
    64 MiB each (each compresses to a few KiB: a decompression bomb made only of valid parts)."""
    import zstandard as zstd

    from fuzz.mutators import HEADER_SIZE

    index, fields = read_index(packed)
    chunk = 64 << 20
    frame = zstd.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(bytes(chunk))
    n = declared // chunk
    body = frame * n
    f0 = index["files"][0]
    f0["size"] = n * chunk
    f0["cuts"] = []
    f0["skeleton"] = {"codec": "bytes", "params": {}, "chunks": [[HEADER_SIZE + i * len(frame), chunk, [len(frame)]] for i in range(n)]}
    index["files"] = [f0]
    index["tensors"] = []
    path = tmp_path / "bomb.onnxz"
    path.write_bytes(write_with_index(packed, index, body=body))
    return path


def test_user_cap_on_restored_size_is_checked_before_allocating(tmp_path, base):
    path = _bomb(tmp_path, base, 4 << 30)  # 4 GiB declared
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        for fn in (lambda: passes.load(path, max_bytes=1 << 20), lambda: passes.open_packed(path, max_bytes=1 << 20),
                   lambda: passes.unpack(path, tmp_path / "x.onnx", max_bytes=1 << 20),
                   lambda: passes.verify(path, max_bytes=1 << 20)):
            with pytest.raises(LimitExceededError):
                fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak} bytes allocated before refusing"
    assert not (tmp_path / "x.onnx").exists()


def test_cap_zero_refuses_everything(tmp_path, base):
    path = tmp_path / "a.onnxz"
    path.write_bytes(base)
    with pytest.raises(LimitExceededError):
        passes.open_packed(path, max_bytes=0)


def test_index_decompression_bomb_is_refused_before_decoding(tmp_path, base):
    import json

    index, _ = read_index(base)
    text = json.dumps(index).encode() + b" " * (100 << 20)   # 100 MiB of valid JSON whitespace
    path = tmp_path / "index-bomb.onnxz"
    path.write_bytes(write_with_index_text(base, text, level=19))
    assert path.stat().st_size < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises((LimitExceededError, CorruptFileError)):
            passes.open_packed(path, threads=1, max_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20


# ---------------------------------------------------------------------- crafted index entries

@pytest.mark.parametrize("value", [[1], {"a": 1}])
def test_unhashable_field_value(tmp_path, base, value):
    def change(index):
        index["tensors"][0]["field"] = value

    _assert_documented(_every_reader(_craft(tmp_path, base, change), tmp_path))


def test_shape_whose_product_overflows(tmp_path, base):
    def change(index):
        index["tensors"].append({"key": "ov", "name": "ov", "dtype": 1, "shape": [1 << 62, 4], "field": "raw_data",
                                 "file": 0, "offset": 0, "length": 0, "stream": None})

    _assert_documented(_every_reader(_craft(tmp_path, base, change), tmp_path))


@pytest.mark.parametrize("change", [
    lambda t: t.update(dtype=8),                  # string
    lambda t: t.update(dtype=0),                  # undefined
    lambda t: t.update(dtype=65535),
    lambda t: t.update(shape=[1 << 31, 1 << 31]),
    lambda t: t.update(shape=[-1]),
    lambda t: t.update(shape=[0] * 70),
    lambda t: t.update(shape=[3, 5]),             # element count differs from the payload
    lambda t: t.update(field="int64_data"),
    lambda t: t.update(field="double_data"),
    lambda t: t.update(key="f32"),                # duplicate key
], ids=["string", "undefined", "dtype65535", "huge-dims", "negative-dim", "70-zero-dims", "wrong-count",
        "as-varints", "as-doubles", "duplicate-key"])
def test_tensor_entry_lies_about_its_payload(tmp_path, base, change):
    def apply(index):
        for t in index["tensors"]:
            if t["key"] == "i16":
                change(t)

    _assert_documented(_every_reader(_craft(tmp_path, base, apply), tmp_path))


@pytest.mark.parametrize("text", [
    b"[" * 100000 + b"]" * 100000,          # nesting beyond the JSON parser's recursion
    b'{"format": [1, 0], "files": [], "tensors": []}',
    b'{"format": [1, 0], "files": [{"size": ' + b"9" * 5000 + b"}], \"tensors\": []}",  # int beyond Python's limit
    b"\xff\xfe not utf-8",
    b"null",
    b'{"format": [1, 0], "files": "x", "tensors": {}}',
])
def test_malformed_index_json(tmp_path, base, text):
    path = tmp_path / "bad-index.onnxz"
    path.write_bytes(write_with_index_text(base, text))
    for api, exc in _every_reader(path, tmp_path).items():
        assert isinstance(exc, CorruptFileError), (api, exc)


def test_proto_entry_cannot_read_files_outside(tmp_path, samples, monkeypatch):
    from onnx import TensorProto, helper, numpy_helper

    evil = TensorProto(name="evil", data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    evil.dims[:] = [4]
    entry = evil.external_data.add()
    entry.key, entry.value = "location", "secret.bin"
    evil_bytes = evil.SerializeToString()
    w = numpy_helper.from_array(np.arange(64, dtype=np.float32), "W")
    graph = helper.make_graph([helper.make_node("Identity", ["W"], ["Y"])], "g", [],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [64])], [w])
    model = helper.make_model(graph)
    model.doc_string = evil_bytes.decode("utf-8")  # the attacker's bytes, anywhere in the model file
    src = tmp_path / "m.onnx"
    src.write_bytes(model.SerializeToString())
    packed_path = tmp_path / "m.onnxz"
    passes.pack(src, packed_path)
    offset = src.read_bytes().find(evil_bytes)

    def change(index):
        index["tensors"].append({"key": "evil", "name": "evil", "dtype": 1, "shape": [4], "field": "proto",
                                 "file": 0, "offset": offset, "length": len(evil_bytes), "stream": None})

    path = _craft(tmp_path, packed_path.read_bytes(), change, "evil.onnxz")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "secret.bin").write_bytes(np.array([1, 2, 3, 4], np.float32).tobytes())
    monkeypatch.chdir(cwd)
    # (onnx reads external data in C++: no Python audit event, so the proof is the value itself)
    with passes.open_packed(path, threads=1) as pm:
        try:
            got = pm.get_tensor("evil")
        except SurgeonError:
            return
    assert got.tobytes() != (cwd / "secret.bin").read_bytes(), "get_tensor returned the bytes of ./secret.bin"


# ---------------------------------------------------------------------- unpack destinations

def _rename_data_file(tmp_path, samples, new_name):
    def change(index):
        index["files"][1]["name"] = new_name

    return _craft(tmp_path, samples["external_data"].packed, change, "renamed.onnxz")


@pytest.mark.parametrize("name", ["../evil.bin", "/tmp/evil.bin", "a/../../evil.bin", "./x", "a//b", "C:evil", "a\\..\\x", "x\ty"])
def test_unpack_refuses_names_leaving_the_folder(tmp_path, samples, name):
    path = _rename_data_file(tmp_path, samples, name)
    out = tmp_path / "dest"
    out.mkdir()
    before = set(os.listdir(tmp_path))
    with pytest.raises(CorruptFileError):
        passes.unpack(path, out / "m.onnx")
    assert set(os.listdir(tmp_path)) == before
    assert list(out.iterdir()) == []


def test_unpack_refuses_trailing_newline_in_name(tmp_path, samples):
    path = _rename_data_file(tmp_path, samples, "x\n")
    out = tmp_path / "dest"
    out.mkdir()
    with pytest.raises(CorruptFileError):
        passes.unpack(path, out / "m.onnx")


def test_unpack_does_not_follow_a_symlinked_subfolder(tmp_path, samples):
    path = _rename_data_file(tmp_path, samples, "sub/w.bin")
    out = tmp_path / "dest"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "sub")
    try:
        passes.unpack(path, out / "m.onnx")
    except SurgeonError:
        pass
    assert list(elsewhere.iterdir()) == [], "unpack wrote through a symlink outside its destination folder"


@pytest.mark.parametrize("obstacle", ["file", "long"])
def test_unpack_subfolder_obstacles_are_documented_errors(tmp_path, samples, obstacle):
    name = "sub/w.bin" if obstacle == "file" else ("d" * 300) + "/w.bin"
    path = _rename_data_file(tmp_path, samples, name)
    out = tmp_path / "dest"
    out.mkdir()
    if obstacle == "file":
        (out / "sub").write_bytes(b"a regular file where a folder is needed")
    try:
        passes.unpack(path, out / "m.onnx")
    except SurgeonError:
        pass
    except OSError as exc:
        pytest.fail(f"bare {type(exc).__name__}: {exc}")
    assert not (out / "m.onnx").exists() or (out / "m.onnx").read_bytes() == samples["external_data"].files[""]


def test_readers_open_nothing_but_the_packed_file(tmp_path, samples):
    """load / open_packed / verify read only the .onnxz (and verify --against its originals)."""
    src = tmp_path / "p" / "m.onnxz"
    src.parent.mkdir()
    src.write_bytes(samples["external_data"].packed)
    with recording_opens() as opened:
        passes.load(src)
        with passes.open_packed(src) as pm:
            for k in pm.keys():
                pm.get_tensor(k)
        passes.verify(src)
    assert not outside(opened, src.parent), outside(opened, src.parent)


def test_inference_session_takes_a_restored_size_cap(tmp_path, base):
    path = _bomb(tmp_path, base, 1 << 30)
    with pytest.raises(LimitExceededError):
        passes.InferenceSession(path, max_bytes=1 << 20)


def test_command_takes_a_restored_size_cap(tmp_path, base, capsys):
    from tools.surgeon_compress import main

    path = _bomb(tmp_path, base, 1 << 30)
    code = main(["unpack", str(path), "-o", str(tmp_path / "x.onnx"), "--max-bytes", "1048576"])
    err = capsys.readouterr().err
    assert code not in (0, 2) and "limit" in err, (code, err)
    assert not (tmp_path / "x.onnx").exists()
