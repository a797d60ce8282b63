from verinfer.cli.render import more_tokens, verdicts as print_verdicts
from verinfer.detect.verdict import Verdict, combine_verdicts


def _verdict(score, flagged, p, **extra):
    return Verdict.of(provider="int4", honest=False, flagged=flagged, n_tokens=96, pooled=0.5, threshold=0.1,
                      p_value=p, target_fpr=0.005, threshold_fpr=0.004, score=score,
                      decision="flagged" if flagged else "ok", **extra)


def test_combined_audit_rows_keep_their_detector_labels(capsys):
    """`audit -d token.json -d fp.json` rows are `int4 [margin]`, `int4 [fp_l2]`, `int4 [combined]`:
    rich read the brackets as markup and printed `int4` three times."""
    print_verdicts(combine_verdicts([[_verdict("margin", True, 1e-5)], [_verdict("fp_l2", False, 0.3)]]))
    out = capsys.readouterr().out
    for label in ("int4 [margin]", "int4 [fp_l2]", "int4 [combined]"):
        assert label in out, out


def test_to_flag_column_and_the_power_line(capsys):
    """'-' when flagged or not reported, 'none (no excess)' for a reported None, else ~N; an ok verdict
    with a stated power prints its decision under the table, p = 0 prints <1e-300."""
    ok = _verdict("margin", False, 0.4, power={"probability": 0.5}).with_(
        more_tokens_needed=None, decision="ok: consistent, power stated")
    assert more_tokens(ok) == "none (no excess)" and more_tokens(ok.with_(more_tokens_needed=120)) == "~120"
    assert more_tokens(ok.without("more_tokens_needed")) == "-" and more_tokens(ok.with_(flagged=True)) == "-"
    print_verdicts([ok, _verdict("margin", True, 0.0).with_(provider="wrong-seed", heldout_fpr=0.012)])
    out = capsys.readouterr().out
    assert "int4: ok: consistent, power stated" in out and "<1e-300" in out and "0% / 0.40% / 1.2%" in out
