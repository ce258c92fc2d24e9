"""Corruption suite of the `.onnxz` readers (issue 6 item 2).

For small packed models covering every codec family of FORMAT.md: every single-byte flip,
every truncation point, and seeded random splices, overwrites and insertions; each mutant goes
through load, open_packed + get_tensor of every key, unpack and verify (fuzz/oracle.py), and
each must give a documented error or exactly the original (no crash, no wrong tensor, no partial
output). The long version of this (all samples, several masks, crafted files) is
`python -m fuzz.run`; see fuzz/README.md.
"""
from __future__ import annotations

import collections
import random

import pytest

from fuzz.campaign import make_mutant
from fuzz.samples import REQUIRED_FAMILIES, check_families

CHEAP = ("open_packed",)                 # every mutant: get_tensor hashes no whole file, the riskiest path
ALL = ("load", "open_packed", "unpack", "verify", "session")  # every FULL_STRIDE-th mutant, and the truncations
FULL_STRIDE = 8
SWEPT = ["all_families", "ans_families", "external_data", "fpairs_forced",  # every codec family between them
         "shared_tables", "shared_long_blobs"]  # format 1.2: shared tables, short blobs longer than their plane


def _sweep(oracle, specs, packed, apis_for):
    """(verdict counts of the mutants judged by every API, list of misbehaviours)."""
    verdicts = collections.Counter()
    bad = []
    for spec in specs:
        desc, data, crafted = make_mutant(spec, packed)
        apis = apis_for(spec)
        v = oracle.judge(data, crafted=crafted, apis=apis)
        if apis == ALL:
            verdicts[v.verdict] += 1
        if v.bad:
            bad.append(f"{spec} {desc}: " + "; ".join(v.findings))
    return verdicts, bad


def test_samples_cover_every_codec_family(samples):
    assert REQUIRED_FAMILIES <= check_families(list(samples.values()))
    assert REQUIRED_FAMILIES <= check_families([samples[n] for n in SWEPT])


def test_unmutated_samples_decode_identically(samples, oracle_for):
    for name in samples:
        v = oracle_for(name).judge(samples[name].packed)
        assert v.verdict == "identical", (name, v.findings, v.errors)


@pytest.mark.parametrize("name", SWEPT)
def test_every_byte_flip(samples, oracle_for, name):
    packed = {n: s.packed for n, s in samples.items()}
    n = len(packed[name])
    specs = [("flip", name, i, 0xFF) for i in range(n)]
    verdicts, bad = _sweep(oracle_for(name), specs, packed,
                           lambda spec: ALL if spec[2] % FULL_STRIDE == 0 else CHEAP)
    assert not bad, f"{len(bad)} of {n} flips misbehaved:\n" + "\n".join(bad[:20])
    # Every byte is under a check (header CRC, chunk CRCs, index CRC, digest of restored files):
    # a reader that restores the whole file must refuse every flip. (get_tensor alone may give
    # identical tensors for a flip in a part it does not read, e.g. the skeleton.)
    assert verdicts["identical"] == 0, verdicts
    assert sum(verdicts.values()) == len(range(0, n, FULL_STRIDE))


@pytest.mark.parametrize("name", SWEPT)
def test_every_truncation_point(samples, oracle_for, name):
    packed = {n: s.packed for n, s in samples.items()}
    n = len(packed[name])
    specs = [("trunc", name, i) for i in range(n)]
    verdicts, bad = _sweep(oracle_for(name), specs, packed, lambda spec: ALL)
    assert not bad, "\n".join(bad[:20])
    assert verdicts == {"refused": n}, verdicts


def test_random_blind_mutations_all_samples(samples, oracle_for):
    """Flips of random masks, bit flips, overwrites, insertions, deletions, splices of two
    samples, appended bytes: 600 seeded mutants over every sample."""
    packed = {n: s.packed for n, s in samples.items()}
    rng = random.Random(6)
    names = sorted(packed)
    bad, verdicts = [], collections.Counter()
    for _ in range(600):
        spec = ("blind", rng.choice(names), rng.randrange(1 << 30))
        desc, data, crafted = make_mutant(spec, packed)
        v = oracle_for(spec[1]).judge(data, crafted=crafted, apis=ALL)
        verdicts[v.verdict] += 1
        if v.bad:
            bad.append(f"{spec} {desc}: " + "; ".join(v.findings))
    assert not bad, "\n".join(bad[:20])
    assert verdicts["refused"] >= 590, verdicts  # only a mutation that changes nothing may be identical


def test_splices_between_samples(samples, oracle_for):
    """The head of one packed file glued to the tail of another at 200 seeded cut points."""
    from fuzz import mutators

    names = sorted(samples)
    rng = random.Random(3)
    bad = []
    for _ in range(200):
        a, b = rng.sample(names, 2)
        pa, pb = samples[a].packed, samples[b].packed
        data = mutators.splice(pa, pb, rng.randrange(len(pa)), rng.randrange(len(pb)))
        v = oracle_for(a).judge(data, apis=ALL)
        if v.bad or v.verdict != "refused":
            bad.append(f"{a}+{b}: {v.verdict} " + "; ".join(v.findings))
    assert not bad, "\n".join(bad[:20])
