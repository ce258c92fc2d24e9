"""The batch decoder reads `ans` chunks stored back to back in one pread (_ans.c READ_RUN): the
restored bytes are those of the model, and a damaged or cut-off chunk inside such a run is still
refused as that chunk, not as its neighbour."""
from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import numpy_helper

import passes
from passes import CorruptFileError
from onnxz_helpers import pack_and_read_index
from passes.onnxz import reader

pytestmark = pytest.mark.skipif(reader._decode_batch_c is None, reason="_planes.ans_decode_batch not built")


@pytest.fixture()
def packed(tmp_path):
    """A pack of 12 int8 tensors of 3-6 KB, each one small `ans` chunk: (model, pack, the chunks
    in file order as (offset, stored))."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 4, 3000 + 250 * i)), -127, 127).astype(np.int8), f"q{i}")
             for i in range(12)]
    src, dst, obj, _ = pack_and_read_index(tmp_path, inits)
    with reader.PackedFile(dst, threads=1) as pf:  # the chunks in the order they are decoded (the model's)
        chunks = [(src[2].offset, src[2].stored) for _, _, items in pf._windows(0, reader.WINDOW_BYTES)
                  for _, _, src in items if src[0] == "chunk" and src[2].spec is not None]
    assert len(chunks) >= 10
    # stored back to back in that order: one run for the batch decoder
    assert all(a[0] + a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert sum(s for _, s in chunks) <= reader.READ_RUN
    return src, dst, chunks


def test_chunks_read_in_one_run_restore_the_model(packed, tmp_path):
    src, dst, _ = packed
    out = passes.unpack(dst, tmp_path / "back.onnx", threads=1)
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("which", [0, 5, -1])
def test_damaged_chunk_inside_a_run_is_named(packed, tmp_path, which):
    _, dst, chunks = packed
    offset, stored = chunks[which]
    with reader.PackedFile(dst, threads=1) as pf:  # opened first: the index is read before the damage
        with open(dst, "r+b") as f:
            f.seek(offset + stored // 2)
            byte = f.read(1)
            f.seek(offset + stored // 2)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(CorruptFileError, match=f"chunk at {offset} fails its checksum"):
            pf.restore_file(0)


@pytest.mark.parametrize("which", [0, 5, -1])
def test_file_cut_inside_a_run_is_truncated_at_the_first_chunk_it_cuts(packed, which):
    _, dst, chunks = packed
    offset, stored = chunks[which]
    cut = offset + stored - 1  # this chunk's last byte gone, every chunk stored before it whole
    with reader.PackedFile(dst, threads=1) as pf:
        # the chunks in the order they are decoded (the model's): the first one the cut reaches is named
        order = [src[2] for _, _, items in pf._windows(0, reader.WINDOW_BYTES) for _, _, src in items if src[0] == "chunk"]
        first = next(c.offset for c in order if c.offset + c.stored > cut)
        pf.skeleton(0)  # (stored after the tensors: read now, kept)
        os.truncate(dst, cut)
        with pytest.raises(CorruptFileError, match=f"truncated .onnxz file: chunk at {first} runs past the end"):
            pf.restore_file(0)


def test_copy_runs_checks_every_run_before_copying():
    """_planes.copy_runs (the skeleton's runs of a restore window): copies each (dst, src, length)
    run; a run outside either buffer is refused before anything is written."""
    copy_runs = getattr(reader.codecs._fast, "copy_runs", None)
    if copy_runs is None:
        pytest.skip("_planes.copy_runs not built")
    dst, src = np.zeros(10, np.uint8), np.arange(1, 11, dtype=np.uint8)
    copy_runs(dst, src, [(0, 5, 3), (7, 0, 3), (3, 0, 0)])
    assert dst.tolist() == [6, 7, 8, 0, 0, 0, 0, 1, 2, 3]
    for bad in ([(0, 0, 1), (8, 0, 3)], [(0, 9, 2)], [(-1, 0, 1)], [(0, 0, -1)], [(0, 0, 11)]):
        before = dst.copy()
        with pytest.raises(ValueError, match="outside its buffers"):
            copy_runs(dst, src, bad)
        assert (dst == before).all()  # the good run before the bad one was not copied either
    with pytest.raises(TypeError):
        copy_runs(dst, src, [(0, 0)])
