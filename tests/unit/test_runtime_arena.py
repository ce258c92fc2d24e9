"""runtime_arena: small decoded / folded weights cut from shared chunks (huge pages), and
MemoryOwners, which finds the array holding a view's memory when `.base` no longer says."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest

import passes
from passes.runtime_arena import ALIGN, Arena, MemoryOwners, data_address
from passes.runtime_source import start_read

from test_runtime import conv_model, dense_model


def _span(array):
    start = data_address(array)
    return start, start + array.nbytes


def test_small_tensors_share_a_chunk_aligned_and_apart():
    arena = Arena(chunk_bytes=1 << 20, own_bytes=256 << 10)
    pieces = [arena.take(n) for n in (1000, 3, 70000, 64, 5)]
    spans = sorted(_span(p) for p in pieces)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start  # no two overlap
    assert all(data_address(p) % ALIGN == 0 for p in pieces)
    assert len({id(p.base) for p in pieces}) == 1  # one chunk
    for i, p in enumerate(pieces):  # writable, each its own bytes
        p[:] = i
    for i, p in enumerate(pieces):
        assert p.dtype == np.uint8 and p.flags.c_contiguous and (p == i).all()


def test_a_full_chunk_starts_another_and_large_tensors_get_their_own():
    arena = Arena(chunk_bytes=1 << 20, own_bytes=256 << 10)
    first = [arena.take(200 << 10) for _ in range(5)]  # 1000 KiB: fits one chunk
    sixth = arena.take(200 << 10)
    assert len({id(p.base) for p in first}) == 1 and sixth.base is not first[0].base
    large = arena.take(256 << 10)
    assert large.base is None and large.nbytes == 256 << 10  # (an array of its own)
    assert arena.take(0).nbytes == 0


def test_empty_gives_the_shape_and_type():
    arena = Arena()
    out = arena.empty((3, 5), np.float16)
    assert out.shape == (3, 5) and out.dtype == np.float16 and out.flags.writeable and out.flags.c_contiguous


def test_memory_owners_find_views_of_a_registered_array():
    arena = Arena(chunk_bytes=1 << 20)
    a, b = arena.take(4096), arena.take(4096)
    owners = MemoryOwners()
    owners.add(a, "a")
    owners.add(b, "b")
    # numpy points these at the chunk, not at a or b: found by address
    assert a.view(np.float32).reshape(32, 32).base is a.base
    assert owners.find(a.view(np.float32).reshape(32, 32)) == "a"
    assert owners.find(b[100:]) == "b" and owners.find(b) == "b"
    assert owners.find(np.zeros(8, np.uint8)) is None
    assert owners.find(np.zeros(8, np.uint8), "other") == "other"
    assert owners.find(b"not an array") is None
    owners.clear()
    assert owners.find(a) is None


def _vm_flags(array):
    """The VmFlags of the mapping holding `array`'s first byte (/proc/self/smaps), or None."""
    address = data_address(array)
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps")
def test_past_its_huge_page_budget_an_arena_hands_out_memory_without_huge_pages():
    """The first `huge_bytes` of fresh memory come as huge pages (numpy's own arrays, chunks advised
    MADV_HUGEPAGE); after them, mappings that refuse huge pages (MADV_NOHUGEPAGE: VmFlags nh)."""
    arena = Arena(chunk_bytes=1 << 20, own_bytes=256 << 10, huge_bytes=(1 << 20) + (512 << 10))
    within = arena.take(1 << 20)  # own array, inside the budget: np.empty as before
    assert within.base is None
    chunked = arena.take(1000)  # a 1 MiB chunk does not fit the 512 KiB left: no huge pages
    past = arena.take(300 << 10)  # own array past the budget
    flags = [_vm_flags(chunked), _vm_flags(past)]
    if None in flags:
        pytest.skip("no /proc/self/smaps")
    assert all("nh" in f and "hg" not in f for f in flags)
    for i, p in enumerate((within, chunked, past)):  # writable, zero cost until written
        p[:] = i + 1
        assert (p == i + 1).all() and p.flags.c_contiguous and p.dtype == np.uint8
    unlimited = Arena(chunk_bytes=1 << 20, own_bytes=256 << 10)  # the default budget: huge pages
    assert "hg" in (_vm_flags(unlimited.take(1000)) or {"hg"})


@pytest.mark.parametrize("build", [dense_model, conv_model])
def test_decode_aside_ranks_and_waits_for_views_of_its_outputs(tmp_path, build):
    """BackgroundDecode's outputs are cut from an Arena: the weights (reshaped, retyped views of
    them) are still found by ready() and order(); an array it did not decode is ready at once."""
    onnx.save(build(), str(tmp_path / "m.onnx"))
    passes.pack(str(tmp_path / "m.onnx"), str(tmp_path / "m.onnxz"))
    reading = start_read(tmp_path / "m.onnxz", background=True)
    split = reading.finish()
    decode = split.pending
    assert decode is not None
    ranks = sorted(decode.order(a) for a in split.weights.values() if a.nbytes > 1024)
    assert ranks and ranks[0] >= 0 and len(set(ranks)) == len(ranks)
    for array in split.weights.values():
        assert decode.ready(array)
    assert decode.order(np.zeros(4)) == -1 and decode.ready(np.zeros(4), block=False)
    split.wait_weights()
    synchronous = passes.runtime_source.read_split(tmp_path / "m.onnxz")
    for name, array in synchronous.weights.items():
        np.testing.assert_array_equal(split.weights[name], array)


@pytest.mark.parametrize("build", [dense_model, conv_model])
def test_decode_aside_without_shared_chunks_gives_each_weight_its_own_array(tmp_path, build):
    """shared_chunks=False (int8 mode, which drops some decoded weights and keeps others): no two
    weights share memory, so a dropped one's bytes go back; the values are the same."""
    onnx.save(build(), str(tmp_path / "m.onnx"))
    passes.pack(str(tmp_path / "m.onnx"), str(tmp_path / "m.onnxz"))
    split = start_read(tmp_path / "m.onnxz", background=True, shared_chunks=False).finish()
    split.wait_weights()
    owners = {}
    for name, array in split.weights.items():
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        assert id(base) not in owners, f"{name} shares memory with {owners.get(id(base))}"
        owners[id(base)] = name
    synchronous = passes.runtime_source.read_split(tmp_path / "m.onnxz")
    for name, array in synchronous.weights.items():
        np.testing.assert_array_equal(split.weights[name], array)


def _mapping_flags(array) -> str:
    """The permission field ('rw-p': private, 'rw-s': shared) of the mapping holding `array`."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms
    return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_restored_file_buffer_and_chunks_are_private_zeroed_memory():
    """A pack's restored model file (_sparse_zeros) and the arena's chunks live in private
    anonymous mappings (not shmem, whose pages fault slower), zero-filled and writable."""
    from passes.runtime_arena import anonymous_array
    from passes.runtime_source import _sparse_zeros

    for array in (_sparse_zeros(3 << 20), anonymous_array(5 << 20, huge_pages=True), Arena().take(1000).base):
        assert _mapping_flags(array) == "rw-p"
        assert not array.any()
        array[:10] = 7
        assert array[:10].sum() == 70
    assert _sparse_zeros(0).size == 0
