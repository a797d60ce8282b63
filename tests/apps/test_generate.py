"""apps/generate.py: one typed request, four jobs."""

import json

import pytest

from verinfer.apps.generate import GenerateRequest, generate
from verinfer.models.testbed import TARGET_DIR

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")


def test_the_request_names_its_job(tmp_path):
    base = dict(model_dir=TARGET_DIR, out=tmp_path / "c.jsonl")
    assert GenerateRequest(**base).job == "simulated"
    assert GenerateRequest(**base, deterministic="best").job == "deterministic"
    assert GenerateRequest(**base, speculative="kl").job == "speculative"
    assert GenerateRequest(**base, speculative="kl", engine="vllm").job == "vllm"   # the engine comes first
    with pytest.raises(ValueError, match="--engine"):
        GenerateRequest(**base, engine="sglang")
    with pytest.raises(ValueError, match="--fingerprint"):            # used by simulated providers only
        GenerateRequest(**base, deterministic="best", fingerprint="k=16,stride=4")
    with pytest.raises(ValueError):                                   # a bad spec fails before generating
        GenerateRequest(**base, fingerprint="k=0")


@pytest.mark.parametrize("extra", [{}, {"speculative": "standard"}, {"deterministic": "bf16"}])
def test_each_job_reports_what_it_wrote(tmp_path, extra):
    req = GenerateRequest(TARGET_DIR, tmp_path / "c.jsonl", n=3, max_tokens=8, **extra)
    g = generate(req)
    rows = [json.loads(line) for line in req.out.read_text().splitlines()]
    assert g.job == req.job and g.claims == len(rows) == 3
    assert g.tokens == sum(len(r["output_token_ids"]) for r in rows) > 0
    if "speculative" in extra:
        events = "".join(r["spec"]["events"] for r in rows)
        assert g.details == {"accepted": events.count("a"), "rounds": events.count("r") + events.count("b")}
