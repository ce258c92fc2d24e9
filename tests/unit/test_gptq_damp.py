"""Damping that grows where H comes from fewer activation rows than inputs (gptq.sample_damp),
the rows collect_hessians counts, and a damp per weight in refine."""
import numpy as np
import pytest

import modelgen as mg
import passes
from passes import gptq


def test_collect_hessians_counts_the_rows_of_each_hessian():
    m = mg.dense_model()
    rows = {}
    hess = gptq.collect_hessians(m, mg.feeds(m, n=3), ["W2", "W3"], rows=rows)
    assert set(rows) == set(hess) == {"W2", "W3"}
    assert rows == {"W2": 12, "W3": 12}  # x is [4, 64]: 4 rows per feed


def test_sample_damp_is_the_floor_until_rows_are_few():
    assert gptq.sample_damp(64, 64000) == gptq.DAMP
    assert gptq.sample_damp(2304, 1176, per_input=0.1) == pytest.approx(0.1 * 2304 / 1176)
    assert gptq.sample_damp(100, 50, floor=0.5, per_input=0.1) == 0.5
    assert gptq.sample_damp(10, 0, per_input=0.1) == pytest.approx(1.0)  # no rows: k times per_input


def test_damp_by_weight_in_refine():
    m = mg.dense_model()
    hess = gptq.collect_hessians(m, mg.feeds(m, n=4), ["W2", "W3"])
    q = passes.quantize_weights(m, bits=4, include=["W2", "W3"])
    mixed = gptq.refine(q, m, hess, 4, damp={"W2": 1e4}, factors={})
    low = gptq.refine(q, m, hess, 4)
    high = gptq.refine(q, m, hess, 4, damp=1e4)
    assert np.array_equal(mixed["W2"][0], high["W2"][0])
    assert np.array_equal(mixed["W3"][0], low["W3"][0])  # a name the dict lacks: DAMP


def test_sample_damp_holds_out_better_when_rows_are_fewer_than_inputs():
    # H from 60 rows for 96 inputs: damp 0.01 feeds error into directions those rows never saw
    rng = np.random.default_rng(3)
    k, n = 96, 48
    w = rng.standard_normal((k, n)) * 0.1
    x = mg.correlated_inputs(4060, k)
    cal, held = x[:60], x[60:]
    h = cal.T @ cal / len(cal)
    qmax = 15
    scale = np.abs(w).max(axis=0) / qmax

    def held_error(damp):
        q = gptq.gptq_levels(w, h, scale, -qmax, qmax, damp=damp)
        return float(np.sum((held @ (w - q * scale)) ** 2))

    assert held_error(gptq.sample_damp(k, len(cal))) < 0.9 * held_error(gptq.DAMP)
