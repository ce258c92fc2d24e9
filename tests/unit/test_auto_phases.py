"""passes.auto's phases (auto._Search) run and tested one at a time: the same result as compress() when
called in its order, and the search for mu on its own with a stand-in trial."""
import math

import passes
from passes import auto
from passes import sensitivity as sens

from modelgen import dense_model, feeds

TIMING = ("seconds", "cpu_seconds")


def _search(model, target, feed_list, **options):
    kwargs = dict(target=target, metric_args=None, bits=auto.DEFAULT_BITS, granularity="channel", ref_bits=4,
                  error_feedback=True, min_elements=auto.AUTO_MIN_ELEMENTS, run_as="onnxruntime",
                  tighten=auto.TIGHTEN_TRIES, fused_matmul_form=auto.FUSED_MATMUL_FORM)
    kwargs.update(options)
    return auto._Search(model, **kwargs)


def test_phases_called_one_by_one_give_what_compress_gives():
    m = dense_model()
    f = feeds(m, n=6)
    search = _search(m, "cosine>=0.999", f)
    search.prepare(f, 8, False)
    assert len(search.ref) == len(f) and search.tie is None and search.floor is None
    search.make_forms()
    assert set(search.infos) == {"W1", "W2", "W3"}
    assert all(4 in i.options and sens.FLOAT in i.options for i in search.infos.values())
    search.fit_error_feedback()
    assert any(o.rounding == "gptq" for i in search.infos.values() for o in i.options.values())
    search.add_bias_shifts()
    assert search.allocatable_per_tensor()
    search.measure_sensitivities()
    assert all(i.sensitivity > 0 for i in search.infos.values())
    plan = search.allocate()
    assert search.seen[auto._plan_key(plan)][0], "the allocated plan passed on the trial session"
    assert search.history[-1] == plan
    plan, candidate = search.confirm_on_built_model(plan)
    out, record = search.finish(plan, candidate, None)

    out_c, record_c = passes.compress(m, target="cosine>=0.999", feeds=f)
    assert out.SerializeToString() == out_c.SerializeToString()
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert repr(strip(record)) == repr(strip(record_c))
    assert record["met_on_feeds"] and set(record["cpu_seconds"]) >= {"reference", "forms", "search", "confirm"}


def test_search_for_mu_brackets_then_bisects_to_the_smallest_passing_mu():
    """_search_mu alone, with a stand-in trial that passes from mu 123 up: it ends within the bisection's
    resolution above 123, keeps that mu's plan, and takes every weight float where no mu passes."""
    search = auto._Search.__new__(auto._Search)
    search.infos = {"W": None}
    tried = []

    def trial(mu, passing_from=123.0):
        tried.append(mu)
        return {"W": mu}, mu >= passing_from

    search._trial = trial
    plan, passed = search._search_mu()
    assert passed and 123.0 <= search.mu < 123.0 * 1.15 and plan == {"W": search.mu}
    assert tried[:2] == [1e4, 1.0]  # the bracket's top, then its bottom
    assert all(math.isclose(mu, math.sqrt(lo * hi)) for mu, lo, hi in _bisections(tried))

    search._trial = lambda mu: ({"W": 8}, False)
    plan, passed = search._search_mu()
    assert not passed and plan == {"W": sens.FLOAT} and search.mu >= 1e16


def _bisections(tried):
    """(mu, lo, hi) of each bisection step of tried (after the bracket: 1e4 passing, 1.0 failing)."""
    lo, hi = 1.0, 1e4
    out = []
    for mu in tried[2:]:
        out.append((mu, lo, hi))
        if mu >= 123.0:
            hi = mu
        else:
            lo = mu
    return out


def test_no_worse_than_one_width_takes_the_smallest_passing_width_only_when_smaller(monkeypatch):
    """_no_worse_than_one_width alone: widest first, a uniform width is tried only when its rate is below the
    plan's (or the plan failed), and the first width that fails ends the walk."""
    search = auto._Search.__new__(auto._Search)
    rates = {8: 8.0, 6: 6.0, 4: 4.0, sens.FLOAT: 32.0}  # bytes of a weight at each form
    info = type("Info", (), {"options": dict.fromkeys(rates)})()  # (only the forms' keys are read)
    search.infos = {"A": info, "B": info}
    search.bits = [4, 6, 8]
    passing = {6, 8}
    tried = []

    def trial_plan(plan, mu=None):
        tried.append(mu)
        return plan, set(plan.values()) <= passing

    search._trial_plan = trial_plan
    monkeypatch.setattr(sens, "plan_rate", lambda infos, plan: sum(rates[b] for b in plan.values()))
    plan, passed = search._no_worse_than_one_width({"A": 8, "B": sens.FLOAT}, True)
    assert tried == ["uniform int8", "uniform int6", "uniform int4"]
    assert passed and plan == {"A": 6, "B": 6}
