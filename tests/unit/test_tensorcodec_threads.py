"""decode_array on several threads: the C decoder's helper threads are kept between calls (a pool);
a call waits only for the helpers that joined it. Same output whichever way the work was shared:
calls from several Python threads at once (one gets the pool, the others start their own helpers),
many calls in a row with more threads than before (the pool grows), damaged blobs, and a decode in a
process forked after the pool was started (its child has no helpers)."""
import os
import threading

import numpy as np
import pytest

pytest.importorskip("numba")

from passes import CorruptFileError  # noqa: E402
from passes import tensorcodec as tc  # noqa: E402
from passes.tensorcodec import decode_array, encode_array  # noqa: E402

pytestmark = pytest.mark.skipif(tc._FAST is None, reason="the C decoder is not built")


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (0.05 * rng.laplace(size=shape)).astype(np.float32)


@pytest.fixture(scope="module")
def blobs():
    # 64 and 40 chunks: both threads of a 2-thread decode get vector lanes
    return [encode_array(_weights((1024, 640), seed=1), snr_db=30),
            encode_array(_weights((96, 64, 3, 3), seed=2), snr_db=40, form="rdo")]


def test_calls_in_a_row_with_more_threads_each_time(blobs):
    refs = [decode_array(b, threads=1) for b in blobs]
    for threads in (2, 3, 2, 4, 1, 3):
        for blob, ref in zip(blobs, refs):
            got = decode_array(blob, threads=threads)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), threads


def test_calls_from_several_python_threads_at_once(blobs):
    refs = [decode_array(b, threads=1) for b in blobs]
    errors, start = [], threading.Barrier(4)

    def run(i):
        try:
            start.wait()
            for k in range(12):
                j = (i + k) % len(blobs)
                got = decode_array(blobs[j], threads=2 + (k % 2))
                assert np.array_equal(got.view(np.uint32), refs[j].view(np.uint32)), (i, k)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_damaged_blob_fails_and_the_pool_still_decodes(blobs):
    blob = blobs[0]
    ref = decode_array(blob, threads=1)
    bad = bytearray(blob)
    mid = len(bad) // 2  # inside the entropy-coded words
    bad[mid:mid + 64] = bytes(64)
    import struct
    import zlib
    bad[-4:] = struct.pack("<I", zlib.crc32(bytes(bad[:-4])))
    with pytest.raises(CorruptFileError):
        decode_array(bytes(bad), threads=2)
    got = decode_array(blob, threads=2)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # (3.12+: the helpers)
def test_decode_in_a_forked_child(blobs):
    ref = decode_array(blobs[0], threads=2)  # the pool's helper is started in this process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no helper threads; its pool starts empty
        ok = 0
        try:
            got = decode_array(blobs[0], threads=2)
            ok = int(np.array_equal(got.view(np.uint32), ref.view(np.uint32)))
        finally:
            os.write(write, bytes([ok]))
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"\x01"
