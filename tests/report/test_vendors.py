import base64
import copy
import json
import re

import pytest

from verinfer.errors import VerinferError
from verinfer.report.vendors import (FIG_SIZE, PNG_SUFFIX, VendorsDoc, load_vendors, render_vendors_html,
                                     summarize_vendors, validate_vendors, vendors_figure)
from verinfer.report.plots import DPI

from tests.report.test_html import PNG, _Page

VENDOR_COLUMNS = ["vendor", "served model", "verdict", "p", "nearest band", "exact match", "margin",
                  "cross_entropy", "tokens", "requests", "to decide", "retokenized", "resegmented"]


def _iv(mean, half):
    return {"mean": mean, "ci95": [mean - half, mean + half]}


def vendors_doc() -> dict:
    """vendors.json as apps.audit_chat writes it: an honest vendor, a flagged one (nearest the int4
    band, stopped early), one that could not be audited; two reference bands."""
    return {
        "title": "verinfer audit of 3 chat endpoint(s) serving acme/chat-7b", "model": "acme/chat-7b",
        "trusted_model": "chat-7b-instruct", "trusted_weights_sha256": "ab" * 32,
        "created": "2025-03-04T05:06:07+00:00", "verinfer_version": "0.9.1", "target_fpr": 0.01, "mode": "greedy",
        "settings": {"max_tokens": 256, "n_prompts": 64, "seed": 0, "bands": ["bf16", "int4"]},
        "detector": {"summary": "clipped-mean margin"},  # extra keys are kept, not refused
        "bands": {
            "bf16": {"margin": _iv(0.002, 0.001), "cross_entropy": _iv(0.05, 0.01), "mismatch": _iv(0.01, 0.004),
                     "n_tokens": 16000, "n_claims": 64, "description": "honest: bf16, batches of 8"},
            "int4": {"margin": _iv(0.03, 0.006), "cross_entropy": _iv(0.21, 0.03), "mismatch": _iv(0.09, 0.01),
                     "n_tokens": 16000, "n_claims": 64, "description": "4-bit weights"}},
        "vendors": [
            {"name": "honest-cloud", "base_url": "https://api.honest.example/v1", "served_model": "acme/chat-7b",
             "verdict": {"flagged": False, "p_value": 0.41, "decision": "consistent with honest", "fixed_n": {}},
             "nearest_band": "bf16", "exact_match": 0.9876, "margin": _iv(0.0025, 0.001),
             "cross_entropy": _iv(0.052, 0.01), "mismatch": _iv(0.0124, 0.004), "n_tokens": 15873, "n_requests": 64,
             "tokens_to_decide": None, "requests_to_decide": None, "retokenized": 1.0, "resegmented": 0.03125,
             "drift": None, "error": None},
            {"name": "cheap-<script>alert(1)</script>", "base_url": "https://cheap.example/v1",
             "served_model": "chat-7b-awq",
             "verdict": {"flagged": True, "p_value": 0.0, "decision": "flagged", "decided_at_tokens": 2048},
             "nearest_band": "int4", "exact_match": 0.912, "margin": _iv(0.031, 0.008),
             "cross_entropy": _iv(0.2, 0.04), "mismatch": _iv(0.088, 0.02), "n_tokens": 2301, "n_requests": 12,
             "tokens_to_decide": 2048, "requests_to_decide": 9, "retokenized": 1.0, "resegmented": 0.0,
             "drift": None, "error": None},
            {"name": "dead $vendor", "base_url": "http://10.0.0.9:8000/v1", "served_model": "acme/chat-7b",
             "verdict": None, "nearest_band": None, "exact_match": None, "margin": None, "cross_entropy": None,
             "mismatch": None, "n_tokens": 0, "n_requests": 0, "tokens_to_decide": None, "requests_to_decide": None,
             "retokenized": None, "resegmented": None, "drift": None,
             "error": "connection refused <after 3 retries> & gave up"}]}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = render_vendors_html(vendors_doc(), tmp_path_factory.mktemp("vendors") / "vendors.html")
    return out, out.read_text()


def _rows(p: _Page) -> dict[str, dict]:
    return {i: dict(zip(VENDOR_COLUMNS, p.rows[f"vendor-{i}"])) for i in (1, 2, 3)}


def test_page_has_a_row_per_vendor_with_its_verdict(page):
    out, text = page
    assert out.name == "vendors.html" and not list(out.parent.glob(".*tmp"))  # atomic: nothing left behind
    rows = _rows(_Page(text))
    ok, bad, dead = rows[1], rows[2], rows[3]
    assert ok["vendor"] == "honest-cloud https://api.honest.example/v1" and ok["verdict"] == "ok"
    assert ok["p"] == "0.41" and ok["nearest band"] == "bf16" and ok["exact match"] == "0.9876"
    assert ok["margin"] == "0.0025 [0.0015, 0.0035]" and ok["cross_entropy"] == "0.052 [0.042, 0.062]"  # mean, CI
    assert (ok["tokens"], ok["requests"], ok["to decide"]) == ("15,873", "64", "\u2014")
    assert (ok["retokenized"], ok["resegmented"]) == ("100%", "3.1%")
    assert bad["vendor"].startswith("cheap-<script>alert(1)</script>")  # the text, shown as text
    assert bad["verdict"] == "FLAGGED" and bad["p"] == "<1e-300" and bad["nearest band"] == "int4"
    assert bad["to decide"] == "2,048 / 9" and bad["resegmented"] == "0%"
    # the vendor that could not be audited is a row with its error, not dropped
    assert dead["vendor"].startswith("dead $vendor") and dead["verdict"] == "error"
    assert dead["served model"] == "acme/chat-7b" and dead["p"] == "connection refused <after 3 retries> & gave up"
    assert re.findall(r'data-status="(\w+)"', text) == ["ok", "flagged", "error"]


