"""passes.encode_array / decode_array: round trips within the requested error, exact layout,
clear errors on bad input and on damaged blobs."""
import numpy as np
import pytest

pytest.importorskip("numba")

from passes import CorruptFileError, InvalidArgumentError, NewerFormatError  # noqa: E402
from passes.tensorcodec import FORMS, decode_array, encode_array  # noqa: E402


def _snr(w, w_hat):
    w = w.astype(np.float64)
    err = ((w - w_hat.astype(np.float64)) ** 2).sum()
    return np.inf if err == 0 else 10 * np.log10((w * w).sum() / err)


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    # rows of different scale, heavy tails: like trained weights
    w = rng.laplace(size=shape) * rng.uniform(0.2, 2.0, size=(shape[0],) + (1,) * (len(shape) - 1))
    return (0.05 * w).astype(np.float32)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(48, 32, 3, 3), (70, 130), (1000,)])
def test_snr_target_met_and_shape_kept(form, shape):
    w = _weights(shape)
    for target in (12.0, 30.0):
        blob = encode_array(w, snr_db=target, form=form)
        out = decode_array(blob)
        assert out.shape == w.shape and out.dtype == np.float32
        s = _snr(w, out)
        assert target <= s < target + 1.0  # the coarsest step meeting the target
        assert encode_array(w, snr_db=target, form=form) == blob  # deterministic


def test_rate_falls_with_snr_and_beats_float():
    w = _weights((64, 64, 3, 3))
    sizes = [len(encode_array(w, snr_db=s)) for s in (10, 20, 30, 40)]
    assert sizes == sorted(sizes)
    assert sizes[1] * 8 / w.size < 4.5  # 20 dB: well under 5 bits per weight


def test_dependent_quantization_beats_scalar_at_equal_snr():
    w = _weights((96, 256), seed=3)
    tcq = len(encode_array(w, snr_db=25, form="tcq"))
    nearest = len(encode_array(w, snr_db=25, form="nearest", contexts="none"))
    assert tcq < 0.98 * nearest


@pytest.mark.parametrize("form", ["nearest", "rdo"])
def test_bits_bounds_the_number_of_levels(form):
    w = _weights((40, 50))
    snrs = []
    for bits in (2, 4, 8):
        out = decode_array(encode_array(w, bits=bits, form=form))
        assert len(np.unique(out)) <= 2 ** bits - 1
        snrs.append(_snr(w, out))
    assert snrs[0] + 8 < snrs[1] and snrs[1] + 18 < snrs[2]


def test_float16_float64_and_special_shapes():
    w16 = _weights((30, 40)).astype(np.float16)
    out = decode_array(encode_array(w16, snr_db=30))
    assert out.dtype == np.float16 and out.shape == w16.shape and _snr(w16, out) >= 29.9
    w64 = _weights((100,)).astype(np.float64)
    assert decode_array(encode_array(w64, snr_db=20)).dtype == np.float64
    for w in (np.zeros((0, 5), np.float32), np.zeros((7, 3), np.float32), np.float32(1.5).reshape(())):
        out = decode_array(encode_array(w, snr_db=40))
        assert out.shape == w.shape
        assert _snr(w, out) >= 40 or not w.any() and not out.any()


def test_decode_into_given_buffer_and_threads():
    w = _weights((200, 700))  # several chunks
    blob = encode_array(w, snr_db=25)
    ref = decode_array(blob, threads=1)
    buf = np.empty(w.shape, np.float32)
    got = decode_array(blob, out=buf, threads=2)
    assert got is buf and np.array_equal(ref, buf)
    with pytest.raises(InvalidArgumentError):
        decode_array(blob, out=np.empty(5, np.float32))


@pytest.mark.parametrize("kwargs", [
    dict(snr_db=0), dict(snr_db=float("nan")), dict(bits=1), dict(bits=20), dict(bits=4.0),
    dict(snr_db=20, bits=4), dict(form="kmeans"), dict(contexts="all"), dict(lam=-1.0),
])
def test_bad_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        encode_array(_weights((10, 10)), **kwargs)


def test_bad_arrays():
    with pytest.raises(InvalidArgumentError):
        encode_array(np.arange(10))
    with pytest.raises(InvalidArgumentError):
        encode_array(np.array([1.0, np.nan], np.float32))


