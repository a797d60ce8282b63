"""`verinfer determinism probe`: a black-box check of an OpenAI-compatible completions endpoint's
greedy determinism.

The same greedy (temperature 0) requests, each with `logprobs: 2` (the top two log-probabilities
at every position), are sent under several conditions and every answer is compared with the
reference, the first `alone` pass:

    alone           one request at a time, a second time (run-to-run)
    concurrent-B    B requests in flight at once: ours (half the slots) among filler requests of
                    other prompts, so a batching server decodes ours inside batches of about B
    shared-prefix   each of ours sent right after, and together with, requests that extend it (its
                    prompt + more tokens), so a server with prefix caching serves ours from cache
    mixed-traffic   ours sent together with longer sampled (temperature 1) requests

A divergent sequence is reported at its first divergence: the position, the two tokens, and the
reference's top-2 margin there (top-1 minus top-2 log-probability, the same as the logit gap). A
margin under `NEAR_TIE` (1 logit) is a `near-tie` flip, the rounding noise of batch-variant
kernels; a larger one is a `large-margin` divergence, which numerics alone rarely explain (a bug,
or sampling that is not greedy). Where the endpoint returned fewer than two distinct alternatives
at that position the margin is unknown (`no-margin`).

Prompts are token ids from verinfer's own prompt sets for a local copy of the model (`model_dir`),
else built-in text prompts. Sequences are compared on token ids where the endpoint returns them
(vLLM's and verinfer serve's `return_token_ids`), else on the token strings of `logprobs.tokens`.

Shape key: T = output positions of one sequence.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait, FIRST_EXCEPTION
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verinfer.errors import VerinferError
from verinfer.io import atomic_write_json, atomic_write_text, output
from verinfer.openai_client import EndpointError, endpoint_errors
from verinfer.progress import progress_bar
from verinfer.providers.openai_http import Endpoint, openai_client
from verinfer.report.probe import probe_markdown, write_probe_html

NEAR_TIE = 1.0                        # logits: a flip at a smaller reference margin is a near-tie
NEAR_TIE_CLASS, LARGE_CLASS, NO_MARGIN_CLASS = "near-tie", "large-margin", "no-margin"
TOP_LOGPROBS = 2                      # the completions API's `logprobs`: the top-2 at every position
DEFAULT_BATCH_SIZES = (1, 4, 16)
MAX_IN_FLIGHT = 64
SHARED_PREFIX_WAVE = 4                # of ours per shared-prefix wave (each with one request extending it)
MIXED_WAVE = 2                        # of ours per mixed-traffic wave (each with one long sampled request)
MIXED_LENGTH_FACTOR = 4               # a mixed-traffic request's max_tokens: this times ours
JSON_NAME, MD_NAME, HTML_NAME = "probe.json", "probe.md", "probe.html"


@dataclass(frozen=True)
class ProbeConfig:
    base_url: str
    model: str                          # the name the endpoint serves
    out_dir: Path = Path("runs/determinism-probe")
    model_dir: Path | None = None       # a local copy of the model: token-id prompts from its prompt sets
    n: int = 16                         # probe prompts
    max_tokens: int = 32
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    seed: int = 0
    api_key_env: str | None = None      # None: OPENAI_API_KEY when set
    timeout: float = 120.0
    near_tie: float = NEAR_TIE

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1:
            raise VerinferError(f"need --n >= 1 and --max-tokens >= 1, got {self.n} and {self.max_tokens}",
                                where="--n / --max-tokens", fix="ask for at least one prompt and one token")
        bad = [b for b in self.batch_sizes if not 1 <= b <= MAX_IN_FLIGHT]
        if not self.batch_sizes or bad:
            raise VerinferError(f"batch sizes must be in 1-{MAX_IN_FLIGHT}, got {list(self.batch_sizes)}",
                                where="--batch-sizes", fix="e.g. --batch-sizes 1,4,16")

    def endpoint(self) -> Endpoint:
        return Endpoint(self.base_url, self.model, api_key_of(self.api_key_env), self.timeout)


def api_key_of(env: str | None) -> str:
    """The API key from the environment variable `env` (an error naming it when unset); without
    one, OPENAI_API_KEY when set, else "EMPTY" (local servers take any key)."""
    if env is None:
        return os.environ.get("OPENAI_API_KEY") or "EMPTY"
    key = os.environ.get(env)
    if not key:
        raise VerinferError(f"the environment variable {env} is not set", where="--api-key-env",
                            fix=f"export {env}=... (verinfer reads keys from the environment only)")
    return key


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16); a VerinferError naming --batch-sizes for anything else."""
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes:
        raise VerinferError(f"not a comma-separated list of integers: {text!r}", where="--batch-sizes",
                            fix="e.g. --batch-sizes 1,4,16")
    return tuple(dict.fromkeys(sizes))


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


