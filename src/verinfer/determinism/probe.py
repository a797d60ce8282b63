"""The determinism probe's comparison (`verinfer determinism probe`, apps/determinism_probe.py):
greedy sequences of a black-box endpoint compared with a reference sequence of the same prompt, and
each divergent one classified at its first divergence.

A divergent sequence is reported at its first divergence: the position, the two tokens, and the
reference's top-2 margin there (top-1 minus top-2 log-probability, the same as the logit gap). A
margin under `NEAR_TIE` (1 logit) is a `near-tie` flip, the rounding noise of batch-variant
kernels; a larger one is a `large-margin` divergence, which numerics alone rarely explain (a bug,
or sampling that is not greedy). Where the endpoint returned fewer than two distinct alternatives
at that position the margin is unknown (`no-margin`).

Sequences are compared on token ids where the endpoint returns them (vLLM's and verinfer serve's
`return_token_ids`), else on the token strings of `logprobs.tokens`. Everything here reads JSON
already fetched (a completion choice); the requests are providers/logprobs_http.py's.

Shape key: T = output positions of one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from verinfer.openai_client import EndpointError

NEAR_TIE = 1.0                        # logits: a flip at a smaller reference margin is a near-tie
NEAR_TIE_CLASS, LARGE_CLASS, NO_MARGIN_CLASS = "near-tie", "large-margin", "no-margin"


# --- what one reply holds ---------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """One greedy sequence: its tokens (ids, or strings where the endpoint returns no ids), their
    strings, and the top-2 margin at every position (None where fewer than two were returned)."""
    tokens: tuple
    texts: tuple[str, ...]
    margin_T: tuple[float | None, ...]


def top2_margin(top: dict | None) -> float | None:
    """top-1 minus top-2 log-probability of one position's `top_logprobs` (None: fewer than two)."""
    if not top or len(top) < 2:
        return None
    a, b = sorted(top.values(), reverse=True)[:2]
    return float(a - b)


def reply_of(choice: dict, where: str, request: str) -> Reply:
    """The Reply of a completion choice (JSON); an EndpointError when it holds no logprobs."""
    lp = choice.get("logprobs") or {}
    texts, tops = lp.get("tokens"), lp.get("top_logprobs")
    if texts is None or tops is None:
        raise EndpointError(f"{request}: the reply holds no top logprobs (choices[0].logprobs.top_logprobs)",
                            where=where, fix="probe an endpoint that supports `logprobs` on /v1/completions "
                                             "(vLLM: --max-logprobs 2 or more)")
    ids = choice.get("token_ids")
    tokens = tuple(ids) if ids is not None else tuple(texts)
    return Reply(tokens, tuple(texts), tuple(top2_margin(t) for t in tops))


def check_margins(r: Reply, where: str, request: str) -> Reply:
    """`r`, when some position of it holds two top logprobs (or it is empty): a probe can classify
    its flips. Else an EndpointError: the endpoint does not honour `logprobs: 2`."""
    if r.tokens and all(m is None for m in r.margin_T):
        raise EndpointError(f"{request}: no position holds two top logprobs", where=where,
                            fix="probe an endpoint that honours `logprobs: 2` (vLLM: --max-logprobs 2 or more)")
    return r


# --- comparison with the reference -----------------------------------------------------------
@dataclass(frozen=True)
class Flip:
    """The first divergence of one sequence from its reference."""
    prompt: int                      # index of the probe prompt
    position: int                    # output position of the first differing token
    reference_token: int | str | None   # None: that sequence had ended
    token: int | str | None
    reference_text: str | None
    text: str | None
    margin: float | None             # the reference's top-2 margin there (logits); None: unknown
    margin_here: float | None        # the divergent sequence's own top-2 margin there
    cls: str                         # near-tie | large-margin | no-margin


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """The first position where the sequences differ (one ending first counts), None if equal."""
    j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is not None:
        return j
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(margin: float | None, near_tie: float = NEAR_TIE) -> str:
    """near-tie under `near_tie` logits, large-margin at or above it, no-margin when unknown."""
    if margin is None:
        return NO_MARGIN_CLASS
    return NEAR_TIE_CLASS if margin < near_tie else LARGE_CLASS


def _at(seq: Sequence, j: int):
    return seq[j] if j < len(seq) else None


def compare(prompt: int, ref: Reply, got: Reply, near_tie: float = NEAR_TIE) -> Flip | None:
    """None when `got` is the reference's sequence token for token, else its first divergence."""
    j = first_divergence(ref.tokens, got.tokens)
    if j is None:
        return None
    margin = _at(ref.margin_T, j)
    return Flip(prompt, j, _at(ref.tokens, j), _at(got.tokens, j), _at(ref.texts, j), _at(got.texts, j), margin,
                _at(got.margin_T, j), classify(margin, near_tie))


@dataclass
class ConditionResult:
    sequences: int
    divergent_sequences: int
    flips: list[dict]

    @property
    def classes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.flips:
            out[f["class"]] = out.get(f["class"], 0) + 1
        return out


def flip_row(f: Flip) -> dict:
    """A Flip as the JSON row of the result (`class` for `cls`)."""
    d = asdict(f)
    d["class"] = d.pop("cls")
    return d


def condition_result(refs: Sequence[Reply], replies: Sequence[Reply], near_tie: float = NEAR_TIE) -> ConditionResult:
    """Every reply compared with the reference of the same prompt."""
    flips = [f for i, (r, g) in enumerate(zip(refs, replies)) if (f := compare(i, r, g, near_tie)) is not None]
    return ConditionResult(len(replies), len(flips), [flip_row(f) for f in flips])


@dataclass
class ProbeResult:
    base_url: str
    model: str
    compared_on: str                  # token_ids | token_text
    prompts: str                      # where the prompts came from
    settings: dict
    conditions: dict[str, ConditionResult]
    seconds: float = 0.0
    paths: dict = field(default_factory=dict)

    @property
    def sequences(self) -> int:
        return sum(c.sequences for c in self.conditions.values())

    @property
    def divergent_sequences(self) -> int:
        return sum(c.divergent_sequences for c in self.conditions.values())

    def to_json(self) -> dict:
        conds = {k: {"sequences": c.sequences, "divergent_sequences": c.divergent_sequences,
                     "classes": c.classes, "flips": c.flips} for k, c in self.conditions.items()}
        flips = [{"condition": k, **f} for k, c in self.conditions.items() for f in c.flips]
        return {"base_url": self.base_url, "model": self.model, "compared_on": self.compared_on,
                "prompts": self.prompts, "settings": self.settings, "sequences": self.sequences,
                "divergent_sequences": self.divergent_sequences, "flips": flips, "conditions": conds,
                "seconds": round(self.seconds, 2)}
