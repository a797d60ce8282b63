"""The sampling of a chat audit (issue 46): `core.chat.ChatSampling`, the request a sampled audit sends,
a vendors file's sampling fields, and the seed probe shared with audit-api (`core.completions.seed_probe`)."""

from __future__ import annotations

import pytest

from verinfer.core.chat import ChatAuditConfig, ChatSampling, cycled, request_params, unseeded_reason
from verinfer.core.completions import PLAIN_NOISES, probe_candidates, seed_probe
from verinfer.errors import VerinferError
from verinfer.models.testbed import TARGET_DIR
from verinfer.providers.chat_http import ChatEndpoint, chat_request, read_vendors
from verinfer.providers.simulated import request_seed

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")


def test_sampling_settings_key_and_requests():
    s = ChatSampling(0.7, 0.95, 40, 0.05, "keyed", "seeded")
    assert s.key() == "seeded-t0.7-p0.95-k40-m0.05-keyed" and not s.greedy
    assert s.settings() == {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "noise": "keyed"}
    assert ChatSampling().key() == "greedy" and ChatSampling().settings() == {"temperature": 0.0}
    assert ChatSampling.of(s.params(3, 16)) == s and ChatSampling.of(ChatSampling().params(None, 8)).greedy
    cfg = ChatAuditConfig(TARGET_DIR, "out", n=3, temperature=0.7, top_p=0.95, noise="keyed")
    ps = request_params(cfg, cfg.sampling, 3)
    assert [p.seed for p in ps] == [request_seed(0, i) for i in range(3)] and {p.noise for p in ps} == {"keyed"}
    assert [p.seed for p in request_params(cfg, ChatSampling(), 2)] == [None, None]  # greedy: no seed
    ep = ChatEndpoint("v", "http://x/v1", "m", sampling={"temperature": 1.0, "top_k": 50})
    assert cfg.sampling_for(ep) == ChatSampling(1.0, 0.95, 50, 0.0, "keyed", "auto")
    body = chat_request(ep, [{"role": "user", "content": "hi"}], s.params(11, 16))
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["seed"]) == (0.7, 0.95, 40, 0.05, 11)
    greedy = chat_request(ep, [{"role": "user", "content": "hi"}], ChatSampling().params(None, 16))
    assert greedy["temperature"] == 0.0 and not {"seed", "top_k", "min_p"} & set(greedy)


def test_unseeded_sampling_claims_without_seed_or_noise_and_requests_with_seeds():
    """A vendor judged unseeded: its claims state no seed and no noise (key 'unseeded-...', settings noise
    None), its requests still carry the audit's seeds (a vendor that ignores them loses nothing); the
    unseeded detector is chosen by name; its calibration cycles the vendors' own conversations."""
    u = ChatSampling(0.7, 0.95, -1, 0.0, "keyed", "auto", unseeded=True)
    assert u.key() == "unseeded-t0.7-p0.95-k-1-m0" and not u.greedy
    assert u.settings() == {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "noise": None}
    p = u.params(5, 16)
    assert (p.seed, p.noise, p.unseeded, p.audit_mode) == (None, None, True, "unseeded")
    assert ChatSampling.of(p) == ChatSampling(0.7, 0.95, -1, 0.0, mode="auto", unseeded=True)
    cfg = ChatAuditConfig(TARGET_DIR, "out", n=3, temperature=0.7, top_p=0.95, noise="keyed")
    assert [(q.seed, q.noise) for q in request_params(cfg, u, 2)] == [(request_seed(0, i), "keyed") for i in range(2)]
    assert cfg.unseeded_detector == "pit-uniformity"
    assert ChatAuditConfig(TARGET_DIR, "out", unseeded_detector="xent-excess").unseeded_detector == "xent-excess"
    with pytest.raises(VerinferError, match="unseeded_detector must be one of pit-uniformity, xent-excess"):
        ChatAuditConfig(TARGET_DIR, "out", unseeded_detector="greedy")
    conv = [[{"role": "user", "content": str(i)}] for i in range(3)]
    assert cycled(conv, [4, 5, 6], 7) == ([conv[i % 3] for i in range(7)], [4, 5, 6, 4, 5, 6, 4])
    assert cycled(conv, None, 2) == (conv[:2], None)


