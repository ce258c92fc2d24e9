"""The pack's shortcuts decide exactly as the full work they skip (same stored bytes)."""

import numpy as np

from passes.onnxz import codecs


def test_narrowed_refuses_a_tensor_whose_first_values_alone_narrow():
    # a word embedding whose first rows are zeros: the first 1024 values are float16- and
    # bfloat16-exact, the rest is not; the spread sample must refuse it, as the full check does
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 64)).astype(np.float32)
    w[:20] = 0
    assert codecs._narrowed(w.view(np.uint8).ravel(), codecs.FLOAT) is None
    d = rng.standard_normal(5000)
    d[:1500] = 0.5
    assert codecs._narrowed(d.view(np.uint8).ravel(), codecs.DOUBLE) is None


def test_narrowed_still_narrows_exact_tensors():
    rng = np.random.default_rng(1)
    h = rng.standard_normal(10000).astype(np.float16)
    to, narrow = codecs._narrowed(h.astype(np.float32).view(np.uint8), codecs.FLOAT)
    assert to == codecs.FLOAT16 and np.array_equal(narrow.view(np.float16), h)
    b = (rng.standard_normal(10000).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    to, narrow = codecs._narrowed(b.view(np.uint8), codecs.FLOAT)
    assert to == codecs.BFLOAT16 and np.array_equal(narrow.view(np.uint16), (b.view(np.uint32) >> 16).astype(np.uint16))
    f = rng.standard_normal(7000).astype(np.float32)
    to, narrow = codecs._narrowed(f.astype(np.float64).view(np.uint8), codecs.DOUBLE)
    assert to == codecs.FLOAT and np.array_equal(narrow.view(np.float32), f)
