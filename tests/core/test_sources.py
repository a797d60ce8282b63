"""`core.sources`: a chat log's vendors are keyed by the exact model name each reply gives, and
each gets a directory no other name shares (issue 45's hostile-input pass: `acme/llama`,
`acme_llama` and `acme llama` were one vendor, as were two names sharing their first 64 characters)."""

from __future__ import annotations

import json

import pytest

from verinfer.claims import read_claims, write_claims
from verinfer.core.sources import log_sources, vendor_dir_name
from verinfer.models.testbed import TARGET_DIR
from verinfer.retokenize import Retokenizer
from verinfer.sampling.params import SamplingParams

LONG = "acme/" + "x" * 70


def exchange(model: str, rid: str, text: str = "Hello there.") -> str:
    return json.dumps({"request": {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                                   "temperature": 0, "max_tokens": 16},
                       "response": {"id": rid, "model": model, "choices": [
                           {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}})


def test_directory_names_are_the_name_where_safe_and_never_shared():
    names = ["acme-llama-3.1", "acme/llama", "acme_llama", "acme llama", LONG, LONG + "y", "ünïcode/名前", "..", ""]
    dirs = [vendor_dir_name(n) for n in names]
    assert dirs[0] == "acme-llama-3.1" and dirs[2] == "acme_llama"  # a safe name is its own directory
    assert len(set(dirs)) == len(names), dirs
    for d in dirs:
        assert d and d not in (".", "..") and "/" not in d and len(d) <= 64
        assert all(ch.isalnum() or ch in "._-" for ch in d), d
    assert vendor_dir_name("acme/llama") == vendor_dir_name("acme/llama")  # stable across runs


def test_a_log_keeps_vendors_whose_names_differ_only_in_replaced_characters_apart(tmp_path):
    log = tmp_path / "log.jsonl"
    models = ["acme/llama", "acme_llama", "acme llama", LONG, LONG + "y"]
    log.write_text("\n".join(exchange(m, f"r{i}") for i, m in enumerate(models)) + "\n")
    params = SamplingParams(0.0, -1, 1.0, 0.0, None, 16, "vllm-cpu")
    sources = log_sources(log, "verinfer-testbed-target", params, "derived", Retokenizer.for_model(TARGET_DIR))
    assert sorted(sources) == sorted(models)
    assert all(len(s.claims) == 1 and s.claims[0].provider == m for m, s in sources.items())
    assert len({json.dumps(s.manifest, sort_keys=True) for s in sources.values()}) == len(models)


@pytest.mark.parametrize("name", ["acme/llama", "x" * 80])
def test_an_unsafe_or_long_name_is_hashed_not_cut(name):
    d = vendor_dir_name(name)
    assert d != name and d.rsplit("-", 1)[1].isalnum() and len(d.rsplit("-", 1)[1]) == 8


def test_a_reply_beyond_the_models_context_is_refused_and_an_all_skipped_log_says_what_was_skipped(tmp_path):
    """A reply whose usage says 2M tokens (no max_tokens in the request) is refused at its line, not
    generated against; when nothing is left the error counts the skipped kinds (nothing is printed above).
    A sampled exchange is no longer skipped: without a seed it is recorded unseeded, and a log holding
    only such exchanges is not an error."""
    from verinfer.errors import VerinferError
    from verinfer.providers.chat_log import ChatLogError

    big = json.loads(exchange("acme/llama", "r0"))
    del big["request"]["max_tokens"]
    big["response"]["usage"] = {"completion_tokens": 2_000_000}
    tools = json.loads(exchange("acme/llama", "r1"))
    tools["request"]["tools"] = [{"type": "function"}]
    sampled = json.loads(exchange("acme/llama", "r2"))
    sampled["request"]["temperature"] = 0.7
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(big) + "\n" + json.dumps(tools) + "\n")
    args = (log, "verinfer-testbed-target", SamplingParams(0.0, -1, 1.0, 0.0, None, 16, "vllm-cpu"), "derived",
            Retokenizer.for_model(TARGET_DIR))
    with pytest.raises(ChatLogError, match="2000000 output tokens, more than the model's context of 128") as e:
        log_sources(*args, max_positions=128)
    assert e.value.kind == "over-length" and e.value.where == f"{log}:1"
    skipped: list = []
    with pytest.raises(VerinferError, match=r"no exchange that can be audited \(skipped 1 over-length, 1 tool-calls\)"):
        log_sources(*args, max_positions=128, skip_unusable=True, skipped=skipped)
    assert [k for _, k, _ in skipped] == ["over-length", "tool-calls"]
    log.write_text(json.dumps(big) + "\n" + json.dumps(sampled) + "\n")
    skipped = []
    groups = log_sources(*args, max_positions=128, skip_unusable=True, skipped=skipped)
    assert [k for _, k, _ in skipped] == ["over-length"]
    (rec,) = groups["acme/llama [unseeded-t0.7-p1-k-1-m0]"].claims
    assert rec.extra["mode"] == "unseeded" and rec.id == "r2" and rec.sampling.audit_mode == "unseeded"
    assert rec.to_json()["sampling"] == {"temperature": 0.7, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": None,
                                         "noise": None}
    # an ordinary claim: the claims reader takes it back unchanged
    write_claims(tmp_path / "u.jsonl", [rec])
    (back,) = read_claims(tmp_path / "u.jsonl")
    assert back.sampling == rec.sampling and back.sampling.unseeded


def test_a_log_mixes_greedy_seeded_and_unseeded_exchanges(tmp_path):
    """Greedy exchanges under the vendor's name; seeded ones (a seed and a declared sampler) in their own
    group with their own params; sampled ones without a seed, or without a declared sampler, claimed
    unseeded (no seed, no noise; a request's seed kept as `request_seed`) in a group per sampling:
    never a seeded claim."""
    base = json.loads(exchange("acme/llama", "g"))
    seeded = json.loads(exchange("acme/llama", "s"))
    seeded["request"].update(temperature=0.7, top_p=0.95, seed=11)
    no_seed = json.loads(exchange("acme/llama", "u"))
    no_seed["request"].update(temperature=0.7)
    other = json.loads(exchange("other", "o"))
    other["request"].update(temperature=1.0, seed=5, top_k=20)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in (base, seeded, no_seed, other)))
    params = SamplingParams(0.0, -1, 1.0, 0.0, None, 16, "vllm-cpu")
    retok = Retokenizer.for_model(TARGET_DIR)
    groups = log_sources(log, "t", params, "derived", retok, noise_for={"acme/llama": "keyed"})
    assert sorted(groups) == ["acme/llama", "acme/llama [seeded-t0.7-p0.95-k-1-m0-keyed]",
                              "acme/llama [unseeded-t0.7-p1-k-1-m0]", "other [unseeded-t1-p1-k20-m0]"]
    (s,) = groups["acme/llama [seeded-t0.7-p0.95-k-1-m0-keyed]"].claims
    assert (s.sampling.seed, s.sampling.noise, s.sampling.temperature, s.extra["mode"]) == (11, "keyed", 0.7, "seeded")
    assert groups["acme/llama"].claims[0].extra["mode"] == "greedy"
    (u,) = groups["acme/llama [unseeded-t0.7-p1-k-1-m0]"].claims
    (o,) = groups["other [unseeded-t1-p1-k20-m0]"].claims
    assert (u.id, u.sampling.seed, u.sampling.noise, u.extra.get("request_seed")) == ("u", None, None, None)
    assert (o.id, o.sampling.seed, o.sampling.top_k, o.extra["request_seed"]) == ("o", None, 20, 5)
    assert groups["other [unseeded-t1-p1-k20-m0]"].manifest["mode"] == "unseeded"
    groups = log_sources(log, "t", params, "derived", retok, noise="vllm-cpu")
    assert "other [seeded-t1-p1-k20-m0-vllm-cpu]" in groups
    assert [c.id for g, s in groups.items() if "unseeded" in g for c in s.claims] == ["u"]


