"""The audit pipeline as functions the CLI, the demo and the benchmarks share:
generate claims (simulated providers) -> score (replay) -> calibrate (honest only) -> audit -> report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from scipy.stats import beta
from rich.console import Console
from rich.markup import escape
from rich.table import Table


from verinfer.claims import Claim, check_claims_fit, iter_claims, read_claims, write_claims
from verinfer.detect import Detector, make_detector
from verinfer.detect import record
from verinfer.detect.metrics import split_tokens
from verinfer.detect.sequential import SequentialAudit
from verinfer.io import check_writable, chunked, progress_bar, sha256_files
from verinfer.models.prompts import prompts_for
from verinfer.providers import vllm
from verinfer.providers.simulated import DEFAULT_SPEC, HONEST, PROVIDERS, get_provider, run_provider
from verinfer.audit.remote_reference import RemoteReference
from verinfer.audit.replay import Scored, fingerprints_of, model_config, score_claims
from verinfer.engine.engine import Engine
from verinfer.errors import ClaimError, VerinferError
from verinfer.models.load import load_model, model_info
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams
from verinfer.scores import PARQUET_KEY, make_provenance, provenance_of_schema

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
          reference_logprobs: int = 20, reference_concurrency: int = 4, claims=None) -> Scored:
    """Replay and score every claim (one Parquet row per token). matmul: the verifier's
    Numerics.matmul when no engine is given ('fp32' is the faster bf16-faithful path on CPU).
    model_names: names the user vouches the model is claimed under, besides its own aliases.
    The claims file is read once, as a stream, never whole: each chunk of claims is checked (model,
    vocabulary, context, fingerprint fields; no speculative claim) just before it is scored, so bad
    input stops the run with a ClaimError naming the line, the finished parts kept for the rerun.
    workers / ray_address: score the parts on a Ray pool (`audit.ray_pool`) of `workers` actors of
    `worker_threads` torch threads each (a local Ray runtime, or the cluster at ray_address).
    gaps: the signed-gap columns and their honest-reference envelope (`reference_engines`: the
    claims are replayed by each honest reference kernel, ~5x the replay work).
    reference_url / reference_model: score from a trusted vLLM server's prompt logprobs
    (`audit.remote_reference`: `reference_logprobs` per position, `reference_concurrency` requests at
    a time); model_dir then needs only the model's config.json. claims: the stream of the file's
    claims when the caller has started reading it (`score_file` peeks at the first claim)."""
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
        if gaps:
            raise VerinferError("--gaps replays the claims under the honest reference kernels in this process, "
                                "not on a Ray pool", fix="score with --gaps without --workers / --ray-address")
        if engine is not None:
            raise ValueError("score: pass an engine or workers / ray_address, not both")
        from verinfer.audit.ray_pool import RayReplayPool

        pool = RayReplayPool(str(model_dir), VERIFIER_NUMERICS.with_(matmul=matmul), workers=workers or 1,
                             threads=worker_threads, device=device, address=ray_address)
        with pool:
            return score(claims_path, model_dir, out, engine=pool, show_progress=show_progress, gaps=gaps,
                         model_names=model_names, claims=claims)
    engine = engine or verifier_engine(model_dir, VERIFIER_NUMERICS.with_(matmul=matmul), device=device)

    def check(chunk: list[Claim]) -> None:
        check_claims_fit(chunk, claims_path, model_name=info.name, vocab_size=info.vocab_size,
                         max_positions=info.max_positions, aliases=(*info.aliases, *model_names))
        refuse_speculative(chunk)

    with progress_bar(f"score {Path(claims_path).name} (claims)", count_lines(claims_path), show_progress) as adv:
        return score_claims(claims if claims is not None else iter_claims(claims_path), engine, out,
                            claims_sha=sha256_files([claims_path]), model_sha=info.weights_sha256, progress=adv,
                            gaps=gaps, info=info, check=check, references=reference_engines(model_dir, engine, device)
                            if gaps and isinstance(engine, Engine) else None)


def count_lines(path: str | Path) -> int:
    """Lines of a file (a byte scan, no parsing): the progress total of a claims file."""
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def refuse_speculative(chunk: list[Claim]) -> None:
    """A ClaimError for a speculative claim in a file of plain claims (they are checked differently)."""
    for c in chunk:
        if "spec" in c.extra:
            raise ClaimError("mixed file: some claims carry `spec` and some do not", where=c.source,
                             fix="score speculative and plain claims in separate files")


def reference_engines(model_dir: str | Path, engine: Engine, device: str = "cpu") -> dict:
    """name -> (Reference, Engine) of every honest reference of `audit.references.REFERENCES`
    besides the primary replay ("bf16", done by `engine`): one engine per numerics, `engine`
    itself where the numerics are its own."""
    from verinfer.audit.references import REFERENCES

    engines = {engine.numerics: engine}
    out = {}
    for name, ref in REFERENCES.items():
        if name == "bf16":
            continue
        if ref.numerics not in engines:
            engines[ref.numerics] = verifier_engine(model_dir, ref.numerics, device)
        out[name] = (ref, engines[ref.numerics])
    return out


def claim_folds(table: pa.Table, folds: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(fold, order) per row: each claim (claim_id) in one of `folds` folds, its claims in a random
    order (row order within a claim kept): rows sorted by `order` read the claims one after another."""
    ids = np.asarray(table["claim_id"].to_pylist())
    uniq, inv = np.unique(ids, return_inverse=True)
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[rng.permutation(uniq.size)] = np.arange(uniq.size)
    order = np.empty(ids.size, dtype=np.int64)
    order[np.lexsort((np.arange(ids.size), rank[inv]))] = np.arange(ids.size)
    return rank[inv] % folds, order