def test_a_fixed_seed_is_every_requests_and_every_claims_seed_and_no_part_of_the_key():
    """A vendor that samples every request with one seed: each request asks it and each claim states it;
    the key and settings (what detectors and bands are cached by) are the plain seeded sampling's; the
    collection's manifest names it (a resumed collection at another fixed seed is another audit)."""
    from verinfer.core.chat import collect_manifest

    plain = ChatSampling(0.7, 0.95, -1, 0.0, "vllm-cpu", "seeded")
    fixed = ChatSampling(0.7, 0.95, -1, 0.0, "vllm-cpu", "seeded", fixed_seed=42)
    assert fixed.key() == plain.key() and fixed.settings() == plain.settings()
    cfg = ChatAuditConfig(TARGET_DIR, "out", n=3, temperature=0.7, top_p=0.95)
    assert [p.seed for p in request_params(cfg, fixed, 3)] == [42, 42, 42]
    assert [p.seed for p in request_params(cfg, plain, 3)] == [request_seed(0, i) for i in range(3)]
    ep = ChatEndpoint("v", "http://x/v1", "m", sampling={"mode": "seeded", "fixed_seed": 777})
    assert cfg.sampling_for(ep).fixed_seed == 777 and cfg.sampling_for(ep).params(5, 8).seed == 777
    conv = [[{"role": "user", "content": "hi"}]]
    assert collect_manifest(ep, cfg, conv, fixed, "seeded")["fixed_seed"] == 42
    assert "fixed_seed" not in collect_manifest(ep, cfg, conv, plain, "seeded")
    with pytest.raises(VerinferError, match="fixed_seed must be an integer >= 0"):
        ChatSampling(0.7, fixed_seed=-1)


@pytest.mark.parametrize("kw, match", [({"mode": "greedy", "temperature": 0.7}, "mode greedy asks temperature 0"),
                                       ({"mode": "sometimes"}, "mode must be one of"),
                                       ({"temperature": 0.7, "top_p": 0.0}, "top_p"),
                                       ({"temperature": 0.7, "noise": "dice"}, "dice")])
def test_sampling_that_cannot_be_audited_is_refused(kw, match):
    with pytest.raises(VerinferError, match=match):
        ChatAuditConfig(TARGET_DIR, "out", **kw)


def test_a_vendors_file_sets_a_vendors_own_sampling(tmp_path):
    p = tmp_path / "v.toml"
    p.write_text('[[vendor]]\nname = "a"\nbase_url = "http://x/v1"\nmodel = "m"\ntemperature = 0.7\ntop_p = 0.9\n'
                 'noise = "keyed"\nmode = "seeded"\nfixed_seed = 42\n[[vendor]]\nname = "b"\nbase_url = "http://x/v1"\nmodel = "m"\n')
    a, b = read_vendors(p)
    assert a.sampling == {"temperature": 0.7, "top_p": 0.9, "noise": "keyed", "mode": "seeded", "fixed_seed": 42}
    assert b.sampling == {}
    assert a.public()["sampling"] == a.sampling and "sampling" not in b.public()
    p.write_text('[[vendor]]\nname = "a"\nbase_url = "http://x/v1"\nmodel = "m"\nnoise = "dice"\n')
    with pytest.raises(VerinferError, match="unknown noise backend 'dice'"):
        read_vendors(p)
    # sampling is the audit's own: `extra` cannot set it behind the replay's back
    with pytest.raises(VerinferError, match=r"extra fields \['top_k'\] would override"):
        ChatEndpoint("v", "http://x/v1", "m", extra={"top_k": 1})


