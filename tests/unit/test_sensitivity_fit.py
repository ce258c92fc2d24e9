"""sensitivity.fit_optimism / optimism_of_plan: error-fed levels judged on activations they were not fitted to."""
import numpy as np
import pytest

from passes import sensitivity as sens


def _hessian(x):
    return x.T @ x / len(x)


def _least_squares_fit(w, x, rng):
    """A stand-in for error feedback: w's rounding error cancelled along the directions the rows x
    take, by least squares against outputs that carry an error no weight can cancel (the grid's):
    with few rows per input the fit follows that noise of its own rows."""
    rounded = np.round(w * 4) / 4
    residual = x @ (w - rounded) + 0.1 * rng.standard_normal((len(x), w.shape[1]))
    correction, *_ = np.linalg.lstsq(x, residual, rcond=None)
    return rounded + correction


def test_a_delta_that_does_not_depend_on_the_data_gives_one():
    rng = np.random.default_rng(0)
    d = rng.standard_normal((16, 8))
    h0, h1 = _hessian(rng.standard_normal((40, 16))), _hessian(rng.standard_normal((40, 16)) * 3)
    assert sens.fit_optimism([d, d], [h0, h1]) == pytest.approx(1.0)


def test_levels_fitted_to_few_rows_measure_worse_on_the_other_half():
    rng = np.random.default_rng(1)
    k, n = 32, 8
    w = rng.standard_normal((k, n))
    factors = []
    for rows in (40, 128, 4096):  # few rows per input: the fit follows its half's rows
        x = [rng.standard_normal((rows, k)) for _ in range(2)]
        deltas = [w - _least_squares_fit(w, xi, rng) for xi in x]
        factors.append(sens.fit_optimism(deltas, [_hessian(xi) for xi in x]))
    # least squares over n rows of k inputs: (1 + k/n) / (1 - k/n) held out / in sample, 9 / 1.7 / 1.02 for the noise alone (4.2 / 1.4 / 1.01 with the rounding error in it)
    assert factors[0] > 3 and factors[0] > factors[1] > factors[2] >= 1.0
    assert factors[2] < 1.1  # 128 rows per input: the fit holds on the other half


def test_never_below_one_and_one_without_error():
    rng = np.random.default_rng(2)
    h = _hessian(rng.standard_normal((50, 6)))
    zero = np.zeros((6, 3))
    assert sens.fit_optimism([zero, zero], [h, h]) == 1.0
    d = rng.standard_normal((6, 3))
    assert sens.fit_optimism([d, d], [h, h * 0.5]) == 1.0  # (a delta doing better on the other half: 0.75)
    # 4 rows for 6 inputs in each half: least squares cancels the error on its own rows exactly
    x = [rng.standard_normal((4, 6)) for _ in range(2)]
    w = rng.standard_normal((6, 3))
    rounded = np.round(w * 4) / 4
    exact = [w - (rounded + np.linalg.lstsq(xi, xi @ (w - rounded), rcond=None)[0]) for xi in x]
    assert sens.fit_optimism(exact, [_hessian(xi) for xi in x]) == sens.FIT_OPTIMISM_MAX


def _info(name, optimism, gptq_error, near_error):
    opts = {sens.FLOAT: sens.TensorOption(sens.FLOAT, 100.0, 0.0, None),
            4: sens.TensorOption(4, 20.0, 1.0, 20.0, rounding="gptq"),
            8: sens.TensorOption(8, 40.0, 0.1, 40.0)}
    info = sens.TensorInfo(name, (4, 4), 10.0, opts, out_error={4: gptq_error, 8: near_error, sens.FLOAT: 0.0},
                           fit_optimism=optimism)
    return info


def test_error_fed_forms_are_charged_their_optimism_and_the_plan_its_share():
    infos = {"A": _info("A", 3.0, 1e-3, 1e-4), "B": _info("B", 1.0, 2e-3, 2e-4)}
    assert infos["A"].error(4) == pytest.approx(3e-3) and infos["A"].calibration_error(4) == pytest.approx(1e-3)
    assert infos["A"].error(8) == pytest.approx(1e-4)  # nearest rounding: nothing fitted
    # allocation sees the held-out errors: at 8000 bytes per unit of error A's error-fed int4 costs 20 + 24
    # against int8's 40 + 0.8 (20 + 8 as measured on the calibration feeds); B's int4 20 + 16
    assert sens.allocate(infos, 8000.0) == {"A": 8, "B": 4}
    infos["A"].fit_optimism = 1.0
    assert sens.allocate(infos, 8000.0) == {"A": 4, "B": 4}
    infos["A"].fit_optimism = 3.0
    # the plan's growth: (3e-3 + 2e-3) / (1e-3 + 2e-3)
    assert sens.optimism_of_plan(infos, {"A": 4, "B": 4}) == pytest.approx(5 / 3)
    assert sens.optimism_of_plan(infos, {"A": 8, "B": 4}) == 1.0
    assert sens.optimism_of_plan(infos, {"A": sens.FLOAT, "B": sens.FLOAT}) == 1.0


def test_the_full_fit_is_charged_half_the_halves_excess():
    assert sens.full_fit_optimism(1.0) == 1.0 and sens.full_fit_optimism(3.0) == pytest.approx(2.0)
    # levels fitted on all the rows (both halves) and measured on rows they never saw, over the same
    # on their own rows: least squares gives (1 + k/n) / (1 - k/n), the halves' (1 + 2k/n) / (1 - 2k/n)
    rng = np.random.default_rng(4)
    k, n_half = 16, 160
    w = rng.standard_normal((k, 8))
    halves, full = [], []
    for _ in range(20):
        x = [rng.standard_normal((n_half, k)) for _ in range(2)]
        deltas = [w - _least_squares_fit(w, xi, rng) for xi in x]
        halves.append(sens.fit_optimism(deltas, [_hessian(xi) for xi in x]))
        both, fresh = np.concatenate(x), rng.standard_normal((4096, k))
        d = w - _least_squares_fit(w, both, rng)
        full.append(np.sum(d * (_hessian(fresh) @ d)) / np.sum(d * (_hessian(both) @ d)))
    half, measured = float(np.mean(halves)), float(np.mean(full))
    assert measured > 1.0 and (half - 1) > 1.6 * (measured - 1)  # the halves' excess is about twice the full fit's
    assert 0.8 < (sens.full_fit_optimism(half) - 1) / (measured - 1) < 1.3