def test_damaged_blobs_raise_corrupt():
    w = _weights((64, 80))
    blob = encode_array(w, snr_db=20)
    with pytest.raises(CorruptFileError):
        decode_array(blob[:-1])
    with pytest.raises(CorruptFileError):
        decode_array(b"XXXX" + blob[4:])
    with pytest.raises(CorruptFileError):
        decode_array(b"")
    rng = np.random.default_rng(0)
    for pos in rng.integers(0, len(blob), 40):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CorruptFileError):
            decode_array(bytes(bad))
    newer = bytearray(blob)
    newer[4] = 99
    with pytest.raises(NewerFormatError):
        decode_array(bytes(newer))


def test_public_names():
    import passes

    assert passes.encode_array is encode_array and passes.decode_array is decode_array


# ---------------------------------------------------------------------------------------------
# the C decoder (passes/_tcodec.c) against the numba one (the fallback): same values, same refusals

def _numba_decode(blob, **kw):
    import passes.tensorcodec as tc

    saved = tc._FAST
    tc._FAST = None
    try:
        return tc.decode_array(blob, **kw)
    finally:
        tc._FAST = saved


def _fast_or_skip():
    import passes.tensorcodec as tc

    if tc._FAST is None:
        pytest.skip("the C decoder passes._tcodec was not built")
    return tc


@pytest.mark.parametrize("shape,kwargs", [
    ((48, 32, 3, 3), dict(snr_db=30)),                          # conv kernels, trellis
    ((40, 24, 5, 5), dict(snr_db=20, form="rdo")),              # 25 taps: position classes
    ((300, 700), dict(snr_db=25)),                              # several chunks, row classes
    ((3000,), dict(snr_db=35, form="nearest")),                 # one unit
    ((64, 96), dict(bits=16, form="nearest")),                  # magnitudes >= 256 (computed values)
    ((64, 96), dict(bits=14)),                                  # same, trellis
    ((5, 1), dict(snr_db=40)),                                  # one-element units
])
def test_c_decoder_equals_numba_decoder(shape, kwargs):
    tc = _fast_or_skip()
    w = _weights(shape, seed=5)
    blob = encode_array(w, **kwargs)
    ref = _numba_decode(blob, threads=1)
    saved = tc.LANES, tc.SIMD
    try:
        for threads in (1, 2, 3):
            tc.SIMD = 0  # the scalar lanes
            for lanes in (1, 2, 3, 4):
                tc.LANES = lanes
                got = decode_array(blob, threads=threads)
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (threads, lanes)
            tc.LANES = saved[0]
            for simd in (1, 5, 1 + 16, 1 + 32):  # vector lanes always, down to 5 chunks per thread;
                # +16: every token's raw bits read the way the rare > 25-bit ones are (8-byte reads);
                # +32: the AVX2 lanes also where the CPU has AVX-512
                tc.SIMD = simd
                got = decode_array(blob, threads=threads)
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (threads, simd)
    finally:
        tc.LANES, tc.SIMD = saved


def _words_offset(blob) -> int:
    """Byte offset of a blob's rANS words (after the header, the shape, the zlib side information
    and the word count)."""
    import passes.tensorcodec as tc

    ndim = blob[6]
    pos = 8 + 8 * ndim
    side_len = tc._HEAD.unpack_from(blob, pos)[41]
    return pos + tc._HEAD.size + side_len + 8


def test_c_decoder_reads_the_words_in_place_at_an_odd_offset():
    """The zlib side information before the words has any length, so the words may start at an odd
    byte offset: the C decoder reads them in place there too (no aligned copy), with the scalar
    and the vector lanes, to the numba decoder's values (which gets an aligned copy)."""
    tc = _fast_or_skip()
    seen = {}
    for seed in range(12):  # a blob of each parity (the side information's length varies with the data)
        blob = encode_array(_weights((64, 48, 3, 3), seed=seed), snr_db=30)
        seen.setdefault(_words_offset(blob) % 2, blob)
        if len(seen) == 2:
            break
    assert set(seen) == {0, 1}
    fast, saved = tc._FAST, tc.SIMD
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(fast, name)

        def decode(self, *args):
            calls.append(args[0])
            return fast.decode(*args)

    try:
        tc._FAST = Spy()
        for parity, blob in seen.items():
            ref = _numba_decode(blob, threads=1)
            for simd in (0, 1):
                tc.SIMD = simd
                calls.clear()
                got = decode_array(blob, threads=2)
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (parity, simd)
                words = calls[0]
                assert words.base is blob and words.ctypes.data % 2 == parity, (parity, simd)  # in place
    finally:
        tc._FAST, tc.SIMD = fast, saved