def test_the_seed_probe_says_why_a_vendor_is_unseeded():
    """Two replies to one seed differ, or another seed changes nothing: seeds are ignored (no replay).
    The reply unchanged by the seed is `fixed_noise` (one noise stream for every request); two replies
    to one seed that differ are not, nor is a vendor that honours seeds, nor a probe without request 2."""
    replies = {0: "a", 1: "b", 2: "c"}
    rec = seed_probe(lambda i: (replies[i], None), None, PLAIN_NOISES)
    assert rec == {"probe": "same seed twice, another seed once", "same_seed_same_reply": False,
                   "honours_seeds": False, "other_seed_other_reply": True, "fixed_noise": False}
    assert "ignores seeds" in unseeded_reason(rec)
    rec = seed_probe(lambda i: ("a", None), None, PLAIN_NOISES)  # every seed alike
    assert not rec["honours_seeds"] and "two different seeds gave the same reply" in unseeded_reason(rec)
    assert rec["fixed_noise"] and rec["same_seed_same_reply"] and not rec["other_seed_other_reply"]
    rec = seed_probe(lambda i: ({0: "a", 1: "b", 2: "a"}[i], None), None, PLAIN_NOISES)  # the same seed, two replies
    assert not rec["fixed_noise"]
    rec = seed_probe(lambda i: ({0: "a", 1: "a", 2: "c"}[i], None), None, PLAIN_NOISES)  # seeds honoured
    assert rec["honours_seeds"] and not rec["fixed_noise"] and rec["recognised"] is False
    assert "fixed_noise" not in seed_probe(lambda i: None if i == 2 else ("a", None), None, PLAIN_NOISES)
    assert probe_candidates("keyed")[0] == "keyed" and set(probe_candidates("keyed")) == set(PLAIN_NOISES)


@pytest.mark.slow
def test_the_seed_probe_recognises_a_seeded_chat_reply_from_its_text(tmp_path):
    """A reply sampled at temperature 1 by verinfer's engine with each of two backends, claimed from its
    text alone (derived ids, re-cut under each candidate): the probe names the backend that drew it.
    The keyed reply (seed 1234) wrote "\\n\\n" as two tokens where the tokenizer writes one: the re-cut,
    taking the seeded replay's sample as the reference token, restores the engine's own ids (without it
    the derived ids score a mismatch and the noise after it is misaligned)."""
    from verinfer.apps.pipeline import verifier_engine
    from verinfer.audit.replay import score_chunk
    from verinfer.claims import read_claims
    from verinfer.core.local_runs import Band, chat_run_claims
    from verinfer.models.load import model_info
    from verinfer.models.prompts import chat_messages
    from verinfer.retokenize import Retokenizer
    from verinfer.scores import EXACT_MATCH, TOKEN_ID

    retok, info = Retokenizer.for_model(TARGET_DIR), model_info(TARGET_DIR)
    engine = verifier_engine(TARGET_DIR)
    conv = chat_messages(1, 3)
    for noise in ("vllm-cpu", "keyed"):
        params = ChatSampling(1.0, 0.95, noise=noise).params(0, 24)
        path = chat_run_claims(Band.honest("honest-bf16-b1"), f"probe-{noise}", TARGET_DIR, params, conv, retok,
                               tmp_path, info.name, seeds=[1234])
        (claim,) = read_claims(path)
        assert claim.derived and claim.sampling.seed == 1234 and len(claim.output_token_ids) >= 4
        rec = seed_probe(lambda i: (("same" if i < 2 else "other"), claim), engine, probe_candidates("keyed"), retok)
        assert rec["honours_seeds"] and rec["noise"] == noise and rec["probe_exact_match"][noise] == 1.0, rec
        assert max(v for k, v in rec["probe_exact_match"].items() if k != noise) < 0.75, rec
        returned = claim.chat["returned_output_token_ids"]
        table = score_chunk([claim], engine, retokenizer=retok)
        assert table[TOKEN_ID].to_pylist() == returned and all(table[EXACT_MATCH].to_pylist())
        if noise == "keyed":  # the drifted one: canonical ids [.., 599 "\\n\\n", end], the engine's [.., 201, 201, end]
            assert claim.output_token_ids != returned and len(returned) == len(claim.output_token_ids) + 1
            plain = score_chunk([claim], engine)
            assert not all(plain[EXACT_MATCH].to_pylist())
