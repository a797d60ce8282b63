"""The audit pipeline as functions the CLI, the demo and the benchmarks share:
generate claims (simulated providers) -> score (replay) -> calibrate (honest only) -> audit -> report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.markup import escape
from rich.table import Table


from verinfer.claims import Claim, check_claims_fit, iter_claims, read_claims, write_claims
from verinfer.detect import Detector, make_detector
from verinfer.detect.metrics import split_tokens
from verinfer.io import check_writable, chunked, progress_bar, sha256_files
from verinfer.models.prompts import prompts_for
from verinfer.providers import vllm
from verinfer.providers.simulated import DEFAULT_SPEC, HONEST, PROVIDERS, get_provider, run_provider
from verinfer.audit.remote_reference import RemoteReference
from verinfer.audit.replay import Scored, fingerprints_of, model_config, read_scores, score_claims
from verinfer.engine.engine import Engine
from verinfer.errors import ClaimError, VerinferError
from verinfer.models.load import load_model, model_info
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams

VERIFIER_NUMERICS = Numerics(dtype="bf16", attn="sdpa")


def generate(provider: str, model_dir: str | Path, out: str | Path, *, n: int = 32, max_tokens: int = 64,
             seed: int = 0, spec: dict | None = None, device: str = "cpu", show_progress: bool = True,
             fingerprint=None) -> list[Claim]:
    check_writable(out, "claims file")
    cfg = get_provider(provider)
    spec = {**DEFAULT_SPEC, **(spec or {})}
    advertised = SamplingParams(seed=0, max_tokens=max_tokens, **spec)
    prompts = prompts_for(model_dir, n, seed)
    with progress_bar(f"generate {provider}", len(prompts), show_progress) as adv:
        claims = run_provider(cfg, model_dir, prompts, advertised, base_seed=seed, device=device, progress=adv,
                              fingerprint=fingerprint)
    write_claims(out, claims)
    return claims


def generate_with_vllm(provider: str, model_dir: str | Path, out: str | Path, *, n: int = 32, max_tokens: int = 64,
             seed: int = 0, spec: dict | None = None, work_dir: str | Path | None = None) -> "vllm.VllmGeneration":
    """`verinfer generate --engine vllm`: claims from real vLLM on the audit prompts (same prompts
    and per-request seeds as the simulated providers)."""
    check_writable(out, "claims file")
    spec = {**DEFAULT_SPEC, **(spec or {})}
    if spec.get("noise", "vllm-cpu") != "vllm-cpu":
        raise ValueError(f"vLLM on CPU samples with the vllm-cpu noise backend, not {spec['noise']!r}")
    spec["noise"] = "vllm-cpu"
    run = vllm.VllmRun.named(provider)
    advertised = SamplingParams(seed=0 if spec["temperature"] > 0 else None, max_tokens=max_tokens, **spec)
    prompts = prompts_for(model_dir, n, seed)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        llm = vllm.make_llm(model_dir, run, tmp, seed=seed)
        gen = vllm.generate_claims(llm, model_dir, prompts, advertised, run, base_seed=seed)
    write_claims(out, gen.claims)
    return gen


def verifier_engine(model_dir: str | Path, numerics: Numerics = VERIFIER_NUMERICS, device: str = "cpu") -> Engine:
    info = model_info(model_dir)
    return Engine(load_model(model_dir, numerics, device), numerics, eos_token_id=info.eos_token_id)


def score(claims_path: str | Path, model_dir: str | Path, out: str | Path, *, engine: Engine | None = None,
          device: str = "cpu", show_progress: bool = True, gaps: bool = False, matmul: str = "native",
          model_names: tuple[str, ...] = (), workers: int | None = None, ray_address: str | None = None,
          worker_threads: int = 1, reference_url: str | None = None, reference_model: str | None = None,
          reference_logprobs: int = 20, reference_concurrency: int = 4) -> Scored:
    """Replay and score every claim (one Parquet row per token). matmul: the verifier's
    Numerics.matmul when no engine is given ('fp32' is the faster bf16-faithful path on CPU).
    model_names: names the user vouches the model is claimed under, besides its own aliases.
    The claims file is read twice as a stream, never whole: a first pass checks every claim
    (model, vocabulary, context, fingerprint fields) before any compute, the second scores.
    workers / ray_address: score the parts on a Ray pool (`audit.ray_pool`) of `workers` actors of
    `worker_threads` torch threads each (a local Ray runtime, or the cluster at ray_address).
    reference_url / reference_model: score from a trusted vLLM server's prompt logprobs
    (`audit.remote_reference`: `reference_logprobs` per position, `reference_concurrency` requests at
    a time); model_dir then needs only the model's config.json."""
    check_writable(out, "scores file")
    info = model_info(model_dir)
    if reference_url is not None:
        if engine is not None or workers is not None or ray_address is not None:
            raise VerinferError("--reference-url replaces the local replay: drop --workers / --ray-address",
                                fix="score with the remote reference or with local replay, not both at once")
        if not reference_model:
            raise VerinferError("--reference-url needs --reference-model (the name the server serves)",
                                where=reference_url, fix="e.g. --reference-model HuggingFaceTB/SmolLM2-135M-Instruct")
        engine = RemoteReference.for_model_dir(reference_url, reference_model, model_dir, logprobs=reference_logprobs,
                                               concurrency=reference_concurrency, device=device)
    if workers is not None or ray_address is not None:
        if engine is not None:
            raise ValueError("score: pass an engine or workers / ray_address, not both")
        from verinfer.audit.ray_pool import RayReplayPool

        pool = RayReplayPool(str(model_dir), VERIFIER_NUMERICS.with_(matmul=matmul), workers=workers or 1,
                             threads=worker_threads, device=device, address=ray_address)
        with pool:
            return score(claims_path, model_dir, out, engine=pool, show_progress=show_progress, gaps=gaps,
                         model_names=model_names)
    engine = engine or verifier_engine(model_dir, VERIFIER_NUMERICS.with_(matmul=matmul), device=device)
    total, first_fp = 0, None
    for chunk in chunked(iter_claims(claims_path), 256):
        check_claims_fit(chunk, claims_path, model_name=info.name, vocab_size=info.vocab_size,
                         max_positions=info.max_positions, aliases=(*info.aliases, *model_names))
        _, _, first_fp = fingerprints_of(chunk, model_config(engine), first_fp)
        total += sum(len(c.output_token_ids) for c in chunk)
    with progress_bar(f"score {Path(claims_path).name}", total, show_progress) as adv:
        return score_claims(iter_claims(claims_path), engine, out, claims_sha=sha256_files([claims_path]),
                            model_sha=info.weights_sha256, progress=adv, gaps=gaps)


