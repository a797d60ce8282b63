import json

import pytest

from verinfer.claims import Claim, check_claims_fit, read_claims, write_claims
from verinfer.errors import ClaimError
from verinfer.sampling.params import SamplingParams

GOOD = {"id": "a", "model": "m", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5],
        "sampling": {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.0, "seed": 7, "noise": "vllm-cpu"}}


def _write(tmp_path, lines, end="\n"):
    p = tmp_path / "c.jsonl"
    p.write_text(end.join(lines) + end)
    return p


def test_round_trip(tmp_path):
    c = Claim("x", "m", [1, 2], [3], SamplingParams(seed=3, max_tokens=1, top_k=5), provider="p")
    write_claims(tmp_path / "o.jsonl", [c])
    (back,) = read_claims(tmp_path / "o.jsonl")
    assert back.to_json() == c.to_json()


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.pop("sampling"), "missing field `sampling`"),
    (lambda d: d["sampling"].pop("seed"), "sampling.seed` is missing"),
    (lambda d: d.__setitem__("output_token_ids", "hello"), "list of integer token ids"),
    (lambda d: d.__setitem__("output_token_ids", []), "empty"),
    (lambda d: d["sampling"].__setitem__("noise", "mystery"), "not a known noise backend"),
    (lambda d: d["sampling"].__setitem__("top_p", 1.5), "top_p"),
    (lambda d: d["sampling"].__setitem__("temperature", -1), "temperature"),
])
def test_bad_fields_name_line_and_field(tmp_path, mutate, match):
    bad = json.loads(json.dumps(GOOD))
    mutate(bad)
    p = _write(tmp_path, [json.dumps(GOOD), json.dumps({**bad, "id": "b"})])
    with pytest.raises(ClaimError, match=match) as e:
        read_claims(p)
    assert f"{p}:2" in str(e.value)


@pytest.mark.parametrize("field,text", [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"), ("temperature", "1e308"),
    ("top_p", "NaN"), ("min_p", "Infinity"), ("seed", str(2**70)),
])
def test_non_finite_and_out_of_range_sampling_values_are_refused_at_read_time(tmp_path, field, text):
    """Issue 16 item 4: `Infinity` and 1e308 wrote NaN margins, NaN crashed score with an index error,
    a seed of 2**70 overflowed without a file, line or field: each is refused by the reader, naming them."""
    line = json.dumps({**GOOD, "id": "b"}).replace(f'"{field}": {json.dumps(GOOD["sampling"][field])}', f'"{field}": {text}')
    assert text in line
    p = _write(tmp_path, [json.dumps(GOOD), line])
    with pytest.raises(ClaimError, match=f"sampling.{field}") as e:
        read_claims(p)
    assert f"{p}:2" in str(e.value)


def test_greedy_needs_no_seed(tmp_path):
    d = json.loads(json.dumps(GOOD))
    d["sampling"] = {"temperature": 0.0}
    (c,) = read_claims(_write(tmp_path, [json.dumps(d)]))
    assert c.sampling.greedy and c.sampling.seed is None


def test_malformed_and_truncated_lines(tmp_path):
    p = _write(tmp_path, [json.dumps(GOOD), "{not json"])
    with pytest.raises(ClaimError, match=r"c.jsonl:2.*not valid JSON") as e:
        read_claims(p)
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "b"})[:40])
    with pytest.raises(ClaimError, match="truncated"):
        read_claims(p)


def test_duplicate_ids(tmp_path):
    with pytest.raises(ClaimError, match="duplicate claim id 'a' \\(first at line 1\\)"):
        read_claims(_write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)]))


def test_fit_checks_model_vocab_and_context(tmp_path):
    (c,) = read_claims(_write(tmp_path, [json.dumps(GOOD)]))
    check_claims_fit([c], "f", model_name="m", vocab_size=10, max_positions=10)
    with pytest.raises(ClaimError, match="is for model 'm'"):
        check_claims_fit([c], "f", model_name="other", vocab_size=10, max_positions=10)
    with pytest.raises(ClaimError, match="token id 5 outside the vocabulary"):
        check_claims_fit([c], "f", model_name="m", vocab_size=5, max_positions=10)
    with pytest.raises(ClaimError, match="over the model's context"):
        check_claims_fit([c], "f", model_name="m", vocab_size=10, max_positions=4)


def test_fit_accepts_any_alias_and_names_them_all_on_a_mismatch(tmp_path):
    (c,) = read_claims(_write(tmp_path, [json.dumps({**GOOD, "model": "Org/M-Instruct"})]))
    check_claims_fit([c], "f", model_name="m", aliases=("m", "Org/M-Instruct"), vocab_size=10, max_positions=10)
    with pytest.raises(ClaimError) as e:
        check_claims_fit([c], "f", model_name="m", aliases=("m", "Org/M"), vocab_size=10, max_positions=10)
    assert "is for model 'Org/M-Instruct' but the verifier loaded 'm', which answers to 'm', 'Org/M'" in e.value.what
    assert "--model-name 'Org/M-Instruct'" in e.value.fix


