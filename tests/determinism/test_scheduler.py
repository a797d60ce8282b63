import pytest
import torch

from verinfer.determinism.scheduler import Scheduler
from verinfer.engine.engine import Request
from verinfer.sampling.params import SamplingParams


def _workload(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        p = torch.randint(3, 2000, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        reqs.append(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=int(torch.randint(6, 20, (1,), generator=g)))))
    return reqs


def _reference(det_engine, reqs):
    out, _ = Scheduler(det_engine, det_engine, "batch_invariant", max_batch=1).run(reqs)
    return out


@pytest.mark.slow
def test_continuous_batching_bf16_matches_engine_generate_token_counts(fast_engine, det_engine):
    reqs = _workload()
    out, st = Scheduler(fast_engine, det_engine, "bf16", max_batch=4).run(reqs)
    assert sorted(out) == sorted(r.id for r in reqs)
    assert all(len(out[r.id]) == r.params.max_tokens for r in reqs)
    # the batch-invariant policy in a continuous batch equals the batch-size-1 reference bitwise
    ref = _reference(det_engine, reqs)
    got, _ = Scheduler(fast_engine, det_engine, "batch_invariant", max_batch=4).run(reqs)
    assert got == ref


@pytest.mark.slow
def test_llm42_and_gated_llm42_at_infinite_tau_are_exact(fast_engine, det_engine):
    reqs = _workload(seed=1)
    ref = _reference(det_engine, reqs)
    protected = {r.id for r in reqs[::2]}
    for policy, kw in (("llm42", dict(window=5)), ("gated_llm42", dict(window=3, tau=float("inf")))):
        got, st = Scheduler(fast_engine, det_engine, policy, max_batch=5, **kw).run(reqs, protected)
        for rid in protected:
            assert got[rid] == ref[rid], (policy, rid)
        assert st.verify_passes > 0
        assert st.rates()["trigger_rate"] >= 0.9  # every protected token replayed


@pytest.mark.slow
def test_best_equals_the_reference_without_verifying(fast_engine, det_engine):
    """best decodes on the fixed-shape path: protected rows equal the batch-size-1 reference in
    every batch size, with nothing triggered; bf16 on the same workload is compared too."""
    reqs = _workload(n=10, seed=3)
    ref = _reference(det_engine, reqs)
    protected = {r.id for r in reqs[1::2]}
    for max_batch in (3, 10):
        got, st = Scheduler(fast_engine, det_engine, "best", max_batch=max_batch).run(reqs, protected)
        assert {rid: got[rid] for rid in protected} == {rid: ref[rid] for rid in protected}
        assert st.triggered == 0 and st.verify_passes == 0 and st.rolled_back == 0
        assert st.protected_steps == sum(r.params.max_tokens for r in reqs if r.id in protected)


def test_margingate_live_cache_rates_and_zero_tau_is_bf16_after_det_prefill(fast_engine, det_engine):
    reqs = _workload(seed=2)
    mg0, st0 = Scheduler(fast_engine, det_engine, "margingate_live_cache", tau=0.0, max_batch=5).run(reqs)
    assert st0.triggered == 0 and st0.repaired == 0
    mg, st = Scheduler(fast_engine, det_engine, "margingate_live_cache", tau=1e9, max_batch=5).run(reqs)
    assert st.triggered == st.protected_steps - len(reqs)  # every step but the det-prefill first one
    assert 0 <= st.repaired <= st.triggered