UNKNOWN_PROVIDER = "unknown"  # what `score` writes for a claim without a `provider` field


def load_score_tables(paths: list[str | Path], *, labels: list[str] | None = None, provider: str | None = None,
                      merge: bool = False) -> pa.Table:
    """The rows of every scores file in one table, on the columns all of them have (files scored
    with and without --gaps or fingerprints read together; a detector that needs a dropped column
    says so). Columns of another type than the first file's are an error naming the file.

    Inputs are keyed: a row's provider is its claim's, else `provider`, else the file's label
    (`labels[i]`, default the file's stem). The same file twice, or a claim id of a provider that
    another file also holds, is an error (it would count the same tokens twice). A provider found
    in several files is reported per file ("name (label)") unless `merge` pools them."""
    labels = labels or [Path(p).stem for p in paths]
    seen_files: dict[Path, str | Path] = {}
    for p in paths:
        key = Path(p).resolve()
        if key in seen_files:
            raise VerinferError(f"given twice (also as {seen_files[key]}): its tokens would count twice",
                                where=str(p), fix="pass each scores file once")
        seen_files[key] = p
    tables = []
    for p, label in zip(paths, labels):
        t = read_scores(p)
        prov = t["provider"]
        named = pc.if_else(pc.equal(prov, UNKNOWN_PROVIDER), provider or label, prov)
        tables.append(t.set_column(t.column_names.index("provider"), "provider", named))
    if not tables:
        raise VerinferError("no scores files given", fix="pass the Parquet files `verinfer score` wrote")
    common = [c for c in tables[0].column_names if all(c in t.column_names for t in tables[1:])]
    tables[0] = tables[0].select(common)
    for k, (p, t) in enumerate(zip(paths[1:], tables[1:]), 1):
        t = t.select(common)
        try:
            tables[k] = t.cast(tables[0].schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            diff = [f"{a.name}: {a.type} vs {b.type}" for a, b in zip(tables[0].schema, t.schema) if a.type != b.type]
            raise VerinferError(f"its score columns do not fit those of {paths[0]} ({'; '.join(diff) or e})",
                                where=str(p), fix="rescore the claims with this verinfer (`verinfer score`)") from None
    claims_of: dict[tuple[str, str], str | Path] = {}
    files_of: dict[str, list[int]] = {}
    for k, (p, t) in enumerate(zip(paths, tables)):
        pairs = set(zip(t["provider"].to_pylist(), t["claim_id"].to_pylist()))
        for pair in pairs:
            if pair in claims_of:
                raise VerinferError(f"claim {pair[1]!r} of provider {pair[0]!r} is also in {claims_of[pair]}: its "
                                    f"tokens would count twice", where=str(p),
                                    fix="pass each claim once (claim ids must be unique per provider across inputs)")
            claims_of[pair] = p
        for name in {pr for pr, _ in pairs}:
            files_of.setdefault(name, []).append(k)
    if not merge:
        for name, ks in files_of.items():
            for k in ks if len(ks) > 1 else ():
                t = tables[k]
                prov = pc.if_else(pc.equal(t["provider"], name), f"{name} ({labels[k]})", t["provider"])
                tables[k] = t.set_column(t.column_names.index("provider"), "provider", prov)
    return pa.concat_tables(tables)


def calibrate(table: pa.Table, honest: list[str], *, detector: str = "clipped-mean", seed: int = 0,
              **options) -> tuple[Detector, dict[str, pa.Table]]:
    """Fit a detector (`detect.DETECTORS[detector]`, made with these config options and
    random_state=seed) on the train half of the honest tokens, each honest provider one group of
    its null (every honest configuration must pass at the target FPR, not just their pool); return
    it and each honest provider's held-out test half (for auditing honest providers without
    reusing train data). The halves are split over the rows that carry a token for the detector."""
    det = make_detector(detector, random_state=seed, **options)
    rng = np.random.default_rng(seed)
    train, groups, test = [], [], {}
    for name in honest:
        rows = det.token_rows(table.filter(pc.equal(table["provider"], name)))
        if rows.num_rows == 0:
            raise ClaimError(f"no scored tokens for honest provider {name!r}", fix="score its claims first")
        tr, te = split_tokens(rows.num_rows, rng)
        train.append(rows.take(tr))
        groups += [name] * len(tr)
        test[name] = rows.take(te)
    return det.fit(pa.concat_tables(train), groups=groups), test


def audit(table: pa.Table, detector: Detector, providers: list[str],
          held_out: dict[str, pa.Table] | None = None, max_tokens: int | None = None) -> list[dict]:
    """Verdicts with confidence per provider (its held-out rows when given, else its rows of
    `table`; the first max_tokens tokens)."""
    verdicts = []
    for name in providers:
        sub = held_out[name] if held_out and name in held_out else table.filter(pc.equal(table["provider"], name))
        d = detector.verdict(sub, max_tokens=max_tokens)
        d["provider"] = name
        d["honest"] = name in HONEST if name in PROVIDERS else None
        verdicts.append(d)
    return verdicts


def combine_verdicts(per_detector: list[list[dict]]) -> list[dict]:
    """Token-DiFR + Activation-DiFR (or any detectors) on the same providers: one row per
    provider and detector (provider shown as `name [score]`) plus a `name [combined]` row that is
    flagged when any detector flags it (union bound: its false-positive rate is at most the sum of
    the detectors' targets, so calibrate each at target/m) with Bonferroni p = min(1, m * min p)."""
    if len(per_detector) == 1:
        return per_detector[0]
    m, rows = len(per_detector), []
    for i, name_rows in enumerate(zip(*per_detector)):
        for d in name_rows:
            rows.append({**d, "provider": f"{d['provider']} [{d.get('score', '?')}]"})
        best = min(name_rows, key=lambda d: d["p_value"])
        rows.append({**best, "provider": f"{best['provider']} [combined]",
                     "flagged": any(d["flagged"] for d in name_rows),
                     "p_value": min(1.0, m * best["p_value"]),
                     "target_fpr": sum(d["target_fpr"] for d in name_rows),
                     "n_tokens": max(d["n_tokens"] for d in name_rows),
                     "scores": [d.get("score") for d in name_rows]})
        rows[-1].pop("threshold_fpr", None)
        rows[-1].pop("more_tokens_needed", None)
    return rows


def print_verdicts(verdicts: list[dict]) -> None:
    t = Table(title="verinfer audit: DiFR verdicts")
    for col in ("provider", "truth", "verdict", "tokens", "pooled", "threshold", "p-value", "FPR target / at thr.",
                "tokens to flag if its excess persisted"):
        t.add_column(col, no_wrap=True)
    for d in verdicts:
        truth = {True: "honest", False: "misconfigured", None: "?"}[d.get("honest")]
        fpr = f"{d['target_fpr']:.0%}" + (f" / {d['threshold_fpr']:.2%}" if "threshold_fpr" in d else "")
        t.add_row(escape(d["provider"]), truth, "[red]FLAGGED[/red]" if d["flagged"] else "[green]ok[/green]",
                  str(d["n_tokens"]), f"{d['pooled']:.2g}", f"{d['threshold']:.2g}",
                  (f"{d['p_value']:.2g}" if d["p_value"] > 0 else "<1e-300"), fpr, _more_tokens(d))
    Console(width=max(160, Console().width)).print(t)


def _more_tokens(d: dict) -> str:
    """'-' when flagged, 'none (no excess)' when more tokens would not flag it, else ~N."""
    if d.get("flagged") or "more_tokens_needed" not in d:
        return "-"
    return "none (no excess)" if d["more_tokens_needed"] is None else f"~{d['more_tokens_needed']}"