# --- prompts and requests ---------------------------------------------------------------------
CODE_STARTS = ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef list_files(path):\n",
               "def is_prime(n):\n", "for i in range(10):\n", "def parse_args(argv):\n", "with open(path) as f:\n",
               "def merge_sorted(a, b):\n")


def text_prompts(k: int, seed: int) -> list[str]:
    """k built-in text prompts, deterministic in `seed`: alternately the start of a Python function
    and an arithmetic question (the testbed and small instruct models continue both)."""
    rng = random.Random(seed)
    out = []
    for i in range(k):
        if i % 2 == 0:
            kind = rng.choice(("helper", "utility", "example"))
            out.append(f"# {kind} {i}\n{CODE_STARTS[(i // 2) % len(CODE_STARTS)]}")
        else:
            out.append(f"Q: {rng.randrange(2, 99)}+{rng.randrange(2, 99)}=")
    return out


def probe_prompts(cfg: ProbeConfig, k: int) -> tuple[list, str]:
    """k prompts (the first cfg.n are the probe's, the rest fillers) and where they come from."""
    if cfg.model_dir is None:
        return text_prompts(k, cfg.seed), "built-in text prompts"
    from verinfer.models.prompts import prompts_for

    return prompts_for(cfg.model_dir, k, cfg.seed), f"token ids of verinfer's prompt sets for {cfg.model_dir}"


def extend(prompt, tail):
    """The prompt followed by `tail` (both text or both token ids): a request sharing its prefix."""
    return prompt + ("\n" + tail if isinstance(prompt, str) else list(tail))


@dataclass(frozen=True)
class Job:
    prompt: object                   # text or token ids
    max_tokens: int
    ours: int | None = None          # index of the probe prompt; None: a filler
    temperature: float = 0.0
    seed: int | None = None


class Client:
    """The endpoint's completions through the official `openai` client; every failure an
    EndpointError saying what, where and the fix."""

    def __init__(self, endpoint: Endpoint, token_ids: bool = True):
        self.endpoint, self.token_ids, self.client = endpoint, token_ids, openai_client(endpoint)

    def complete(self, job: Job, request: str) -> dict:
        """choices[0] of the reply to `job` as JSON."""
        kw = dict(model=self.endpoint.model, prompt=job.prompt, max_tokens=job.max_tokens,
                  temperature=job.temperature, logprobs=TOP_LOGPROBS)
        if job.seed is not None:
            kw["seed"] = job.seed
        if self.token_ids:
            kw["extra_body"] = {"return_token_ids": True}
        url = self.endpoint.base_url
        with endpoint_errors(request, url, status_fix=self.status_fix,
                             reach_fix="start the server or check --base-url (an OpenAI-compatible API ending in /v1)"):
            reply = self.client.completions.create(**kw).model_dump()
        if not reply.get("choices"):
            raise EndpointError(f"{request}: the reply holds no choices", where=url,
                                fix="probe an OpenAI-compatible completions endpoint")
        return reply["choices"][0]

    def status_fix(self, status: int, msg: str) -> str:
        """What to do about an HTTP error: the model names served (404), top logprobs refused."""
        if status == 404:
            return f"check --model: {self.served_hint()}"
        if "logprob" in msg.lower():
            return ("the endpoint refuses `logprobs`: probe one that returns top logprobs on /v1/completions "
                    "(vLLM: --max-logprobs 2 or more)")
        return "check --model and that the endpoint serves /v1/completions"

    def served_hint(self) -> str:
        """The models the endpoint lists (/v1/models), or why they are unknown."""
        try:
            names = [m.id for m in self.client.models.list()]
        except Exception as e:  # the hint of an error message: never the error itself
            return f"the endpoint's /v1/models did not answer ({type(e).__name__})"
        return f"it serves {', '.join(map(repr, names)) or 'no model'}"


