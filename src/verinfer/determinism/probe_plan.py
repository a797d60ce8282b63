"""The determinism probe's requests (`verinfer determinism probe`, apps/determinism_probe.py): its
prompts and, for every condition, the waves of requests sent at once.

The same greedy (temperature 0) requests are sent under several conditions and every answer is
compared with the reference, the first `alone` pass (determinism/probe.py):

    alone           one request at a time, a second time (run-to-run)
    concurrent-B    B requests in flight at once: ours (half the slots) among filler requests of
                    other prompts, so a batching server decodes ours inside batches of about B
    shared-prefix   each of ours sent right after, and together with, requests that extend it (its
                    prompt + more tokens), so a server with prefix caching serves ours from cache
    mixed-traffic   ours sent together with longer sampled (temperature 1) requests

A plan names prompts by index (`Job.ours`, or a filler / an extension as a tuple); `resolve` fills
them in. Prompts are token ids from verinfer's own prompt sets for a local copy of the model
(`model_dir`), else built-in text prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

SHARED_PREFIX_WAVE = 4                # of ours per shared-prefix wave (each with one request extending it)
MIXED_WAVE = 2                        # of ours per mixed-traffic wave (each with one long sampled request)
MIXED_LENGTH_FACTOR = 4               # a mixed-traffic request's max_tokens: this times ours

# --- prompts ----------------------------------------------------------------------------------
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


def probe_prompts(model_dir: Path | None, k: int, seed: int) -> tuple[list, str]:
    """k prompts (the first n are the probe's, the rest fillers) and where they come from."""
    if model_dir is None:
        return text_prompts(k, seed), "built-in text prompts"
    from verinfer.models.prompts import prompts_for

    return prompts_for(model_dir, k, seed), f"token ids of verinfer's prompt sets for {model_dir}"


def extend(prompt, tail):
    """The prompt followed by `tail` (both text or both token ids): a request sharing its prefix."""
    return prompt + ("\n" + tail if isinstance(prompt, str) else list(tail))


# --- the conditions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    prompt: object                   # text or token ids
    max_tokens: int
    ours: int | None = None          # index of the probe prompt; None: a filler
    temperature: float = 0.0
    seed: int | None = None


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


def plan(n: int, max_tokens: int, batch_sizes: tuple[int, ...], n_fillers: int, seed: int) -> dict[str, list[Wave]]:
    """condition -> its waves (the reference pass first), for n probe prompts of max_tokens each."""
    conds = {"reference": alone_waves(n, max_tokens), "alone": alone_waves(n, max_tokens)}
    for b in batch_sizes:
        conds[f"concurrent-{b}"] = concurrent_waves(n, max_tokens, b, n_fillers)
    conds["shared-prefix"] = shared_prefix_waves(n, max_tokens, n_fillers)
    conds["mixed-traffic"] = mixed_waves(n, max_tokens, n_fillers, seed)
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
