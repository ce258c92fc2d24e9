"""The reader's window buffers (reader._Buffers): whole windows start on a huge-page boundary (the
kernel pins and the decoder writes them as huge pages; from a merely page-aligned start only about
half of a window was) and stay O_DIRECT-aligned; round trips through them are test_onnxz.py's."""
import numpy as np

from passes.onnxz import reader


def test_window_buffers_start_on_a_huge_page_and_hold_what_was_asked():
    pool = reader._Buffers(keep=0)
    # whole windows, and the one-window buffers of files of 2-4 MiB (silero_vad_v6's 2.3 MB: its
    # O_DIRECT write pinned ~570 small pages while its buffer was shared memory)
    for n in (reader.WINDOW_BYTES, reader.WINDOW_BYTES + reader.ALIGN, reader.WINDOW_BYTES + 12345,
              reader.HUGE_PAGE, 2_327_524 + reader.ALIGN):
        buf = pool.take(n)
        assert buf.dtype == np.uint8 and buf.size >= n
        assert buf.ctypes.data % reader.HUGE_PAGE == 0
        assert buf.ctypes.data % reader.ALIGN == 0
        buf[:] = 7  # writable over its whole length (the map behind it is larger)
        buf[-1] = 9
        assert buf[0] == 7 and buf[-1] == 9


def test_smaller_buffers_stay_page_aligned():
    buf = reader._Buffers(keep=0).take(100_000)
    assert buf.size >= 100_000 and buf.ctypes.data % reader.ALIGN == 0


def test_given_back_buffers_are_reused():
    pool = reader._Buffers(keep=2)
    buf = pool.take(reader.WINDOW_BYTES)
    pool.give(buf)
    again = pool.take(reader.WINDOW_BYTES)
    assert again.ctypes.data == buf.ctypes.data
