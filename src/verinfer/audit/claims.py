"""Claims: what a provider returns and an auditor checks. JSONL, one request per line:

    {"id": str, "model": str, "prompt_token_ids": [int], "output_token_ids": [int],
     "sampling": {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                  "seed": int | null, "noise": str},
     "provider": str (optional; the simulated configuration that made it),
     "activations": ... (optional), "spec": ... (optional)}

Token ids, never re-tokenized text. `read_claims` validates every line and raises a ClaimError
naming file:line and the field, with what to do. `write_claims` writes atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from verinfer.errors import ClaimError
from verinfer.sampling.params import NOISE_BACKENDS, SamplingParams


@dataclass
class Claim:
    id: str
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    provider: str | None = None
    extra: dict = field(default_factory=dict)  # activations, spec, anything else carried along
    source: str | None = field(default=None, compare=False, repr=False)  # "file:line" it was read from

    def to_json(self) -> dict:
        s = self.sampling
        d = {"id": self.id, "model": self.model, "prompt_token_ids": self.prompt_token_ids,
             "output_token_ids": self.output_token_ids,
             "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                          "seed": s.seed, "noise": s.noise}}
        if self.provider is not None:
            d["provider"] = self.provider
        d.update(self.extra)
        return d


def _int_list(v, where: str, fld: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ClaimError(f"`{fld}` must be a list of integer token ids", where=where,
                         fix="send token ids, not text (verinfer never re-tokenizes)")
    return v


def parse_claim(obj: object, where: str) -> Claim:
    if not isinstance(obj, dict):
        raise ClaimError("a claim line must be a JSON object", where=where)
    for fld in ("id", "model", "prompt_token_ids", "output_token_ids", "sampling"):
        if fld not in obj:
            raise ClaimError(f"missing field `{fld}`", where=where, fix="see the claims schema in DESIGN.md")
    if not isinstance(obj["id"], (str, int)):
        raise ClaimError("`id` must be a string", where=where)
    prompt = _int_list(obj["prompt_token_ids"], where, "prompt_token_ids")
    output = _int_list(obj["output_token_ids"], where, "output_token_ids")
    if not prompt:
        raise ClaimError("`prompt_token_ids` is empty", where=where)
    if not output:
        raise ClaimError("`output_token_ids` is empty: nothing to audit", where=where)
    s = obj["sampling"]
    if not isinstance(s, dict):
        raise ClaimError("`sampling` must be an object", where=where)
    temperature = s.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise ClaimError(f"`sampling.temperature` must be a number >= 0, got {temperature!r}", where=where)
    seed = s.get("seed")
    if temperature > 0 and seed is None:
        raise ClaimError("`sampling.seed` is missing but temperature > 0", where=where,
                         fix="a seeded replay needs the seed the provider sampled with; ask the provider to "
                             "send it, or audit only temperature-0 requests")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ClaimError(f"`sampling.seed` must be an integer in [0, 2**63), got {seed!r}", where=where)
    noise = s.get("noise", "vllm-cpu")
    if noise not in NOISE_BACKENDS:
        raise ClaimError(f"`sampling.noise` {noise!r} is not a known noise backend", where=where,
                         fix=f"use one of {', '.join(NOISE_BACKENDS)}")
    try:
        params = SamplingParams(temperature=float(temperature), top_k=int(s.get("top_k", -1)),
                                top_p=float(s.get("top_p", 1.0)), min_p=float(s.get("min_p", 0.0)),
                                seed=seed, max_tokens=len(output), noise=noise)
    except (ValueError, TypeError) as e:
        raise ClaimError(f"`sampling`: {e}", where=where) from e
    known = {"id", "model", "prompt_token_ids", "output_token_ids", "sampling", "provider"}
    return Claim(str(obj["id"]), str(obj["model"]), prompt, output, params, obj.get("provider"),
                 {k: v for k, v in obj.items() if k not in known})


def read_claims(path: str | Path) -> list[Claim]:
    """Read and validate a claims JSONL file; blank lines are skipped, ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ClaimError("no such claims file", where=str(p))
    claims, seen = [], {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                hint = "the file looks truncated (last line cut off)" if not line.endswith("\n") else "fix or drop the line"
                raise ClaimError(f"not valid JSON ({e.msg} at column {e.colno})", where=where, fix=hint) from e
            c = parse_claim(obj, where)
            c.source = where
            if c.id in seen:
                raise ClaimError(f"duplicate claim id {c.id!r} (first at line {seen[c.id]})", where=where)
            seen[c.id] = lineno
            claims.append(c)
    if not claims:
        raise ClaimError("the claims file holds no claims", where=str(p))
    return claims


def check_claims_fit(claims: Iterable[Claim], path: str | Path, *, model_name: str, vocab_size: int,
                     max_positions: int) -> None:
    """Refuse claims made for another model, with out-of-vocabulary ids, or over the context."""
    for i, c in enumerate(claims):
        where = f"{path}: claim {c.id!r}"
        if c.model != model_name:
            raise ClaimError(f"claim is for model {c.model!r} but the verifier loaded {model_name!r}", where=where,
                             fix="audit with the model the provider claims to serve (--model DIR)")
        for fld, ids in (("prompt_token_ids", c.prompt_token_ids), ("output_token_ids", c.output_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ClaimError(f"`{fld}` has token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                                 where=where, fix="the claim was tokenized for another tokenizer or model")
        n = len(c.prompt_token_ids) + len(c.output_token_ids)
        if n > max_positions:
            raise ClaimError(f"prompt + output is {n} tokens, over the model's context of {max_positions}",
                             where=where, fix="shorten the prompt or the generation")


def atomic_write_text(path: str | Path, text: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_claims(path: str | Path, claims: Iterable[Claim]) -> None:
    atomic_write_text(path, "".join(json.dumps(c.to_json(), separators=(",", ":")) + "\n" for c in claims))