def test_page_says_what_was_audited_and_summarizes_first(page):
    _, text = page
    p = _Page(text)
    assert p.by_id["model"] == "acme/chat-7b" and p.by_id["trusted-model"] == "chat-7b-instruct"
    assert p.by_id["weights"] == "ab" * 32 and p.by_id["version"] == "0.9.1"
    assert p.by_id["created"] == "2025-03-04 05:06 UTC" and p.by_id["target-fpr"] == "1%"
    assert p.by_id["settings"] == 'max_tokens 256, n_prompts 64, seed 0, bands ["bf16", "int4"]'
    assert " ".join(p.by_id["summary"].split()) == (
        "1 of 3 vendors consistent with honest inference of acme/chat-7b; 1 flagged "
        "(cheap-<script>alert(1)</script>); 1 could not be audited (dead $vendor). "
        "Each verdict is a calibrated test at a 1% target false-positive rate.")
    assert text.index('id="summary"') < text.index('id="vendors"') < text.index('id="bands"') < text.index("<img")
    how = " ".join(p.by_id["how-to-read"].split())
    assert "no universal exact-match threshold" in how and "1% target false-positive rate" in how
    assert "Nearest band" in how


def test_every_string_is_escaped(page):
    _, text = page
    assert "<script>" not in text
    assert "cheap-&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "connection refused &lt;after 3 retries&gt; &amp; gave up" in text
    doc = vendors_doc()
    doc["title"] = '<img src=x onerror="alert(1)">'
    doc["settings"] = {"<b>bold": "</td>"}
    doc["bands"]["int4"]["description"] = "<i>4-bit</i>"
    text = render_vendors_html(doc, page[0].parent / "esc" / "v.html").read_text()
    assert "<img src=x" not in text and "<b>bold" not in text and "<i>" not in text and "</td>," not in text
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in text and "&lt;i&gt;4-bit&lt;/i&gt;" in text


def test_bands_table_and_figure_are_embedded_and_written_next_to_the_page(page):
    out, text = page
    p = _Page(text)
    b1, b2 = p.rows["band-1"], p.rows["band-2"]
    assert b1 == ["bf16", "honest: bf16, batches of 8", "16,000", "0.002 [0.001, 0.003]", "0.05 [0.04, 0.06]",
                  "0.01 [0.006, 0.014]", "honest-cloud"]
    assert b2[0] == "int4" and b2[-1] == "cheap-<script>alert(1)</script>"
    assert len(p.imgs) == 1
    img = p.imgs[0]
    assert img["data-file"] == "vendors" + PNG_SUFFIX and img["alt"]
    png = base64.b64decode(img["src"].removeprefix("data:image/png;base64,"))
    assert png[:8] == PNG and png == (out.parent / img["data-file"]).read_bytes()
    w, h = round(FIG_SIZE[0] * DPI), round(FIG_SIZE[1] * DPI)
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (w, h)
    assert (img["width"], img["height"]) == (str(w), str(h))


def test_figure_has_a_point_per_audited_vendor_and_a_band_per_reference():
    fig = vendors_figure(vendors_doc())
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["mean clipped margin", "mean cross-entropy",
                                               "mismatch rate (1 - exact match)"]
    for ax, (ok, flagged) in zip(axes, ((0.0025, 0.031), (0.052, 0.2), (0.0124, 0.088))):
        points = [(c.lines[0].get_xdata().tolist(), c.lines[0].get_ydata().tolist()) for c in ax.containers]
        assert points == [([0], [ok]), ([1], [flagged])]  # 2 audited vendors; the dead one has no point
        colors = [c.lines[0].get_color() for c in ax.containers]
        assert colors == ["#007700", "#bb0000"]
        spans = [p for p in ax.patches if (p.get_gid() or "").startswith("band:")]
        assert [p.get_gid() for p in spans] == ["band:bf16", "band:int4"]
        # long names cut (the table has them whole); '$' escaped: matplotlib draws it, not mathtext
        assert [t.get_text() for t in ax.get_xticklabels()] == ["honest-cloud", "cheap-<script>alert(1)<\u2026",
                                                               r"dead \$vendor"]
        assert any(t.get_text() == "error" for t in ax.texts)  # the dead vendor's slot is marked
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["vendor: ok", "vendor: flagged", "vendor: error"]
    assert labels[3:] == ["band: bf16 (honest: bf16, batches of 8)", "band: int4 (4-bit weights)"]
    fig.canvas.draw()  # '$' in a vendor name does not start mathtext


