"""benchmarks.audit_sampled and benchmarks.sampled_vendors: the pieces the sampled-traffic benchmark
is computed with (vendors and what their serving layer changes, batch statistics from per-request
sums against the detector's own statistic, batches, the false-positive bound, the log it audits)."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from benchmarks import audit_sampled as A
from benchmarks import sampled_vendors as V


def test_vendors_and_their_names():
    assert V.vendors("t0.7") == [*V.HONEST, "int4", "int8", "fp8-kv", "temp+0.1", "system-prompt", "draft",
                                 "int4-tuned-temp"]
    assert "top-p-0.9" in V.vendors("t1.0") and len(V.vendors("t1.0")) == len(V.vendors("t0.7")) + 1
    assert len(V.all_vendors()) == 21 and len(set(V.all_vendors())) == 21
    assert V.split_name("temp+0.1-t1.0") == ("temp+0.1", "t1.0")
    assert V.split_name("honest-no-prefix-cache-t0.7") == ("honest-no-prefix-cache", "t0.7")
    with pytest.raises(ValueError, match="unknown sampled vendor"):
        V.split_name("int4-t0.5")
    # every vendor its own seeds: honest vendors never answer with the same sample
    assert len({V.vendor_seed(n) for n in V.all_vendors()}) == 21


def test_what_the_serving_layer_changes(tmp_path, monkeypatch):
    assert V.force_of("temp+0.1-t0.7") == {"temperature": 0.8}
    assert V.force_of("temp+0.1-t1.0") == {"temperature": 1.1}
    assert V.force_of("top-p-0.9-t1.0") == {"top_p": 0.9}
    assert V.force_of("honest-t0.7") is None and V.force_of("int4-t1.0") is None
    monkeypatch.setattr(V, "TUNED", tmp_path / "tuned.json")
    (tmp_path / "tuned.json").write_text(json.dumps({"t0.7": {"tuned_temperature": 0.55}}))
    assert V.force_of("int4-tuned-temp-t0.7") == {"temperature": 0.55}


def test_request_index_and_chunks():
    assert A.request_index("int4-t0.7-c003-00042") == 3 * V.CHUNK + 42
    assert A.request_index("temp+0.1-t1.0-c000-00007") == 7


def test_batches_draw_without_replacement_while_small():
    rng = np.random.default_rng(0)
    b = A.draw_batches(1000, 100, 50, rng)
    assert b.shape == (50, 100) and all(len(set(row)) == 100 for row in b)
    big = A.draw_batches(100, 60, 20, rng)
    assert big.shape == (20, 60) and big.max() < 100
    assert any(len(set(row)) < 60 for row in big)  # with replacement: some request drawn twice


def test_clopper_pearson_upper_bound():
    assert A.clopper_pearson_upper(0, 300) == pytest.approx(1 - 0.05 ** (1 / 300), rel=1e-9)
    assert A.clopper_pearson_upper(3, 300) == pytest.approx(0.0258, abs=5e-4)
    assert A.clopper_pearson_upper(5, 5) == 1.0


def synthetic_scores(provider: str, n_claims: int, rng: np.random.Generator, power: float = 1.0) -> pa.Table:
    """Unseeded score rows of n_claims claims of 5-29 tokens: PIT u ** power (1: honest), entropy
    and a cross-entropy around it (what the unseeded detectors read)."""
    from verinfer.scores import CLAIM_ID, CROSS_ENTROPY, ENTROPY, MODE, PIT, POSITION, PROVIDER

    cols: dict[str, list] = {k: [] for k in (CLAIM_ID, PROVIDER, POSITION, MODE, PIT, ENTROPY, CROSS_ENTROPY)}
    for c in range(n_claims):
        T = int(rng.integers(5, 30))
        h = rng.gamma(2.0, 0.5, T)
        cols[CLAIM_ID] += [f"{provider}-{c}"] * T
        cols[PROVIDER] += [provider] * T
        cols[POSITION] += list(range(T))
        cols[MODE] += ["unseeded"] * T
        cols[PIT] += list(rng.random(T) ** power)
        cols[ENTROPY] += list(h)
        cols[CROSS_ENTROPY] += list(h + rng.normal(0, power, T))
    return pa.table(cols)


@pytest.mark.parametrize("kind", ["pit-uniformity", "xent-excess"])
def test_batch_statistics_from_request_sums_equal_the_detectors_own(kind):
    """The AUC batches are computed from per-request sums; a batch's statistic must be the
    detector's `statistic_of` on the batch's token evidence."""
    import pyarrow.compute as pc

    from verinfer.detect.calibrate import calibrate
    from verinfer.scores import CLAIM_ID

    rng = np.random.default_rng(0)
    det = calibrate(pa.concat_tables([synthetic_scores(g, 60, rng) for g in ("a", "b")]), ["a", "b"], detector=kind)
    table = synthetic_scores("vendor", 40, rng, power=1.3)
    per = A.per_request(det, table)
    assert per["counts"].sum() == len(det.token_scores(table)) == table.num_rows and len(per["ids"]) == 40
    batches = np.stack([rng.choice(40, 6, replace=False) for _ in range(5)])
    fast = A.batch_statistics(det, per["sums"], per["counts"], batches)
    for b, s in zip(batches, fast):
        sub = table.filter(pc.is_in(table[CLAIM_ID], value_set=pa.array([per["ids"][i] for i in b])))
        assert s == pytest.approx(det.statistic_of(np.asarray(det.token_scores(sub))), rel=1e-9, abs=1e-12)
    assert fast.min() > 0 and len(set(fast.round(9))) == 5


def test_the_log_logs_half_the_requests_with_their_seed(tmp_path, monkeypatch):
    from verinfer.claims import Claim
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.retokenize import Retokenizer
    from verinfer.sampling.params import SamplingParams

    retok = Retokenizer.for_model(TARGET_DIR)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]

    def claims(name, limit=None):
        p = SamplingParams(0.7, -1, 1.0, 0.0, 11, 8, "vllm-cpu")
        return [Claim.from_chat(f"{name}-c000-{i:05d}", "m", msgs, f"reply {i}", "length", p, retok)
                for i in range(limit)]

    monkeypatch.setattr(A, "vendor_claims", claims)
    monkeypatch.setattr(A, "LOG_EXCHANGES", 3)
    lines = [json.loads(x) for x in A.sampled_log(tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(lines) == 6 * len(A.LOG_VENDORS)
    first = lines[: 6]
    assert [("seed" in x["request"]) for x in first] == [True] * 3 + [False] * 3
    assert first[0]["request"]["seed"] == 11 and first[0]["request"]["temperature"] == 0.7
    assert first[4]["response"]["choices"][0]["message"]["content"] == "reply 4"
    assert {x["response"]["model"] for x in lines} == set(A.LOG_VENDORS)
