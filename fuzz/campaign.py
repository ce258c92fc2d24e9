"""Mutant specifications: small tuples that name one mutant exactly, so that any finding is
reproduced from its spec alone (`python -m fuzz.run --replay "SPEC"`).

    ("flip", sample, offset, mask)      one byte XOR mask
    ("trunc", sample, length)           the first `length` bytes
    ("blind", sample, seed)             mutators.random_blind with random.Random(seed)
    ("crafted", sample, seed)           mutators.random_crafted with random.Random(seed)
"""
from __future__ import annotations

import random
from typing import Dict, Iterator, List, Tuple

from . import mutators

Spec = Tuple


def make_mutant(spec: Spec, packed: Dict[str, bytes]) -> Tuple[str, bytes, bool]:
    """(description, bytes, crafted?) of the mutant `spec` names."""
    kind, name = spec[0], spec[1]
    data = packed[name]
    if kind == "flip":
        return f"flip byte {spec[2]} ^ {spec[3]:#x}", mutators.flip_byte(data, spec[2], spec[3]), False
    if kind == "trunc":
        return f"truncate to {spec[2]}", mutators.truncate(data, spec[2]), False
    rng = random.Random(f"{name}/{kind}/{spec[2]}")
    if kind == "blind":
        others = [packed[k] for k in sorted(packed)]
        desc, out = mutators.random_blind(rng, data, others)
        return desc, out, False
    if kind == "crafted":
        desc, out = mutators.random_crafted(rng, data)
        return desc, out, True
    raise ValueError(f"unknown mutant kind {kind!r}")


def sweep_specs(packed: Dict[str, bytes], names: List[str], masks=(0xFF,)) -> Iterator[Spec]:
    """Every single-byte flip (each mask) and every truncation point of the named samples."""
    for name in names:
        n = len(packed[name])
        for i in range(n):
            for m in masks:
                yield ("flip", name, i, m)
        for i in range(n):
            yield ("trunc", name, i)


def random_specs(names: List[str], seed: int, count: int, crafted_share: float = 0.5) -> Iterator[Spec]:
    rng = random.Random(seed)
    for _ in range(count):
        kind = "crafted" if rng.random() < crafted_share else "blind"
        yield (kind, rng.choice(names), rng.randrange(1 << 30))