def test_mismatch_falls_back_to_one_minus_exact_match():
    doc = vendors_doc()
    for v in doc["vendors"]:
        v.pop("mismatch")
    fig = vendors_figure(doc)
    ys = [c.lines[0].get_ydata().tolist() for c in fig.axes[2].containers]
    assert ys == [[pytest.approx(1 - 0.9876)], [pytest.approx(1 - 0.912)]]


def test_a_vendor_with_numbers_and_an_error_is_drawn_as_error():
    doc = vendors_doc()
    doc["vendors"][0]["error"] = "stopped after 64 of 128 requests: rate limited"
    assert summarize_vendors(validate_vendors(doc)).startswith("0 of 3 vendors consistent")
    fig = vendors_figure(doc)
    colors = sorted(c.lines[0].get_color() for c in fig.axes[0].containers)
    assert colors == ["#777777", "#bb0000"]


@pytest.mark.parametrize("change, field, says", [
    (lambda d: d["vendors"][1]["verdict"].update(flagged="yes"), "vendors[1] ('cheap-<script>alert(1)</script>')"
     ".verdict.flagged", "valid boolean"),
    (lambda d: d["vendors"][0].pop("n_tokens"), "vendors[0] ('honest-cloud').n_tokens", "Field required"),
    (lambda d: d["bands"]["int4"]["margin"].update(ci95=[0.1]), "bands.int4.margin.ci95", "at least 2"),
    (lambda d: d.update(target_fpr="0.01"), "target_fpr", "valid number"),
    (lambda d: d.update(mode="sampled"), "mode", "'greedy'"),
    (lambda d: d.update(created="yesterday"), "created", "not an ISO 8601 time"),
    (lambda d: d["vendors"][2].update(error=None), "vendors[2] ('dead $vendor')", "neither a verdict nor an error"),
    (lambda d: d["vendors"][1].update(name="honest-cloud"), "(the document)", "repeated: ['honest-cloud']"),
    (lambda d: d["vendors"][0].update(nearest_band="fp8"), "(the document)", "'fp8' is not one of the bands"),
    (lambda d: d.update(vendors=[]), "vendors", "at least 1 item"),
])
def test_malformed_results_name_the_field(change, field, says, tmp_path):
    doc = vendors_doc()
    change(doc)
    with pytest.raises(VerinferError) as e:
        render_vendors_html(doc, tmp_path / "v.html")
    msg = e.value.message
    assert f"{field}: " in msg and says in msg, msg
    assert e.value.where == "vendors.json" and "audit-vendors" in e.value.fix
    assert not (tmp_path / "v.html").exists()


def test_not_a_dict_and_bad_files_are_user_errors(tmp_path):
    with pytest.raises(VerinferError, match="malformed vendors results"):
        validate_vendors([1, 2])
    bad = tmp_path / "vendors.json"
    bad.write_text('{"title": "x",\n "model": }')
    with pytest.raises(VerinferError) as e:
        load_vendors(bad)
    assert e.value.where == f"{bad}:2"
    bad.write_text(json.dumps({"title": "x"}))
    with pytest.raises(VerinferError) as e:
        load_vendors(bad)
    assert e.value.where == str(bad) and "trusted_model: Field required" in e.value.what
    with pytest.raises(VerinferError, match="no such file"):
        load_vendors(tmp_path / "missing.json")


def test_load_and_cli_round_trip(tmp_path, capsys):
    from verinfer.report.vendors import main

    src = tmp_path / "vendors.json"
    src.write_text(json.dumps(vendors_doc()))
    doc = load_vendors(src)
    assert isinstance(doc, VendorsDoc) and doc.vendors[2].status == "error"
    assert doc.model_extra["detector"] == {"summary": "clipped-mean margin"}  # extra keys kept
    assert validate_vendors(doc) is doc
    assert main([str(src)]) == 0
    assert (tmp_path / "vendors.html").is_file() and (tmp_path / "vendors_bands.png").is_file()
    assert capsys.readouterr().out.strip() == str(tmp_path / "vendors.html")
    src.write_text("{}")
    assert main([str(src)]) == 1 and "malformed vendors results" in capsys.readouterr().err


def test_numpy_numbers_and_tuples_from_the_audit_in_memory_are_accepted():
    import numpy as np

    doc = vendors_doc()
    v = doc["vendors"][1]
    v["n_tokens"], v["exact_match"], v["tokens_to_decide"] = np.int64(2301), np.float32(0.5), np.int32(2048)
    v["margin"]["ci95"] = (np.float64(0.02), 0.04)
    out = validate_vendors(doc).vendors[1]
    assert (out.n_tokens, out.tokens_to_decide, out.margin.ci95) == (2301, 2048, [0.02, 0.04])
    assert type(out.n_tokens) is int


def test_input_is_not_modified(tmp_path):
    doc = vendors_doc()
    before = copy.deepcopy(doc)
    render_vendors_html(doc, tmp_path / "v.html")
    assert doc == before
