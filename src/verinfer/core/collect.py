"""One resumable collector of claims, whatever they come from (a `Source`).

    lock       out_dir/claims.jsonl.lock is held for the whole collection: a second collection
               writing the same directory is refused (io.exclusive_lock)
    manifest   out_dir/collect.json holds the source's manifest; a directory whose claims file
               exists with another manifest is refused (check_manifest on_mismatch="error"),
               never mixed
    resume     the claims saved in out_dir/claims.jsonl and the requests out_dir/requests.json
               says were answered without a claim ("no_claim": an empty reply, one cut before any
               text) are never sent again; requests_sent counts every request paid for
    stop       stop(claims) is asked once on resumed claims and after each new claim; True cancels
               the requests not yet sent (those already in flight are counted as sent, not used)
    send       the source's `concurrency` requests in flight (a thread pool), replies turned into
               claims in request order; after each reply claims.jsonl and requests.json are
               replaced atomically, so an interruption loses nothing already answered
    errors     an EndpointError stops the collection, cancels the requests not sent and is raised
               again with the source's account of what was saved (the claims before it stay; a
               rerun resumes after them); the source's `check_collected` may refuse the result

Sources (`core.sources`): the completions endpoint (`CompletionsSource`), a chat endpoint
(`ChatSource`), a chat log's vendors (`log_sources`) and claims already in hand (`InHand`, here).
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from verinfer.claims import Claim, claims_text, read_claims, write_claims
from verinfer.io import atomic_write_json, check_manifest, exclusive_lock
from verinfer.openai_client import EndpointError

StopRule = Callable[[list[Claim]], bool]


class Source(Protocol):
    """Where claims come from: `len(source)` requests, request i named by claim_id(i)."""

    manifest: dict      # what identifies the collection (written to collect.json, checked on resume)
    concurrency: int    # requests in flight

    def __len__(self) -> int: ...

    def claim_id(self, i: int) -> str: ...

    def send(self, i: int) -> Any:
        """Request i's reply (runs in a worker thread); an EndpointError when it fails."""

    def claim(self, i: int, reply: Any) -> Claim | None:
        """The claim of request i's reply, None when it holds none (an empty reply); an
        EndpointError when the reply cannot be the trusted model's."""

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        """The `what` of an EndpointError that stopped the collection with `saved` claims in `path`."""

    def check_collected(self, claims: list[Claim]) -> None:
        """Raise when the finished collection cannot be audited (e.g. no claim at all)."""


def collect(source: Source, out_dir: str | Path, progress: Callable[[int], Any] | None = None,
            stop: StopRule | None = None) -> tuple[list[Claim], int]:
    """(claims, requests sent) of `source`, saved in out_dir/claims.jsonl (see the module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, mpath, rpath = out / "claims.jsonl", out / "collect.json", out / "requests.json"
    with exclusive_lock(path):
        claims: list[Claim] = []
        saved: dict = {}
        if path.is_file():
            check_manifest(mpath, source.manifest, on_mismatch="error", where=out, what="claims of another audit")
            claims = read_claims(path)
            saved = json.loads(rpath.read_text()) if rpath.is_file() else {}
        else:
            atomic_write_json(mpath, source.manifest)
        sent = saved.get("requests_sent", len(claims))  # requests paid for, claims or not
        no_claim = list(saved.get("no_claim", []))      # answered without a claim: never sent again
        if stop is not None and claims and stop(claims):
            return claims, sent
        done = {c.id for c in claims} | {source.claim_id(i) for i in no_claim}
        todo = [i for i in range(len(source)) if source.claim_id(i) not in done]
        if progress and len(todo) < len(source):  # a count of 0 would take the log's first line
            progress(len(source) - len(todo))
        with ThreadPoolExecutor(source.concurrency) as pool:
            window = deque((i, pool.submit(source.send, i)) for i in todo[:source.concurrency])
            rest = iter(todo[source.concurrency:])
            try:
                while window:
                    i, fut = window.popleft()
                    claim = source.claim(i, fut.result())
                    sent += 1
                    if claim is not None:
                        claims.append(claim)
                    else:
                        no_claim.append(i)
                    write_claims(path, claims)
                    atomic_write_json(rpath, {"requests_sent": sent, "no_claim": no_claim})
                    if progress:
                        progress(1)
                    if claim is not None and stop is not None and stop(claims):
                        sent += sum(not f.cancel() for _, f in window)  # already on the wire: paid for, not used
                        break
                    nxt = next(rest, None)
                    if nxt is not None:
                        window.append((nxt, pool.submit(source.send, nxt)))
            except EndpointError as e:
                for _, f in window:
                    f.cancel()
                raise EndpointError(source.interrupted(e.what, len(claims), path), where=e.where, fix=e.fix) from e
        source.check_collected(claims)
        if not path.is_file() or path.read_text() != claims_text(claims):  # unchanged: its scores stay current
            write_claims(path, claims)
        atomic_write_json(rpath, {"requests_sent": sent, "no_claim": no_claim})
    return claims, sent


class InHand:
    """Claims already in hand (a chat log's, a claims file's): nothing is sent, one at a time."""

    concurrency = 1

    def __init__(self, claims: list[Claim], manifest: dict | None = None):
        self.claims = list(claims)
        digest = hashlib.sha256(claims_text(self.claims).encode()).hexdigest()[:16]
        self.manifest = {"claims_sha256": digest, **(manifest or {})}

    @classmethod
    def from_file(cls, path: str | Path) -> "InHand":
        return cls(read_claims(path), {"claims_file": str(path)})

    def __len__(self) -> int:
        return len(self.claims)

    def claim_id(self, i: int) -> str:
        return self.claims[i].id

    def send(self, i: int) -> Claim:
        return self.claims[i]

    def claim(self, i: int, reply: Claim) -> Claim:
        return reply

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        return f"{what} ({saved} of {len(self)} claims saved in {path}; rerun to resume)"

    def check_collected(self, claims: list[Claim]) -> None:
        return None


__all__ = ["InHand", "Source", "StopRule", "collect"]
