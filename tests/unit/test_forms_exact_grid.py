"""Rows whose values lie exactly on a grid the levels reach are stored without error
(forms._exact_grid): integer-valued weights, ternary / binary rows; trained rows are unchanged."""
import numpy as np
import pytest

from passes import forms

RNG = np.random.default_rng(11)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("lo,hi,bits,symmetric", [(-126, 126, 8, True), (-100, 100, 8, False), (-7, 7, 4, True),
                                                  (0, 15, 4, False), (0, 255, 8, False), (-31, 31, 6, True)])
def test_integer_rows_that_fit_the_levels_are_exact(dtype, lo, hi, bits, symmetric):
    w = RNG.integers(lo, hi + 1, (96, 64)).astype(dtype)
    got = forms.quantize_linear(w, forms.Levels(bits, symmetric), axis=1)
    assert got.noise == 0 and got.snr_db() == 200.0
    zp = 0 if got.zero_point is None else got.zero_point.astype(np.float32)
    back = (got.q.astype(np.float32) - zp) * got.scale.astype(np.float32)
    assert np.array_equal(back.astype(dtype), w)


def test_integer_rows_wider_than_the_levels_are_searched_as_before():
    w = RNG.integers(-100, 101, (96, 64)).astype(np.float32)
    got = forms.quantize_linear(w, forms.Levels(4, True), axis=1)
    assert got.noise > 0 and 20 < got.snr_db() < 30


@pytest.mark.parametrize("axis,block", [(1, 0), (0, 0), (1, 32)])
def test_ternary_and_binary_rows_are_exact(axis, block):
    alpha = np.float32(0.037)
    ternary = (RNG.integers(-1, 2, (64, 96)) * alpha).astype(np.float32)
    binary = np.where(RNG.random((64, 96)) < 0.5, -alpha, alpha).astype(np.float32)
    for w in (ternary, binary):
        got = forms.quantize_linear(w, forms.Levels(8, True), axis=axis, block_size=block)
        assert got.snr_db() == 200.0


def test_trained_rows_quantize_exactly_as_without_the_grid_check(monkeypatch):
    w = RNG.standard_normal((300, 128)).astype(np.float32)
    w[:8, :] = np.round(w[:8, :])  # (axis 1: each column a channel) integral first values: the probe passes, the rest not
    with_check = forms.quantize_linear(w, forms.Levels(8, True), axis=1)
    monkeypatch.setattr(forms, "_exact_grid", lambda part, s, z: (s, z))
    without = forms.quantize_linear(w, forms.Levels(8, True), axis=1)
    assert np.array_equal(with_check.q, without.q) and np.array_equal(with_check.scale, without.scale)


def test_mixed_rows_only_the_grid_rows_change():
    w = RNG.standard_normal((64, 128)).astype(np.float32)
    w[:, 5] = RNG.integers(-50, 51, 64)  # (axis 1: column 5 is one channel)
    got = forms.quantize_linear(w, forms.Levels(8, True), axis=1)
    assert got.scale.ravel()[5] == 1.0
    assert np.array_equal(got.q[:, 5].astype(np.float32), w[:, 5])


def test_a_grid_row_whose_zero_point_would_leave_the_levels_is_searched():
    """-65504 repeated is integral, but step 1 would need a zero point of 65504: not a uint4 level."""
    w = np.full((2, 16), -65504, np.float16)
    w[1] = 65504
    got = forms.quantize_linear(w, forms.Levels(4, False), axis=1, block_size=16)
    back = (got.q.astype(np.float32) - got.zero_point.astype(np.float32)) * got.scale.astype(np.float32)
    assert np.array_equal(back.astype(np.float16), w) and got.zero_point.max() <= 15


def test_an_all_zero_row_keeps_the_searched_scale():
    """Zero levels at any scale are exact, but onnxruntime's MatMulNBits leaves an error in proportion
    to the scale (1.2e-4 at scale 1): the search's tiniest scale stays."""
    w = np.zeros((64, 64), np.float32)
    w[:, 1] = 3.0
    got = forms.quantize_linear(w, forms.Levels(8, True), axis=1)
    assert got.scale.ravel()[0] < 1e-30 and got.scale.ravel()[1] == 1.0