def claim_batches(rows: np.ndarray, order: np.ndarray, tokens: int) -> list[np.ndarray]:
    """Disjoint batches of `tokens` of these rows, read in `order` (whole claims one after another,
    the last one cut, as `audit --max-tokens` reads a provider); a shorter rest is dropped."""
    rows = rows[np.argsort(order[rows], kind="stable")]
    return [rows[i:i + tokens] for i in range(0, rows.size - tokens + 1, tokens)]


def split_claims(table: pa.Table, honest: list[str], frac: float = 0.5,
                 seed: int = 0) -> tuple[pa.Table, dict[str, pa.Table]]:
    """Each honest provider's claims split at random: (the first `frac` of them, all providers in
    one table; {provider: the rest}) to calibrate on one part and audit honest providers on the
    other (the demo)."""
    rng = np.random.default_rng(seed)
    train, test = [], {}
    for name in honest:
        rows = table.filter(pc.equal(table["provider"], name))
        if rows.num_rows == 0:
            raise ClaimError(f"no scored tokens for honest provider {name!r}", fix="score its claims first")
        ids = np.asarray(rows["claim_id"].to_pylist())
        uniq = np.unique(ids)
        mask = np.isin(ids, uniq[rng.permutation(uniq.size)[:round(frac * uniq.size)]])
        train.append(rows.filter(pa.array(mask)))
        test[name] = rows.filter(pa.array(~mask))
    return pa.concat_tables(train), test


def calibrate(table: pa.Table, honest: list[str], *, detector: str = "clipped-mean", seed: int = 0,
              folds: int = 5, fpr_batch_tokens: int = 250, **options) -> Detector:
    """Fit a detector (`detect.DETECTORS[detector]`, made with these config options and
    random_state=seed) on every honest token given, each honest provider one group of its null
    (every honest configuration must pass at the target FPR, not just their pool).

    Held-out FPR (`det.calibration_.heldout`): each honest provider's claims are dealt into `folds`
    folds; a detector fit on the other folds audits each fold in disjoint batches of
    `fpr_batch_tokens` tokens of whole claims (`claim_batches`), and the flagged fraction over
    every fold and provider is the false-positive rate measured on honest claims the fit did not
    see (with a 95% Clopper-Pearson upper bound). It measures the procedure on (folds-1)/folds of
    the data, so it is if anything pessimistic for the final detector, fit on all of it. The
    calibration's size (tokens and claims per honest provider) is recorded beside it."""
    det = make_detector(detector, random_state=seed, **options)
    parts, groups, fold_of, order_of, tokens, claims = [], [], [], [], {}, {}
    rng = np.random.default_rng(seed)
    for name in honest:
        rows = det.token_rows(table.filter(pc.equal(table["provider"], name)))
        if rows.num_rows == 0:
            raise ClaimError(f"no scored tokens for honest provider {name!r}", fix="score its claims first")
        fold, order = claim_folds(rows, folds, rng)
        parts.append(rows)
        groups += [name] * rows.num_rows
        fold_of.append(fold)
        order_of.append(order + sum(len(o) for o in order_of))  # rows of the providers one after another
        tokens[name], claims[name] = rows.num_rows, len(set(rows["claim_id"].to_pylist()))
    honest_rows = pa.concat_tables(parts)
    fold, order, groups = np.concatenate(fold_of), np.concatenate(order_of), np.asarray(groups)
    det.fit(honest_rows, groups=groups)
    if table.schema.metadata and PARQUET_KEY in table.schema.metadata:
        det.provenance_ = provenance_of_schema(table.schema, "the honest scores")
    heldout = heldout_fpr(det, honest_rows, groups, fold, order, folds, fpr_batch_tokens, detector, seed, options)
    det.calibration_ = record.Calibration(tokens=tokens, claims=claims, heldout=heldout)
    return det