def test_non_utf8_claims_file_is_a_claim_error_with_file_and_line(tmp_path):
    """Issue 16 item 5: bytes that are not UTF-8 (here latin-1 on line 2) name the file, the line
    and the byte in it (a text reader decodes ahead: it blamed line 1, at a file offset)."""
    from verinfer.claims import read_claims
    from verinfer.errors import ClaimError

    line = '{"id": 1, "model": "m", "prompt_token_ids": [1], "output_token_ids": [2], "sampling": {"temperature": 0}}\n'
    p = tmp_path / "c.jsonl"
    p.write_bytes(line.encode() + '{"id": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ClaimError) as e:
        read_claims(p)
    assert f"{p}:2" in e.value.message and "not UTF-8" in e.value.message and "byte 11 of the line" in e.value.message


def test_seed_null_at_temperature_above_zero_marks_an_unseeded_claim(tmp_path):
    """`"seed": null` written out: a sampled claim without a usable seed (audit mode "unseeded");
    an absent seed stays an error, a stated seed stays seeded, greedy stays greedy."""
    unseeded = json.loads(json.dumps(GOOD))
    unseeded["sampling"]["seed"] = None
    greedy = {**GOOD, "id": "g", "sampling": {"temperature": 0.0, "seed": None}}
    p = _write(tmp_path, [json.dumps(GOOD), json.dumps({**unseeded, "id": "u"}), json.dumps(greedy)])
    seeded_c, unseeded_c, greedy_c = read_claims(p)
    assert [c.sampling.audit_mode for c in (seeded_c, unseeded_c, greedy_c)] == ["seeded", "unseeded", "greedy"]
    assert unseeded_c.sampling.unseeded and unseeded_c.sampling.seed is None
    write_claims(tmp_path / "o.jsonl", [unseeded_c])
    (back,) = read_claims(tmp_path / "o.jsonl")
    assert back.sampling.unseeded and back.to_json() == unseeded_c.to_json()
    with pytest.raises(ValueError, match="seed is missing but temperature > 0"):
        SamplingParams(temperature=1.0, seed=None)
    with pytest.raises(ValueError, match="seed is 3 in an unseeded claim"):
        SamplingParams(temperature=1.0, seed=3, unseeded=True)
    with pytest.raises(ValueError, match="temperature is 0 in an unseeded claim"):
        SamplingParams(temperature=0.0, unseeded=True)


def test_an_unseeded_claim_needs_no_noise(tmp_path):
    """An unseeded claim draws no noise: `"noise": null` (or absent) is read and written back as null,
    and no noise-specific check applies (SGLang's refusal of min-p); a seeded claim still needs its
    noise, and a seeded SGLang claim with min-p is still refused."""
    null = {**GOOD, "id": "n", "sampling": {**GOOD["sampling"], "seed": None, "noise": None}}
    absent = {**GOOD, "id": "x", "sampling": {k: v for k, v in GOOD["sampling"].items() if k != "noise"} | {"seed": None}}
    sglang = {**GOOD, "id": "s", "sampling": {**GOOD["sampling"], "seed": None, "noise": "sglang-seeded", "min_p": 0.1}}
    p = _write(tmp_path, [json.dumps(x) for x in (null, absent, sglang)])
    got = read_claims(p)
    assert [(c.sampling.audit_mode, c.sampling.noise, c.sampling.min_p) for c in got] == [
        ("unseeded", None, 0.0), ("unseeded", None, 0.0), ("unseeded", "sglang-seeded", 0.1)]
    assert got[0].to_json()["sampling"] == {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.0,
                                            "seed": None, "noise": None}
    write_claims(tmp_path / "o.jsonl", got)
    assert [c.to_json() for c in read_claims(tmp_path / "o.jsonl")] == [c.to_json() for c in got]
    seeded_null = {**GOOD, "sampling": {**GOOD["sampling"], "noise": None}}
    with pytest.raises(ClaimError, match="`sampling.noise` is missing"):
        read_claims(_write(tmp_path, [json.dumps(seeded_null)]))
    with pytest.raises(ClaimError, match="min_p"):
        read_claims(_write(tmp_path, [json.dumps({**sglang, "sampling": {**sglang["sampling"], "seed": 3}})]))
    with pytest.raises(ValueError, match="noise is missing"):
        SamplingParams(temperature=1.0, seed=3, noise=None)