def preflight(endpoint: Endpoint, prompt, max_tokens: int) -> Client:
    """A client for the endpoint, checked on one request: reachable, the model served, top-2
    logprobs returned. Token ids are asked for (vLLM's return_token_ids); an endpoint that refuses
    the field is compared on token strings."""
    client = Client(endpoint, token_ids=True)
    try:
        choice = client.complete(Job(prompt, max_tokens), "the first request")
    except EndpointError as e:
        if "return_token_ids" not in e.what:
            raise
        client = Client(endpoint, token_ids=False)
        choice = client.complete(Job(prompt, max_tokens), "the first request")
    r = reply_of(choice, endpoint.base_url, "the first request")
    if r.tokens and all(m is None for m in r.margin_T):
        raise EndpointError("the first request: no position holds two top logprobs", where=endpoint.base_url,
                            fix="probe an endpoint that honours `logprobs: 2` (vLLM: --max-logprobs 2 or more)")
    client.token_ids = client.token_ids and choice.get("token_ids") is not None
    return client


# --- the conditions ---------------------------------------------------------------------------
Wave = list[Job]


def alone_waves(n: int, max_tokens: int) -> list[Wave]:
    """Each probe prompt alone, one after another."""
    return [[Job(None, max_tokens, ours=i)] for i in range(n)]