def heldout_fpr(det: Detector, rows: pa.Table, groups: np.ndarray, fold: np.ndarray, order: np.ndarray, folds: int,
                batch_tokens: int, detector: str, seed: int, options: dict) -> "record.Heldout | None":
    """`calibrate`'s held-out false-positive rate (None, with a warning in det.warnings_, when a
    fold's complement is too small to fit or no fold holds a whole batch)."""
    flagged = batches = 0
    for f in range(folds):
        test = np.flatnonzero(fold == f)
        per_provider = [claim_batches(test[groups[test] == g], order, batch_tokens) for g in np.unique(groups)]
        if not any(per_provider):
            continue
        train = np.flatnonzero(fold != f)
        try:
            det_f = make_detector(detector, random_state=seed, **options).fit(rows.take(train), groups=groups[train])
        except (VerinferError, ValueError) as e:
            _warn(det, f"no held-out FPR: a detector fit without fold {f + 1}/{folds} fails ({e})")
            return None
        for b in (b for bs in per_provider for b in bs):
            flagged += bool(det_f.verdict(rows.take(b))["flagged"])
            batches += 1
    if batches == 0:
        _warn(det, f"no held-out FPR: no fold of an honest configuration holds {batch_tokens} tokens "
                   f"(calibrate on more claims, or a smaller --fpr-batch-tokens)")
        return record.Heldout(folds=folds, batch_tokens=batch_tokens, batches=0, flagged=0)
    return record.Heldout(folds=folds, batch_tokens=batch_tokens, batches=batches, flagged=flagged,
                          fpr=flagged / batches, fpr_upper95=float(beta.ppf(0.95, flagged + 1, batches - flagged))
                          if flagged < batches else 1.0)


def _warn(det: Detector, text: str) -> None:
    det.warnings_ = [*getattr(det, "warnings_", []), text]


def audit(table: pa.Table, detector: Detector, providers: list[str],
          held_out: dict[str, pa.Table] | None = None, max_tokens: int | None = None,
          sequential: bool = False) -> list[dict]:
    """Verdicts with confidence per provider (its held-out rows when given, else its rows of
    `table`; the first max_tokens tokens). sequential: the anytime-valid audit of
    `detect.sequential` at alpha = the detector's target FPR, over the tokens in their order."""
    judge = SequentialAudit(detector, alpha=detector.target_fpr) if sequential else detector
    verdicts = []
    for name in providers:
        sub = held_out[name] if held_out and name in held_out else table.filter(pc.equal(table["provider"], name))
        d = judge.verdict(sub, max_tokens=max_tokens)
        d["provider"] = name
        held = getattr(detector, "calibration_", None) and detector.calibration_.heldout
        if held and held.batches:  # the FPR measured on held-out honest claims when it was calibrated
            d["heldout_fpr"], d["heldout_fpr_batch_tokens"] = held.fpr, held.batch_tokens
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
        for key in ("threshold_fpr", "more_tokens_needed", "heldout_fpr", "power"):
            rows[-1].pop(key, None)
    return rows


def print_verdicts(verdicts: list[dict]) -> None:
    t = Table(title="verinfer audit: DiFR verdicts",
              caption="FPR: the target, the rate at the threshold on resampled honest batches, and on held-out honest "
                      "claims at calibration; to flag: tokens at which the provider's excess over honest, if it "
                      "persisted, would be flagged")
    for col in ("provider", "truth", "verdict", "tokens", "pooled", "threshold", "p-value", "FPR", "to flag"):
        t.add_column(col, no_wrap=True, min_width=7 if col in ("verdict", "p-value") else None)
    for d in verdicts:
        truth = {True: "honest", False: "misconfigured", None: "?"}[d.get("honest")]
        fpr = f"{d['target_fpr']:.0%}" + (f" / {d['threshold_fpr']:.2%}" if "threshold_fpr" in d else "") + \
            (f" / {d['heldout_fpr']:.1%}" if "heldout_fpr" in d else "")
        t.add_row(escape(d["provider"]), truth, "[red]FLAGGED[/red]" if d["flagged"] else "[green]ok[/green]",
                  str(d["n_tokens"]), f"{d['pooled']:.2g}", f"{d['threshold']:.2g}",
                  (f"{d['p_value']:.2g}" if d["p_value"] > 0 else "<1e-300"), fpr, _more_tokens(d))
    console = Console(width=max(160, Console().width))
    console.print(t)
    for d in verdicts:  # what an ok verdict established (the power against a stated deviation)
        if not d["flagged"] and d.get("power"):
            console.print(f"{escape(d['provider'])}: {escape(d['decision'])}", soft_wrap=True)


def _more_tokens(d: dict) -> str:
    """'-' when flagged, 'none (no excess)' when more tokens would not flag it, else ~N."""
    if d.get("flagged") or "more_tokens_needed" not in d:
        return "-"
    return "none (no excess)" if d["more_tokens_needed"] is None else f"~{d['more_tokens_needed']}"