def test_cli_generate_deterministic(tmp_path):
    import json

    from typer.testing import CliRunner

    from verinfer.cli.main import app

    out = tmp_path / "c.jsonl"
    r = CliRunner().invoke(app, ["generate", "--deterministic", "llm42", "-o", str(out), "--n", "2",
                                 "--max-tokens", "6"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(x["output_token_ids"]) == 6 for x in rows)
    r = CliRunner().invoke(app, ["generate", "--deterministic", "margingate", "-o", str(out),
                                 "--tau-file", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "calibrate --policy margingate" in r.output
    # the paper's method's old name still works for a release, with a one-line warning
    r = CliRunner().invoke(app, ["generate", "--deterministic", "margingate_contract", "-o", str(out),
                                 "--tau-file", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "calibrate --policy margingate" in r.output
    assert "margingate_contract is deprecated, now called margingate" in r.output
    assert "margingate_contract" not in CliRunner().invoke(app, ["generate", "--help"]).output


def test_renamed_policy_names_are_hidden_aliases_with_a_deprecation_warning(fast_engine, det_engine):
    from verinfer.determinism import margingate as mg
    from verinfer.determinism.scheduler import POLICIES, RENAMED

    assert RENAMED == {"margingate_contract": "margingate"} and "margingate_contract" not in POLICIES
    with pytest.warns(DeprecationWarning, match="now called 'margingate'"):
        s = Scheduler(fast_engine, det_engine, "margingate_contract", tau=0.5)
    assert isinstance(s.policy, mg.MarginGate) and s.policy_name == "margingate"
    assert isinstance(Scheduler(fast_engine, det_engine, "margingate_live_cache", tau=0.5).policy,
                      mg.MarginGateLiveCache)


@pytest.mark.slow
def test_server_deterministic_best_gives_the_reference_tokens(fast_engine, det_engine):
    """`verinfer serve --deterministic best`: a lone greedy request's tokens equal what the best
    policy gives the same prompt inside a continuous batch (the determinism reference)."""
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.server.generation import generate_steps
    from verinfer.server.registry import load_registry

    reqs = _workload(n=6, seed=4)
    ref = _reference(det_engine, reqs)
    batched, _ = Scheduler(fast_engine, det_engine, "best", max_batch=6).run(reqs)
    served = load_registry(TARGET_DIR, deterministic="best")["verinfer-testbed-target"]
    plain = load_registry(TARGET_DIR)["verinfer-testbed-target"]
    for r in reqs:
        got = [s.token_id for s in generate_steps(served, r.id, r.prompt_token_ids, r.params, ignore_eos=True)]
        assert got == ref[r.id] == batched[r.id]
    # without the flag the server decodes on the default path: same model, other kernels
    assert type(plain.engine.model).__name__ == type(served.engine.model).__name__ == "LlamaLM"
    assert plain.engine.model.kernels.name == "native" and served.engine.model.kernels.name == "fixed_shape"
    with pytest.raises(Exception, match="deterministic"):
        load_registry(TARGET_DIR, deterministic="llm42")  # its rollbacks would take back streamed tokens


def test_margingate_verifier_gives_the_references_logits_for_each_prefix(fast_engine, det_engine,
                                                                                  monkeypatch):
    """The paper's contract (section 3.2): at every trigger, margingate's verifier's logits are the
    deterministic path's logits for the row's token prefix alone, bit for bit, whatever the batch
    around it (two batch sizes, other rows co-batched); the live-cache ablation's are not."""
    from verinfer.determinism import margingate as mg

    reqs = _workload(n=6, seed=4)
    protected = {r.id for r in reqs[::2]}
    prompts = {r.id: r.prompt_token_ids for r in reqs}
    seen = []
    real = mg.catch_up

    def record(det, batch, trig, shadows):
        v_NV = real(det, batch, trig, shadows)
        seen.extend((batch.requests[b].id, mg.sequence_of(batch, b), v_NV[i].clone()) for i, b in enumerate(trig))
        return v_NV

    monkeypatch.setattr(mg, "catch_up", record)
    for max_batch in (3, 8):
        Scheduler(fast_engine, det_engine, "margingate", tau=1.0, max_batch=max_batch).run(reqs, protected)
    assert len(seen) > 20 and {rid for rid, _, _ in seen} == protected
    for rid, seq, v_V in seen[::3]:
        P = len(prompts[rid])
        one = Request(rid, prompts[rid], SamplingParams(temperature=0.0, max_tokens=1))
        _, lg, _ = det_engine.prefill_extend([one], torch.tensor([seq[P:]], dtype=torch.long), extra_slots=0)
        assert torch.equal(v_V, lg[0, -1]), (rid, len(seq))


def test_margingate_at_infinite_tau_is_exact_and_zero_tau_is_bf16(fast_engine, det_engine):
    reqs = _workload(n=10, seed=5)
    ref = _reference(det_engine, reqs)
    protected = {r.id for r in reqs[1::2]}
    got, st = Scheduler(fast_engine, det_engine, "margingate", tau=float("inf"), max_batch=6).run(
        reqs, protected)
    assert {rid: got[rid] for rid in protected} == {rid: ref[rid] for rid in protected}
    assert st.triggered == st.protected_steps - len(protected)  # every step but the det-prefill first one
    _, st0 = Scheduler(fast_engine, det_engine, "margingate", tau=0.0, max_batch=6).run(reqs, protected)
    assert st0.triggered == 0 and st0.repaired == 0