def concurrent_waves(n: int, max_tokens: int, batch: int, n_fillers: int) -> list[Wave]:
    """Waves of `batch` requests at once: ours in ceil(batch / 2) slots, fillers (other prompts,
    lengths varied) in the rest, ours at rotating slots."""
    ours_per = max(1, (batch + 1) // 2)
    waves, f = [], 0
    for w, start in enumerate(range(0, n, ours_per)):
        jobs = [Job(None, max_tokens, ours=i) for i in range(start, min(n, start + ours_per))]
        while len(jobs) < batch:
            jobs.append(Job(("filler", f % n_fillers), max(1, max_tokens // 2 + (f % 3) * max_tokens // 2)))
            f += 1
        k = w % len(jobs)
        waves.append(jobs[k:] + jobs[:k])
    return waves


def shared_prefix_waves(n: int, max_tokens: int, n_fillers: int) -> list[Wave]:
    """Waves of SHARED_PREFIX_WAVE of ours, each after and beside a request that extends its prompt."""
    waves = []
    for start in range(0, n, SHARED_PREFIX_WAVE):
        ours = list(range(start, min(n, start + SHARED_PREFIX_WAVE)))
        waves.append([Job(("extend", i, i % n_fillers), max_tokens) for i in ours])   # fills the prefix cache
        waves.append([Job(("extend", i, (i + 1) % n_fillers), max_tokens) for i in ours]
                     + [Job(None, max_tokens, ours=i) for i in ours])
    return waves


def mixed_waves(n: int, max_tokens: int, n_fillers: int, seed: int) -> list[Wave]:
    """Waves of MIXED_WAVE of ours, each beside a longer sampled (temperature 1) request."""
    waves = []
    for start in range(0, n, MIXED_WAVE):
        ours = list(range(start, min(n, start + MIXED_WAVE)))
        waves.append([Job(("filler", i % n_fillers), MIXED_LENGTH_FACTOR * max_tokens, temperature=1.0,
                          seed=seed + i) for i in ours] + [Job(None, max_tokens, ours=i) for i in ours])
    return waves


def plan(cfg: ProbeConfig, n_fillers: int) -> dict[str, list[Wave]]:
    """condition -> its waves (the reference pass first)."""
    conds = {"reference": alone_waves(cfg.n, cfg.max_tokens), "alone": alone_waves(cfg.n, cfg.max_tokens)}
    for b in cfg.batch_sizes:
        conds[f"concurrent-{b}"] = concurrent_waves(cfg.n, cfg.max_tokens, b, n_fillers)
    conds["shared-prefix"] = shared_prefix_waves(cfg.n, cfg.max_tokens, n_fillers)
    conds["mixed-traffic"] = mixed_waves(cfg.n, cfg.max_tokens, n_fillers, cfg.seed)
    return conds


def resolve(job: Job, prompts: list, fillers: list) -> Job:
    """The job with its prompt filled in: ours, a filler, or ours extended by a filler."""
    if job.ours is not None:
        p = prompts[job.ours]
    elif job.prompt[0] == "filler":
        p = fillers[job.prompt[1]]
    else:
        p = extend(prompts[job.prompt[1]], fillers[job.prompt[2]])
    return Job(p, job.max_tokens, job.ours, job.temperature, job.seed)


def run_wave(pool: ThreadPoolExecutor, client: Client, wave: Wave, name: str, advance: Callable) -> dict[int, Reply]:
    """Send a wave's requests at once; the replies of ours by prompt index (filler replies are
    read only to finish them). The first failure cancels the rest and is raised."""
    def one(j: int, job: Job):
        choice = client.complete(job, f"{name}, request {j + 1} of its wave")
        advance(1)
        return reply_of(choice, client.endpoint.base_url, name) if job.ours is not None else None

    futures = [pool.submit(one, j, job) for j, job in enumerate(wave)]
    done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    for f in done:
        if f.exception() is not None:
            raise f.exception()
    return {job.ours: f.result() for job, f in zip(wave, futures) if job.ours is not None}


def run_probe(cfg: ProbeConfig, show_progress: bool = True) -> ProbeResult:
    """Probe the endpoint; write probe.json, probe.md and probe.html to cfg.out_dir."""
    with output(cfg.out_dir, "probe directory", directory=True) as out:
        res = _probe(cfg, show_progress)
        out.mkdir(parents=True, exist_ok=True)
        doc = res.to_json()
        res.paths = {"json": str(atomic_write_json(out / JSON_NAME, doc)),
                     "md": str(atomic_write_text(out / MD_NAME, probe_markdown(doc))),
                     "html": str(write_probe_html(doc, out / HTML_NAME))}
    return res


def _probe(cfg: ProbeConfig, show_progress: bool) -> ProbeResult:
    t0 = time.perf_counter()
    n_fillers = max(8, cfg.n)
    prompts, source = probe_prompts(cfg, cfg.n + n_fillers)
    prompts, fillers = prompts[:cfg.n], prompts[cfg.n:]
    client = preflight(cfg.endpoint(), fillers[0], cfg.max_tokens)
    conds = plan(cfg, n_fillers)
    total = sum(len(w) for waves in conds.values() for w in waves)
    replies: dict[str, list[Reply]] = {}
    bound = min(MAX_IN_FLIGHT, max(len(w) for waves in conds.values() for w in waves))
    with ThreadPoolExecutor(bound) as pool, progress_bar("determinism probe (requests)", total, show_progress) as adv:
        for name, waves in conds.items():
            got: dict[int, Reply] = {}
            for wave in waves:
                got.update(run_wave(pool, client, [resolve(j, prompts, fillers) for j in wave], name, adv))
            replies[name] = [got[i] for i in range(cfg.n)]
    refs = replies.pop("reference")
    results = {k: condition_result(refs, v, cfg.near_tie) for k, v in replies.items()}
    settings = {"n": cfg.n, "max_tokens": cfg.max_tokens, "batch_sizes": list(cfg.batch_sizes), "seed": cfg.seed,
                "logprobs": TOP_LOGPROBS, "near_tie_logits": cfg.near_tie, "requests": total}
    return ProbeResult(cfg.base_url, cfg.model, "token_ids" if client.token_ids else "token_text", source, settings,
                       results, time.perf_counter() - t0)