def test_c_crc32_equals_zlib():
    import zlib

    tc = _fast_or_skip()
    if not hasattr(tc._FAST, "crc32"):
        pytest.skip("no carry-less multiply on this CPU: decode_array uses zlib.crc32")
    rng = np.random.default_rng(2)
    for n in list(range(0, 140)) + [255, 4096, 65536 + 13, (1 << 20) + 5]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tc._FAST.crc32(data) == zlib.crc32(data), n
        assert tc._FAST.crc32(memoryview(data)[3:]) == zlib.crc32(data[3:]), n


def test_vector_lanes_hand_over_to_scalar_lanes_mid_chunk():
    """5 chunks, the last shorter: the vector lanes decode all five until the short one ends, then
    the scalar lanes finish the other four from where the vector lanes stopped."""
    tc = _fast_or_skip()
    w = _weights((105, 700), seed=9)  # chunks of 23 rows: 23, 23, 23, 23, 13
    for kwargs in (dict(snr_db=30), dict(bits=12, form="nearest")):
        blob = encode_array(w, **kwargs)
        ref = _numba_decode(blob, threads=1)
        saved = tc.SIMD
        try:
            for simd in (0, 1, 5, 5 + 32):
                tc.SIMD = simd
                got = decode_array(blob, threads=1)
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), simd
        finally:
            tc.SIMD = saved


