"""Format 1.4's codec `same` (FORMAT.md 3.3) under the fuzz harness: the samples that store
payloads once (fuzz/samples.py same_samples: in one file, and a copy in the external data file),
their crafted `same` edits (fuzz/mutators.py _retarget_same: naming itself, a later, missing or
other-length tensor, non-integers, a coded stream turned into `same`, `same` as a skeleton or a
narrow's inner, chunks of its own, chains) and every byte flip; each mutant through load,
open_packed + get_tensor, unpack, verify and the sessions must be refused with a documented error
or read exactly as the original (crafted: a well-formed different tensor from get_tensor is
accepted, as for every crafted file)."""
from __future__ import annotations

import collections

import pytest

from fuzz.campaign import make_mutant

SAME = ["same_payloads", "same_external"]
ALL = ("load", "open_packed", "unpack", "verify", "session")


def test_the_samples_store_payloads_once(samples):
    for name in SAME:
        assert "same" in samples[name].families, name


@pytest.mark.parametrize("name", SAME)
def test_crafted_same_edits(samples, oracle_for, name):
    packed = {n: s.packed for n, s in samples.items()}
    oracle = oracle_for(name)
    kinds, verdicts, bad = collections.Counter(), collections.Counter(), []
    for seed in range(300):
        desc, data, crafted = make_mutant(("crafted", name, seed), packed)
        kinds[desc.split(" at ")[0] if desc.startswith("same ") else "other"] += 1
        v = oracle.judge(data, crafted=crafted, apis=ALL)
        verdicts[v.verdict] += 1
        if v.bad:
            bad.append(f"('crafted', {name!r}, {seed}) {desc}: " + "; ".join(v.findings))
    assert not bad, "\n".join(bad[:20])
    assert sum(n for k, n in kinds.items() if k != "other") >= 40, kinds  # the `same` edits are drawn
    assert verdicts["refused"] >= 40, verdicts


def test_every_byte_flip_of_a_pack_storing_payloads_once(samples, oracle_for):
    name = "same_payloads"
    packed = {n: s.packed for n, s in samples.items()}
    oracle = oracle_for(name)
    bad = []
    for i in range(len(packed[name])):
        desc, data, crafted = make_mutant(("flip", name, i, 0xFF), packed)
        v = oracle.judge(data, crafted=crafted, apis=ALL if i % 8 == 0 else ("open_packed",))
        if v.bad:
            bad.append(f"('flip', {name!r}, {i}, 255): " + "; ".join(v.findings))
    assert not bad, "\n".join(bad[:20])