def test_an_unseeded_reply_repeated_byte_for_byte_is_one_draw_counted_once(tmp_path):
    """The same conversation answered with the same sampled text three times (without a seed, and with two
    different request seeds: a cache or a fixed-seed sampler) is one claim, the two repeats counted in the
    manifest and the row's note; another reply to it, the same text to another conversation, and greedy
    repeats (no draw) all stay."""
    from verinfer.apps.audit_log import _note

    def sampled(rid, text="Hello there.", content="Say hello.", **req):
        x = json.loads(exchange("acme", rid, text))
        x["request"].update(temperature=0.7, **req)
        x["request"]["messages"][0]["content"] = content
        return x

    lines = [sampled("a"), sampled("b", seed=1), sampled("c", seed=2), sampled("d", "Hi."),
             sampled("e", content="Say hi."), json.loads(exchange("acme", "g1")), json.loads(exchange("acme", "g2"))]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    groups = log_sources(log, "t", SamplingParams(0.0, -1, 1.0, 0.0, None, 16, "vllm-cpu"), "derived",
                         Retokenizer.for_model(TARGET_DIR))
    u = groups["acme [unseeded-t0.7-p1-k-1-m0]"]
    assert [c.id for c in u.claims] == ["a", "d", "e"] and u.manifest["repeated"] == 2
    assert [c.id for c in groups["acme"].claims] == ["g1", "g2"] and "repeated" not in groups["acme"].manifest
    note = _note(u.claims, u.manifest["repeated"])
    assert note.endswith("3 sampled without a seed, 0 with a seed but no declared sampler (--noise or a vendors "
                         "file's `noise`); 2 repeated reply(ies) counted once (the byte-identical sampled reply to the "
                         "same conversation: one draw, from a response cache or a sampler with one fixed seed; with "
                         "a fixed seed its other replies share that noise too, which the unseeded test assumes they "
                         "do not: declare its sampler and seed if it has one)")
    assert "repeated" not in _note(u.claims)


