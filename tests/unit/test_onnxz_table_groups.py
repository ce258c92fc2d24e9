"""The writer's choice of shared tables (FORMAT.md 3.2, writing): per kind of plane, as many tables
as pay for themselves by the estimates, each fitted to the planes that code best with it. Two groups
of small int8 tensors with different spreads (as a model's depthwise kernels and its 1x1 convolutions)
get a table each; a group too small to pay for a table of its own takes the common one."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

import passes
from passes.onnxz import codecs
from passes.onnxz.reader import PackedFile


def _planes(rng, scale: float, count: int, low: int = 1500, high: int = 6000):
    return [np.clip(np.round(rng.laplace(0, scale, int(rng.integers(low, high)))), -127, 127).astype(np.int8).view(np.uint8)
            for _ in range(count)]


def _counts(planes):
    return np.array([codecs.byte_counts(p) for p in planes], np.int64)


def _estimated_total(members, freqs):
    """What the members cost with these tables (each its cheapest, or its own plane), tables
    charged as the writer charges them: the figure _table_groups lowers."""
    own = np.array([codecs._own_cost(c, int(c.sum())) for c in members])
    gain, _ = codecs._grouping_gain(members, own, freqs)
    return float(own.sum()) - gain


def test_two_spreads_get_a_table_each():
    rng = np.random.default_rng(7)
    narrow, wide = _planes(rng, 3, 10), _planes(rng, 30, 10)
    members = _counts(narrow + wide)
    freqs = codecs._table_groups(members)
    assert len(freqs) == 2
    costs = codecs._shared_costs(members, freqs)
    picks = np.argmin(costs, axis=1)
    # each group codes with the table fitted to it
    assert len(set(picks[:10].tolist())) == 1 and len(set(picks[10:].tolist())) == 1 and picks[0] != picks[10]
    one = [codecs._ans.normalise(members.sum(axis=0))]
    assert _estimated_total(members, freqs) < _estimated_total(members, one)


def test_a_group_too_small_for_a_table_takes_the_common_one():
    rng = np.random.default_rng(8)
    members = _counts(_planes(rng, 12, 12) + _planes(rng, 14, 1, 200, 201))
    assert len(codecs._table_groups(members)) == 1


def test_planes_of_one_symbol_or_one_member_get_no_table():
    assert codecs._table_groups(np.zeros((3, 256), np.int64) + np.eye(256, dtype=np.int64)[5] * 500) == []
    tables = codecs.SharedTables.build([(np.arange(2000, dtype=np.uint8), codecs.INT8, "raw_data")])
    assert not tables


def test_the_tables_do_not_depend_on_the_member_order_given_the_same_order():
    """Deterministic: built twice from the same payloads, the same tables in the same order."""
    rng = np.random.default_rng(9)
    payloads = [(p, codecs.INT8, "raw_data") for p in _planes(rng, 3, 6) + _planes(rng, 30, 6)]
    assert codecs.SharedTables.build(payloads).tables == codecs.SharedTables.build(payloads).tables


def _two_spread_model():
    rng = np.random.default_rng(10)
    inits = [numpy_helper.from_array(p.view(np.int8), f"{kind}{i}")
             for kind, planes in (("n", _planes(rng, 3, 8)), ("w", _planes(rng, 30, 8)))
             for i, p in enumerate(planes)]
    return helper.make_model(helper.make_graph([], "g", [], [], inits))


@pytest.mark.skipif(not codecs._write_ans, reason="the writer codes no ans planes here")
def test_a_pack_with_two_tables_of_one_kind_restores_and_is_smaller(tmp_path, monkeypatch):
    src = tmp_path / "m.onnx"
    src.write_bytes(_two_spread_model().SerializeToString())
    two = passes.pack(src, tmp_path / "two.onnxz", threads=2)
    passes.pack(src, tmp_path / "again.onnxz", threads=1)
    assert (tmp_path / "two.onnxz").read_bytes() == (tmp_path / "again.onnxz").read_bytes()
    with PackedFile(tmp_path / "two.onnxz") as pf:
        assert len(pf.index.raw["ans_tables"]) == 2
        used = {t.stream.params["tables"][0] for t in pf.index.tensors if t.stream and t.stream.codec == "ans_shared"}
        assert used == {0, 1}
    assert passes.unpack(tmp_path / "two.onnxz", tmp_path / "r.onnx").read_bytes() == src.read_bytes()
    monkeypatch.setattr(codecs, "MAX_TABLES_PER_KIND", 1)  # one table per kind, as before
    one = passes.pack(src, tmp_path / "one.onnxz", threads=2)
    assert two.packed_bytes < one.packed_bytes


def test_the_tables_of_a_file_are_capped_round_robin_over_the_kinds(monkeypatch):
    """At most MAX_TABLES in all (the decode tables the C batch decoder keeps built), the first
    table of every kind before the second of any."""
    rng = np.random.default_rng(11)
    ints = [(p, codecs.INT8, "raw_data") for p in _planes(rng, 3, 8) + _planes(rng, 30, 8)]
    uints = [(p, codecs.UINT8, "raw_data") for p in _planes(rng, 3, 8) + _planes(rng, 30, 8)]
    full = codecs.SharedTables.build(ints + uints)
    assert [len(v) for v in full.choices.values()] == [2, 2]
    monkeypatch.setattr(codecs, "MAX_TABLES", 3)
    capped = codecs.SharedTables.build(ints + uints)
    assert len(capped.tables) == 3 and sorted(len(v) for v in capped.choices.values()) == [1, 2]
    assert all(capped.choices[k][0][2] == full.choices[k][0][2] for k in capped.choices)


def test_a_plane_with_a_shared_table_has_the_lanes_of_an_ans_plane_of_its_size():
    """As many lanes as `ans` gives a plane of that size (32 from 8192 symbols): with 4, planes of
    16K-64K symbols decoded latency-bound, ~40% slower (silero_vad_v6.int8's cut tensors)."""
    rng = np.random.default_rng(12)
    planes = _planes(rng, 20, 6, 1500, 4000) + [_planes(rng, 20, 1, 20000, 20001)[0], _planes(rng, 20, 1, 3000, 3001)[0]]
    shared = codecs.SharedTables.build([(p, codecs.INT8, "raw_data") for p in planes])
    for p in planes[-2:]:
        enc = codecs.encode_tensor(p, codecs.INT8, "raw_data", shared=shared)
        assert enc.codec == "ans_shared"
        assert enc.chunks[0].planes[0][0] == codecs._ans.lanes_log2_for(p.size) + 1
    assert codecs._ans.lanes_log2_for(20000) == 5
