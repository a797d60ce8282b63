"""`verinfer determinism probe`: a black-box check of an OpenAI-compatible completions endpoint's
greedy determinism.

The same greedy (temperature 0) requests, each with `logprobs: 2`, are sent alone, under concurrent
load, with a shared prefix and beside sampled traffic (the waves of determinism/probe_plan.py, sent
through providers/logprobs_http.py); every answer is compared with the reference, the first `alone`
pass, and each divergent sequence classified at its first divergence by the reference's top-2
margin there (determinism/probe.py: near-tie, large-margin or no-margin). This app reads the
settings, sends each wave's requests at once and writes probe.json, probe.md and probe.html.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait, FIRST_EXCEPTION
from dataclasses import dataclass
from pathlib import Path

from verinfer.determinism.probe import NEAR_TIE, ProbeResult, Reply, check_margins, condition_result, reply_of
from verinfer.determinism.probe_plan import Job, Wave, plan, probe_prompts, resolve
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_json, atomic_write_text, output
from verinfer.progress import progress_bar
from verinfer.providers.logprobs_http import FIRST_REQUEST, TOP_LOGPROBS, Client, connect
from verinfer.providers.openai_http import Endpoint
from verinfer.report.probe import probe_markdown, write_probe_html

DEFAULT_BATCH_SIZES = (1, 4, 16)
MAX_IN_FLIGHT = 64
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


def preflight(endpoint: Endpoint, prompt, max_tokens: int) -> Client:
    """A client for the endpoint, checked on one request: reachable, the model served, top-2
    logprobs returned (providers/logprobs_http.connect; token strings where it returns no ids)."""
    client, choice = connect(endpoint, prompt, max_tokens)
    check_margins(reply_of(choice, endpoint.base_url, FIRST_REQUEST), endpoint.base_url, FIRST_REQUEST)
    return client


def run_wave(pool: ThreadPoolExecutor, client: Client, wave: Wave, name: str, advance: Callable) -> dict[int, Reply]:
    """Send a wave's requests at once; the replies of ours by prompt index (filler replies are
    read only to finish them). The first failure cancels the rest and is raised."""
    def one(j: int, job: Job):
        choice = client.complete(job.prompt, job.max_tokens, f"{name}, request {j + 1} of its wave",
                                 job.temperature, job.seed)
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
    prompts, source = probe_prompts(cfg.model_dir, cfg.n + n_fillers, cfg.seed)
    prompts, fillers = prompts[:cfg.n], prompts[cfg.n:]
    client = preflight(cfg.endpoint(), fillers[0], cfg.max_tokens)
    conds = plan(cfg.n, cfg.max_tokens, cfg.batch_sizes, n_fillers, cfg.seed)
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
