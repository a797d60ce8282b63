"""benchmarks/margingate.py: a cache from another machine is refused; references are compared
across machines sequence by sequence."""

import json

import pytest

from benchmarks.margingate import check_cache_machine, cross_machine
from verinfer.numerics.machine import machine_fingerprint


def test_cache_is_stamped_then_refused_on_another_machine(tmp_path):
    here = machine_fingerprint(threads=1)
    cache = tmp_path / "margingate_cache"
    check_cache_machine(cache, here)  # new cache: stamped with this machine
    assert json.loads((cache / "machine.json").read_text()) == here
    check_cache_machine(cache, here)  # same machine: accepted
    (cache / "machine.json").write_text(json.dumps(dict(here, cpu_model="Other CPU")))
    with pytest.raises(SystemExit, match=r"recorded on another machine \(cpu_model: recorded 'Other CPU'.*--cross-machine"):
        check_cache_machine(cache, here)


def test_cross_machine_counts_differing_sequences_and_first_divergence(tmp_path):
    mine = {"code0": [1, 2, 3, 4], "code1": [5, 6, 7], "free0": [9, 9], "code2": [1, 1]}
    other = {"code0": [1, 2, 9, 4], "code1": [5, 6, 7], "free0": [8, 9], "code2": [1, 1, 1]}
    (tmp_path / "reference.json").write_text(json.dumps(other))
    (tmp_path / "reference_tiled.json").write_text(json.dumps(mine))
    (tmp_path / "machine.json").write_text(json.dumps({"label": "box B"}))
    got = cross_machine(dict(reference=mine, reference_tiled=mine), tmp_path, ["code0", "code1", "code2"])
    assert got["other"] == {"label": "box B"}
    best = got["references"]["best"]
    assert (best["sequences"], best["differ"], best["protected_differ"]) == (4, 3, 2)
    assert best["first_divergence"] == [0, 2, 2] and not best["same"]  # free0 at 0, code0 at 2, code2 at its end
    assert got["references"]["batch_invariant"] == dict(sequences=4, differ=0, protected_differ=0,
                                                        first_divergence=[], same=True)