def test_c_decoder_refuses_what_numba_refuses():
    """Blobs with a valid CRC but damaged entropy-coded data (crafted): both decoders refuse the
    same ones or return the same values."""
    import struct
    import zlib

    tc = _fast_or_skip()
    saved = tc.SIMD
    w = _weights((120, 400), seed=7)
    blob = encode_array(w, snr_db=25)
    rng = np.random.default_rng(1)
    refused = 0
    for i in range(150):
        body = bytearray(blob[:-4])
        # the streams are the tail; the header and side information are before
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(len(body) // 4, len(body)))
            body[pos] ^= 1 << int(rng.integers(0, 8))
        bad = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
        outcomes = []
        for decode, simd in ((decode_array, 0), (decode_array, 1), (decode_array, 1 + 32), (_numba_decode, 0)):
            tc.SIMD = simd  # scalar lanes, vector lanes (AVX-512 where the CPU has it), AVX2 lanes
            try:
                outcomes.append(decode(bad, threads=2).view(np.uint32))
            except CorruptFileError:
                outcomes.append(None)
            finally:
                tc.SIMD = saved
        if any(o is None for o in outcomes):
            assert all(o is None for o in outcomes), i
            refused += 1
        else:
            assert all(np.array_equal(o, outcomes[-1]) for o in outcomes[:-1]), i
    assert refused > 100  # nearly every damaged stream is caught by the final state / length checks


def _with_side(blob, side: bytes) -> bytes:
    """The blob with other (uncompressed) side information: recompressed, its length and the CRC
    rewritten (a crafted blob that passes the checksum)."""
    import struct
    import zlib

    import passes.tensorcodec as tc

    head_at = 8 + 8 * blob[6]
    vals = list(tc._HEAD.unpack_from(blob, head_at))
    old_len = vals[41]
    packed = zlib.compress(side)
    vals[41] = len(packed)
    start = head_at + tc._HEAD.size
    body = blob[:head_at] + tc._HEAD.pack(*vals) + packed + blob[start + old_len:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_damaged_context_records_are_refused_by_both_decoders():
    """The context records (u8 n_tokens, u16 freq[n_tokens] each, between the classes and the chunk
    table) are read by the C decoder as they are in the blob: a count beyond the tokens, records
    that end before or run past the chunk table, frequencies that do not sum to 4096 are refused
    like the numba decoder refuses them (CorruptFileError); the records untouched decode."""
    import zlib

    import passes.tensorcodec as tc

    _fast_or_skip()
    blob = encode_array(_weights((48, 32, 3, 3), seed=3), snr_db=30)
    head_at = 8 + 8 * blob[6]
    vals = tc._HEAD.unpack_from(blob, head_at)
    start = head_at + tc._HEAD.size
    side = zlib.decompress(blob[start:start + vals[41]])
    n_row, n_pos, n_chunks = vals[5], vals[6], vals[40]
    assert n_row == 1 and n_pos == 1  # (the records start the side information)
    tables_end = len(side) - 4 * (3 * n_chunks + 1)
    nt = side[0]
    assert nt > 1
    same = _with_side(blob, side)
    assert np.array_equal(decode_array(same), decode_array(blob))
    first_freq = int.from_bytes(side[1:3], "little")
    damaged = {
        "count beyond the tokens": bytes([233]) + side[1:],
        "records end before the chunk table": side[:tables_end] + b"\x00" + side[tables_end:],
        "records run into the chunk table": bytes([nt + 1]) + side[1:],
        "frequencies do not sum to 4096": side[:1] + (first_freq ^ 1).to_bytes(2, "little") + side[3:],
    }
    for what, bad_side in damaged.items():
        bad = _with_side(blob, bad_side)
        for decode in (decode_array, _numba_decode):
            with pytest.raises(CorruptFileError):
                decode(bad, threads=2)
                pytest.fail(f"{what}: decoded by {decode.__name__}")


def test_numba_fallback_round_trips():
    w = _weights((30, 16, 3, 3))
    blob = encode_array(w, snr_db=30)
    out = _numba_decode(blob, threads=2)
    assert _snr(w, out) >= 30 and np.array_equal(out, decode_array(blob))


def test_bad_thread_count():
    blob = encode_array(_weights((10, 10)), snr_db=20)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            decode_array(blob, threads=bad)


def test_layouts_with_large_decode_tables_only_for_a_clear_gain():
    """A layout whose decode table exceeds DECODE_TABLE_BUDGET is chosen only when its estimate
    is at least LARGE_TABLE_GAIN below the best layout within the budget."""
    from passes import tensorcodec as tc

    def layout(nb_ctx, n_row):  # with dependent quantization: 2 * nb_ctx contexts per row class
        return tc._Layout(9, 4, nb_ctx, np.zeros(4, np.uint8), n_row, np.zeros(9, np.uint8), 1, 1.0, True)

    one, small, big = layout(1, 1), layout(8, 1), layout(8, 4)  # 2, 16 and 64 contexts
    assert tc._decode_table_bytes(small) <= tc.DECODE_TABLE_BUDGET < tc._decode_table_bytes(big)
    gain = tc.LARGE_TABLE_GAIN
    assert tc._cheapest_to_decode([(110.0, one), (100.0, small), (100.0 * (1 - gain / 2), big)]) is small
    assert tc._cheapest_to_decode([(110.0, one), (100.0, small), (100.0 * (1 - 2 * gain), big)]) is big
    assert tc._cheapest_to_decode([(90.0, one), (100.0, small), (95.0, big)]) is one


def test_many_chunks_come_in_multiples_of_chunks_wanted():
    """Beyond CHUNKS_WANTED chunks, a multiple of it (so that the decoder's threads x lanes end
    together); from 512 K elements on two rounds of it (a late thread leaves its second round to
    the other); chunks cover the units in order, none empty; fewer chunks are left as they were."""
    from passes import tensorcodec as tc

    for shape, n_chunks in [((30522, 384), 192), ((512, 512, 3, 3), 64), ((256, 256, 3, 3), 64),
                            ((128, 128, 3, 3), 10), ((70, 130), 1), ((1000,), 1)]:
        unit_len, upr = tc._scan_shape(shape)
        lay = tc._Layout(unit_len, upr, 8, np.zeros(1, np.uint8), 1, np.zeros(unit_len, np.uint8), 1, 1.0)
        n = int(np.prod(shape))
        cu = lay.chunk_units(n)
        assert cu[0] == 0 and cu[-1] == n // unit_len and (np.diff(cu) > 0).all()
        assert cu.size - 1 == n_chunks
        assert np.diff(cu).max() * unit_len <= tc.CHUNK_ELEMENTS
