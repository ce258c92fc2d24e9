"""fold's check of a weight narrowed to float16 (fold._narrowing_snr_db: below
NARROWING_MIN_SNR_DB the weight keeps its own type) with infinities or NaNs among its values (a
-inf attention mask): they narrow to themselves and count as neither signal nor noise. Before,
inf - inf made the SNR NaN, which no threshold refused, so a weight whose finite values
float16 flushes to zero was narrowed anyway."""
from __future__ import annotations

import math

import numpy as np

from passes import fold


def test_an_infinity_does_not_hide_values_float16_flushes_to_zero():
    v = np.full(1000, 3e-9, np.float32)  # below float16's smallest subnormal (6e-8): all become 0
    v[0] = -np.inf
    snr = fold._narrowing_snr_db(v, np.float16)
    assert not math.isnan(snr) and snr < fold.NARROWING_MIN_SNR_DB[fold.TensorProto.FLOAT16]


def test_infinities_and_nans_alone_are_exact():
    v = np.array([-np.inf, 0.5, 0.25, np.inf, np.nan, -1.0], np.float32)
    assert fold._narrowing_snr_db(v, np.float16) == math.inf
    assert fold._narrowing_snr_db(np.array([-np.inf, np.inf], np.float32), np.float16) == math.inf


def test_finite_values_measure_as_before():
    v = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    with_inf = np.concatenate([v, [np.float32(-np.inf)]])
    assert fold._narrowing_snr_db(with_inf, np.float16) == fold._narrowing_snr_db(v, np.float16)
