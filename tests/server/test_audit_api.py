"""`verinfer audit-api` against real `verinfer serve` processes: right verdicts for an honest and
a misconfigured (int4) server; a dead endpoint fails clearly and loses nothing collected."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

# every test here starts real `verinfer serve` processes and audits them (minutes on 2 cores)
pytestmark = pytest.mark.slow

import json

import openai

from .serverproc import free_port
from typer.testing import CliRunner
from verinfer.claims import read_claims
from verinfer.apps.audit_api import ApiAuditConfig, collect_claims
from verinfer.providers.openai_http import EndpointError, openai_client
from verinfer.models.prompts import prompts_for
from verinfer.cli.main import app
from verinfer.models.testbed import TARGET_DIR

# Calibration on four of the five honest configurations: honest-bf16-b1 (batch of one) alone costs
# as much as the other four here, and the stratified null's threshold is set by the noisiest ones.
AUDIT = ["--model", "verinfer-testbed-target", "--n", "24", "--max-tokens", "64", "--calib-n", "32", "--threads", "1",
         "--honest", "honest-bf16-b8", "--honest", "honest-fp32-b4", "--honest", "honest-bf16-eager-t1",
         "--honest", "honest-bf16-chunk13"]


def audit_api(base_url: str, out, detector, *extra: str) -> tuple[int, dict | None, str]:
    """`verinfer audit-api ...` (in this process: the servers are the real processes under test)."""
    r = CliRunner().invoke(app, ["audit-api", "--base-url", base_url, "--out", str(out), "--detector", str(detector),
                                 *AUDIT, *extra])
    rpath = out / "report.json"
    return r.exit_code, (json.loads(rpath.read_text()) if rpath.is_file() else None), r.output


@pytest.fixture(scope="module")
def detector_path(tmp_path_factory):
    return tmp_path_factory.mktemp("detector") / "seeded.json"


def test_honest_server_passes(honest_server, detector_path, tmp_path):
    code, report, log = audit_api(honest_server.base_url, tmp_path / "honest", detector_path)
    assert code == 0, log
    v = report["verdict"]
    assert report["mode"] == "seeded"  # auto mode found that the server honours seeds
    assert not v["flagged"] and v["n_tokens"] >= 1200
    assert report["exact_match"] >= 0.99
    assert detector_path.is_file()  # calibrated once, reused below


def test_int4_server_is_flagged(int4_server, detector_path, tmp_path):
    code, report, log = audit_api(int4_server.base_url, tmp_path / "int4", detector_path)
    assert code == 1, log
    v = report["verdict"]
    assert v["flagged"] and v["p_value"] < 1e-6, v
    assert "FLAGGED" in log


def test_dead_endpoint_fails_clearly(tmp_path, detector_path):
    port = free_port()  # nothing listens there
    code, report, log = audit_api(f"http://127.0.0.1:{port}/v1", tmp_path / "dead", detector_path,
                                  "--mode", "seeded", "--timeout", "5")
    assert code == 2 and report is None
    assert f"cannot reach http://127.0.0.1:{port}/v1" in log and "0 of 24 claims collected" in log
    assert "rerun the same command to resume" in log


class _DiesAfter:
    """An openai client whose endpoint dies after k answers."""

    def __init__(self, client, k: int):
        self.client, self.k = client, k
        self.completions = self.with_raw_response = self

    def create(self, **kw):
        if self.k == 0:
            raise openai.APIConnectionError(request=None)  # type: ignore[arg-type]
        self.k -= 1
        return self.client.completions.with_raw_response.create(**kw)


def test_resume_after_the_endpoint_died(honest_server, tmp_path):
    cfg = ApiAuditConfig(honest_server.base_url, "target", TARGET_DIR, tmp_path / "a", n=6, max_tokens=12)
    prompts = prompts_for(TARGET_DIR, cfg.n, cfg.seed)
    client = openai_client(cfg.endpoint)
    with pytest.raises(EndpointError, match=r"4 of 6 claims collected, saved in"):
        collect_claims(_DiesAfter(client, 4), cfg, "seeded", prompts, "verinfer-testbed-target")
    kept = read_claims(tmp_path / "a" / "claims.jsonl")
    assert [c.id for c in kept] == [f"api-{i:05d}" for i in range(4)]
    counter = _DiesAfter(client, 100)
    _, claims = collect_claims(counter, cfg, "seeded", prompts, "verinfer-testbed-target")
    assert counter.k == 98  # only the two missing prompts were sent again
    assert claims[:4] == kept and len(claims) == 6
    # the same directory refuses an audit with other settings instead of mixing claims
    other = ApiAuditConfig(honest_server.base_url, "target", TARGET_DIR, tmp_path / "a", n=6, max_tokens=13)
    with pytest.raises(Exception, match="holds claims of another audit"):
        collect_claims(client, other, "seeded", prompts, "verinfer-testbed-target")


def test_greedy_mode_places_the_endpoint_among_reference_bands(int4_server, tmp_path):
    """Temperature 0 (for endpoints that ignore seeds): verdict plus the endpoint's mean clipped
    margin and cross-entropy beside verinfer's own bf16 / fp8-KV / int4 greedy runs (small sizes:
    this checks the path and the report, not the power)."""
    out = tmp_path / "greedy"
    r = CliRunner().invoke(app, ["audit-api", "--base-url", int4_server.base_url, "--model", "target", "--out",
                                 str(out), "--mode", "greedy", "--n", "8", "--max-tokens", "32", "--calib-n", "48",
                                 "--threads", "1", "--honest", "honest-bf16-b8", "--honest", "honest-fp32-b4"])
    assert r.exit_code in (0, 1), r.output
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "greedy" and report["n_tokens"] >= 100
    assert set(report["reference_bands"]) == {"bf16", "fp8-kv", "int4"}
    for band in [*report["reference_bands"].values(), report["endpoint"]]:
        lo, hi = band["margin"]["ci95"]
        assert 0 <= lo <= band["margin"]["mean"] <= hi
    assert report["verdict"]["nearest_band"] in report["reference_bands"]
    assert "Nearest band" in (out / "report.md").read_text()
    assert (r.exit_code == 1) == report["verdict"]["flagged"]
    assert report["verdict"]["score"] == "greedy"  # temperature-0 claims get the greedy detector (detect/greedy.py)


def test_collection_stops_sending_requests_once_decided(honest_server, tmp_path):
    """--sequential's stop rule: collect_claims asks it after each answer and sends nothing more once
    it says decided (here: after 3 answers); a resumed collection asks it first."""
    cfg = ApiAuditConfig(honest_server.base_url, "target", TARGET_DIR, tmp_path / "s", n=8, max_tokens=8)
    prompts = prompts_for(TARGET_DIR, cfg.n, cfg.seed)
    counter = _DiesAfter(openai_client(cfg.endpoint), 100)
    seen = []
    stop = lambda claims: seen.append(len(claims)) or len(claims) >= 3  # noqa: E731
    _, claims = collect_claims(counter, cfg, "seeded", prompts, "verinfer-testbed-target", stop=stop)
    assert len(claims) == 3 and counter.k == 97 and seen == [1, 2, 3]
    _, again = collect_claims(counter, cfg, "seeded", prompts, "verinfer-testbed-target", stop=stop)
    assert again == claims and counter.k == 97                         # decided: nothing sent on resume


def test_sequential_audit_api_reports_where_it_decided(int4_server, tmp_path):
    """audit-api --sequential end to end (small sizes: the path and the report, not the power): the
    glrt is calibrated first on gap scores; the verdict is the e-process's; when flagged, fewer
    requests than planned were sent and the decision is at or before the tokens collected."""
    out = tmp_path / "seq"
    r = CliRunner().invoke(app, ["audit-api", "--base-url", int4_server.base_url, "--model", "target", "--out",
                                 str(out), "--mode", "seeded", "--sequential", "--n", "40", "--max-tokens", "32",
                                 "--calib-n", "24", "--threads", "1", "--honest", "honest-bf16-b8", "--honest",
                                 "honest-fp32-b4", "--honest", "honest-bf16-eager-t1"])
    assert r.exit_code in (0, 1), r.output
    v = json.loads((out / "report.json").read_text())["verdict"]
    assert v["score"] == "sequential-e-process" and v["requests_planned"] == 40 and (r.exit_code == 1) == v["flagged"]
    if v["flagged"]:
        assert v["requests_sent"] < 40 and 1 <= v["decided_at_tokens"] <= v["tokens_available"]
    else:
        assert v["requests_sent"] == 40 and v["decided_at_tokens"] is None
    assert json.loads((out / "detector.json").read_text())["format"] == "verinfer.PerturbationGLRTDetector"
    r = CliRunner().invoke(app, ["audit-api", "--base-url", int4_server.base_url, "--model", "target", "--out",
                                 str(tmp_path / "g"), "--mode", "greedy", "--sequential"])
    assert r.exit_code == 2 and "--sequential needs seeded claims" in r.output