def _line(req: dict | None = None, msg: dict | None = None, rid: str = "r", **choice) -> str:
    request = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
               "max_tokens": 16, **(req or {})}
    c = {"message": {"role": "assistant", "content": "Hello there.", **(msg or {})}, "finish_reason": "stop", **choice}
    return json.dumps({"request": request, "response": {"id": rid, "model": "m", "choices": [c]}})


def test_a_log_follows_the_chat_contract_as_a_live_audit_does(tmp_path):
    """Stop strings replayed as cut (no end token) unless vLLM says the model ended; a reply cut by
    max_tokens inside a character scored to its last whole one; a reasoning block the template has no
    segment for, and a field nobody declared neutral, refused with their kinds."""
    retok = Retokenizer.for_model(TARGET_DIR)
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join([
        _line({"stop": ["\n"]}, rid="cut"),
        _line({"stop": ["\n"]}, rid="own-end", stop_reason=None),
        _line(msg={"content": "Hello th\ufffd"}, rid="mid-char", finish_reason="length"),
        _line(msg={"reasoning_content": "The user wants a greeting."}, rid="reasoning"),
        _line({"x_trace": "t"}, rid="unknown"),
        _line(rid="plain")]) + "\n")
    params = SamplingParams(0.0, -1, 1.0, 0.0, None, 16, "vllm-cpu")
    skipped: list = []
    (src,) = log_sources(log, "t", params, "derived", retok, skip_unusable=True, skipped=skipped).values()
    got = {c.id: c for c in src.claims}
    end, hello = retok.end_token_id, retok.encode("Hello there.")
    assert got["cut"].output_token_ids == hello and got["cut"].chat["stop"] == ["\n"]
    assert got["own-end"].output_token_ids == hello + [end] and "stop" not in got["own-end"].chat
    assert got["plain"].output_token_ids == hello + [end]
    assert got["mid-char"].output_token_ids == retok.encode("Hello th")
    assert sorted(kind for _, kind, _ in skipped) == ["reasoning", "unknown-field"]
    (src,) = log_sources(log, "t", params, "derived", retok, skip_unusable=True, neutral=("x_trace",)).values()
    assert "unknown" in {c.id for c in src.claims}
