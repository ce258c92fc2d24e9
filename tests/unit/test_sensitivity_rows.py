"""Embedding tables whose rows the calibration mostly never gathers (sensitivity.gathered_row_counts,
seen_row_levels, seen_row_surrogate and one_step_forms(row_counts=...))."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from modelgen import _model, gather_model, tensor, weight
from passes import sensitivity as sens


def _ids(rows, shape=(2, 5)):
    return {"ids": np.asarray(rows, np.int64).reshape(shape)}


def test_row_counts_are_the_lookups_of_the_feeds():
    m = gather_model()
    feeds = [_ids([1, 1, 2, 3, 99, 1, 7, 7, 0, 5]), _ids([5, 5, 5, 5, 5, 1, 2, 3, 4, 6])]
    counts = sens.gathered_row_counts(m, feeds, ["E"])["E"]
    want = np.bincount(np.concatenate([f["ids"].ravel() for f in feeds]), minlength=100)
    assert counts.shape == (100,) and np.array_equal(counts, want)


def test_row_counts_of_computed_and_negative_indices():
    """Indices made in the graph are read from a run of it; a negative index counts from the end."""
    inits = [tensor("E", weight((100, 40), "float32", 5, 1.0)),
             tensor("one", np.array(1, np.int64))]
    nodes = [helper.make_node("Add", ["ids", "one"], ["ids1"]),
             helper.make_node("Gather", ["E", "ids1"], ["y"], axis=0)]
    m = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 40])], inits, 13)
    counts = sens.gathered_row_counts(m, [_ids([0, 1, 2, 3, 4, -2, -2, 5, 6, 7])], ["E"])["E"]
    want = np.zeros(100, np.int64)
    for r in [1, 2, 3, 4, 5, 99, 99, 6, 7, 8]:
        want[r] += 1
    assert np.array_equal(counts, want)


def test_row_counts_leave_out_a_table_also_read_along_another_axis():
    inits = [tensor("E", weight((100, 40), "float32", 5, 1.0))]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["y"], axis=0),
             helper.make_node("Gather", ["E", "ids"], ["z"], axis=1)]
    m = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 40]),
                helper.make_tensor_value_info("z", TensorProto.FLOAT, [100, 2, 5])], inits, 13)
    assert sens.gathered_row_counts(m, [_ids(range(10))], ["E"]) == {}


def _forms(dtype="float32", counts=None):
    m = gather_model(dtype)
    infos, _ = sens.dequantized_forms(m, [4, 5], min_elements=128)
    before = {k: o.levels_entropy_bytes for k, o in infos["E"].options.items() if k != sens.FLOAT}
    table = sens.one_step_forms(infos, {"E": 0}, scale_bytes=lambda s: s.nbytes,
                                row_counts=None if counts is None else {"E": counts})
    return infos["E"], table["E"], before


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_seen_rows_take_a_finer_step_and_the_trials_see_unseen_datas_error(dtype, monkeypatch):
    """Seen rows at SEEN_ROW_STEP x the step; the trials feed the rows gathered once at the coarse step
    (one step for the unseen rows here; their row-norm steps: the test below)."""
    monkeypatch.setattr(sens, "SEEN_ROW_NORM_EXPONENT", None)
    counts = np.zeros(100, np.int64)
    counts[[3, 10, 11, 40]] = [4, 1, 2, 1]  # 8 lookups, 2 of rows seen once: unseen mass 0.25
    seen = counts > 0
    seen[0] = sens.PAD_ROW_SEEN  # row 0, what zero padding gathers, takes the fine step too
    info, table, before = _forms(dtype, counts)
    _, plain, _ = _forms(dtype)
    w = info.options[sens.FLOAT].dequantized.astype(np.float64)
    for key in before:
        opt = info.options[key]
        levels, scale = table[key]
        step = float(np.max(scale[~seen]))  # no row of this table is widened by its largest value
        assert np.allclose(scale[~seen], step, rtol=1e-3)
        assert np.allclose(scale[seen], sens.SEEN_ROW_STEP * step, rtol=1e-3)
        built = (levels.astype(w.dtype if dtype == "float32" else np.float16) * scale[:, None])
        # the option's weight is the built one; the trials feed the surrogate
        assert np.array_equal(opt.dequantized, built.astype(opt.dequantized.dtype))
        trial = opt.trial_dequantized
        assert trial is not None and trial.dtype == opt.dequantized.dtype
        # leave one out: the rows gathered once are fed at the coarse step, as unseen data meets them
        once = counts == 1
        assert np.array_equal(trial[~once], opt.dequantized[~once])
        coarse = np.rint(w / step).clip(-127, 127) * step
        assert np.allclose(trial[once].astype(np.float64), coarse[once], rtol=1e-3, atol=1e-6)
        assert not np.array_equal(trial[once], opt.dequantized[once])
        assert opt.noise == pytest.approx(float(np.sum((trial.astype(np.float64) - w) ** 2)), rel=1e-6)
        # the unseen rows keep the plain one-step form's step (the 4 finer rows cost a little more rate)
        assert step == pytest.approx(float(np.min(plain[key][1])), rel=1e-3)
        assert opt.levels_entropy_bytes > before[key] * 0.96
        repl, _ = sens.replacements({"E": info}, {"E": key})
        assert np.array_equal(repl["E"], trial)


def test_a_table_the_calibration_covers_gets_the_plain_one_step_form():
    """As many lookups as rows (a position table): no seen-row steps, the trials feed the built table."""
    counts = np.ones(100, np.int64)
    counts[:50] = 2
    info, table, _ = _forms("float32", counts)
    plain_info, plain_table, _ = _forms("float32")
    for key, (levels, scale) in table.items():
        assert np.array_equal(levels, plain_table[key][0]) and np.array_equal(scale, plain_table[key][1])
        assert info.options[key].trial_dequantized is None


def test_the_padding_row_takes_the_seen_rows_step(monkeypatch):
    """Row 0 (zero padding's row), never gathered by batch-1 calibration feeds, gets the fine step."""
    monkeypatch.setattr(sens, "SEEN_ROW_NORM_EXPONENT", None)  # (one step for the unseen rows)
    counts = np.zeros(100, np.int64)
    counts[[3, 10]] = [2, 1]
    _, table, before = _forms("float32", counts)
    for key in before:
        scale = table[key][1]
        assert scale[0] == pytest.approx(scale[3], rel=1e-6)
        assert scale[0] == pytest.approx(sens.SEEN_ROW_STEP * float(np.max(scale)), rel=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unseen_rows_take_steps_by_their_norm(dtype):
    """SEEN_ROW_NORM_EXPONENT: rows no lookup reached take step x forms.row_norm_steps (a larger
    norm, a finer step); seen rows keep SEEN_ROW_STEP x step; the rows gathered once are fed to the
    trials at the step they would have unseen, their own row-norm step."""
    from passes import forms

    counts = np.zeros(100, np.int64)
    counts[[3, 10, 11, 40]] = [4, 1, 2, 1]
    seen = counts > 0
    seen[0] = sens.PAD_ROW_SEEN
    info, table, _ = _forms(dtype, counts)
    w = info.options[sens.FLOAT].dequantized.astype(np.float64)
    rel = forms.row_norm_steps(info.options[sens.FLOAT].dequantized, sens.SEEN_ROW_NORM_EXPONENT)
    assert rel.std() > 0.01  # the table's rows differ in norm: the rule has something to do
    for key in table:
        opt = info.options[key]
        levels, scale = table[key]
        widened = np.abs(w).max(axis=1) / 127.0 >= scale.astype(np.float64) * (1 - 1e-3)
        ratio = scale[~seen & ~widened].astype(np.float64) / rel[~seen & ~widened]
        assert np.allclose(ratio, ratio[0], rtol=2e-3)  # one step, scaled per row by its norm
        step = float(ratio[0])
        assert np.allclose(scale[seen].astype(np.float64), sens.SEEN_ROW_STEP * step, rtol=2e-3)
        once = counts == 1
        row_step = np.maximum(step * rel, np.abs(w).max(axis=1) / 127.0)[:, None]
        coarse = np.rint(w / row_step).clip(-127, 127) * row_step
        assert np.allclose(opt.trial_dequantized[once].astype(np.float64), coarse[once], rtol=2e-3, atol=1e-5)
        assert np.array_equal(opt.trial_dequantized[~once], opt.dequantized[~once])
