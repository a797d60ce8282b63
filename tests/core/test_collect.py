"""`core.collect.collect`, the one resumable collector, driven by a scripted in-memory source: the
claims it returns and saves are compared to the known list, request by request (what was sent,
what was never sent again), through an interruption and a rerun, a reply without a claim, a stop
rule that cancels what was not sent, a manifest mismatch and a second collection of the same
directory. No network, no model."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from verinfer.core.collect import InHand, collect
from verinfer.claims import Claim, read_claims
from verinfer.errors import VerinferError
from verinfer.io import OutputBusyError
from verinfer.providers.openai_http import EndpointError
from verinfer.sampling.params import SamplingParams

PARAMS = SamplingParams(0.0, -1, 1.0, 0.0, None, 2, "vllm-cpu")  # a claim read back has max_tokens = its length
N = 8
EMPTY = {1, 6}  # requests answered without output tokens: no claim


def expected(i: int) -> Claim:
    return Claim(f"s-{i:05d}", "m", [1, 2, i + 3], [] if i in EMPTY else [i + 10, i + 11], PARAMS, provider="scripted")


class Scripted:
    """Request i answers expected(i)'s output ids (none for EMPTY); those in `fail` raise an
    EndpointError (the endpoint down) until removed; `sent` lists every request sent."""

    def __init__(self, concurrency: int = 1, fail=(), n: int = N, tag: str = "a"):
        self.concurrency, self.fail, self.n = concurrency, set(fail), n
        self.manifest = {"source": "scripted", "n": n, "tag": tag}
        self.sent: list[int] = []

    def __len__(self) -> int:
        return self.n

    def claim_id(self, i: int) -> str:
        return f"s-{i:05d}"

    def send(self, i: int) -> list[int]:
        self.sent.append(i)
        if i in self.fail:
            raise EndpointError(f"request {i}: cannot reach the endpoint", where="scripted", fix="try later")
        return expected(i).output_token_ids

    def claim(self, i: int, reply: list[int]) -> Claim | None:
        return Claim(self.claim_id(i), "m", [1, 2, i + 3], reply, PARAMS, provider="scripted") if reply else None

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        return f"{what} ({saved} of {self.n} claims saved in {path}; rerun to resume)"

    def check_collected(self, claims: list[Claim]) -> None:
        if not claims:
            raise EndpointError("no claim at all", where="scripted", fix="check the script")


def _requests(out: Path) -> dict:
    return json.loads((out / "requests.json").read_text())


def test_resume_after_an_interruption_sends_only_what_is_missing(tmp_path):
    out = tmp_path / "a"
    src = Scripted(fail={4})
    with pytest.raises(EndpointError) as e:
        collect(src, out)
    assert e.value.what == f"request 4: cannot reach the endpoint (3 of 8 claims saved in {out / 'claims.jsonl'}; " \
                           "rerun to resume)"
    assert e.value.where == "scripted" and e.value.fix == "try later"
    assert src.sent == [0, 1, 2, 3, 4]
    assert read_claims(out / "claims.jsonl") == [expected(i) for i in (0, 2, 3)]
    assert _requests(out) == {"requests_sent": 4, "no_claim": [1]}
    assert json.loads((out / "collect.json").read_text()) == src.manifest

    src.fail.clear()  # the endpoint is back: the rerun sends 4..7, never 0..3 (1 answered without a claim)
    progress = []
    claims, sent = collect(src, out, progress=progress.append)
    assert src.sent == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    want = [expected(i) for i in range(N) if i not in EMPTY]
    assert claims == want and read_claims(out / "claims.jsonl") == want and sent == 8  # the failed try is not counted
    assert _requests(out) == {"requests_sent": 8, "no_claim": [1, 6]}
    assert progress == [4, 1, 1, 1, 1]  # the 4 answered before, then each reply

    again, sent = collect(src, out)  # all answered: nothing sent
    assert again == want and sent == 8 and len(src.sent) == 9


@pytest.mark.parametrize("concurrency", [1, 3])
def test_claims_keep_request_order_whatever_the_concurrency(tmp_path, concurrency):
    src, progress = Scripted(concurrency), []
    claims, sent = collect(src, tmp_path / "c", progress=progress.append)
    assert claims == [expected(i) for i in range(N) if i not in EMPTY] and sent == N
    assert progress == [1] * N  # a fresh collection counts no 0 (it would take the progress log's first line)
    assert sorted(src.sent) == list(range(N))


def test_the_stop_rule_cancels_what_was_not_sent(tmp_path):
    """concurrency 2: when the rule says stop at the 3rd claim (request 3), request 4 is in flight
    (counted as sent, not used) and 5..7 are never sent; a rerun asks the rule once and sends nothing."""
    src = Scripted(concurrency=2)
    asked = []

    def stop(claims):
        asked.append(len(claims))
        if len(claims) >= 3:
            deadline = time.monotonic() + 10
            while 4 not in src.sent and time.monotonic() < deadline:  # request 4 is on the wire
                time.sleep(0.001)
            return True
        return False

    out = tmp_path / "s"
    claims, sent = collect(src, out, stop=stop)
    assert claims == [expected(i) for i in (0, 2, 3)] and asked == [1, 2, 3]  # not asked after request 1 (no claim)
    assert sorted(src.sent) == [0, 1, 2, 3, 4] and sent == 5
    assert _requests(out) == {"requests_sent": 5, "no_claim": [1]}
    again, sent = collect(src, out, stop=stop)
    assert again == claims and sent == 5 and asked == [1, 2, 3, 3] and len(src.sent) == 5


def test_a_directory_of_another_collection_is_refused(tmp_path):
    out = tmp_path / "m"
    collect(Scripted(), out)
    other = Scripted(tag="b")
    with pytest.raises(VerinferError, match=r"holds claims of another audit \(different tag\)"):
        collect(other, out)
    assert other.sent == [] and json.loads((out / "collect.json").read_text())["tag"] == "a"


def test_a_second_collection_of_the_same_directory_is_refused(tmp_path):
    out = tmp_path / "l"
    inner: list[Exception] = []

    class Nested(Scripted):
        def send(self, i):
            if i == 0:
                try:
                    collect(Scripted(), out)
                except OutputBusyError as e:
                    inner.append(e)
            return super().send(i)

    claims, _ = collect(Nested(), out)
    assert len(inner) == 1 and "another verinfer process" in inner[0].what
    assert claims == [expected(i) for i in range(N) if i not in EMPTY]


def test_nothing_claimed_is_the_sources_error(tmp_path):
    src = Scripted(n=2)
    src.fail = set()
    src.claim = lambda i, reply: None  # type: ignore[method-assign]
    with pytest.raises(EndpointError, match="no claim at all"):
        collect(src, tmp_path / "e")
    assert _requests(tmp_path / "e") == {"requests_sent": 2, "no_claim": [0, 1]}


def test_claims_in_hand(tmp_path):
    """A chat log's or a claims file's claims: collected as they are, one at a time; a rerun adds
    nothing; other claims in the same directory are refused."""
    want = [expected(i) for i in range(N) if i not in EMPTY]
    claims, sent = collect(InHand(want, {"log": "x.jsonl"}), tmp_path / "h")
    assert claims == want and sent == len(want) and read_claims(tmp_path / "h" / "claims.jsonl") == want
    again = InHand.from_file(tmp_path / "h" / "claims.jsonl")
    assert again.claims == want and again.manifest["claims_sha256"] == InHand(want).manifest["claims_sha256"]
    path = tmp_path / "h" / "claims.jsonl"
    os.utime(path, (1_000_000, 1_000_000))
    assert collect(InHand(want, {"log": "x.jsonl"}), tmp_path / "h") == (want, len(want))
    assert path.stat().st_mtime == 1_000_000  # nothing new: the file is not rewritten, its scores stay current
    with pytest.raises(VerinferError, match="different claims_sha256"):
        collect(InHand(want[:-1], {"log": "x.jsonl"}), tmp_path / "h")
