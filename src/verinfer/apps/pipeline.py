"""The audit pipeline as functions the CLI, the demo and the benchmarks share:
generate claims (simulated providers) -> score (replay) -> calibrate (honest only) -> audit -> report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from verinfer.claims import Claim, check_claims_fit, iter_claims, write_claims
from verinfer.detect import Detector
from verinfer.detect.sequential import SequentialAudit
from verinfer.detect.verdict import Verdict
from verinfer.scores import PROVIDER
from verinfer.io import check_writable, output, sha256_and_lines
from verinfer.models.prompts import prompts_for
from verinfer.progress import progress_bar
from verinfer.providers import vllm
from verinfer.providers.simulated import DEFAULT_SPEC, HONEST, PROVIDERS, get_provider, run_provider
from verinfer.audit.remote_reference import RemoteReference
from verinfer.audit.replay import Scored, score_claims
from verinfer.engine.engine import Engine
from verinfer.errors import ClaimError, VerinferError
from verinfer.models.load import has_tokenizer, load_model, model_info
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams
from verinfer.retokenize import Retokenizer

VERIFIER_NUMERICS = Numerics(dtype="bf16", attn="sdpa")


def generate(provider: str, model_dir: str | Path, out: str | Path, *, n: int = 32, max_tokens: int = 64,
             seed: int = 0, spec: dict | None = None, device: str = "cpu", show_progress: bool = True,
             fingerprint=None) -> list[Claim]:
    with output(out, "claims file"):
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
    with output(out, "claims file"):
        return _generate_with_vllm(provider, model_dir, out, n=n, max_tokens=max_tokens, seed=seed, spec=spec,
                                   work_dir=work_dir)


def _generate_with_vllm(provider, model_dir, out, *, n, max_tokens, seed, spec, work_dir) -> "vllm.VllmGeneration":
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
          reference_logprobs: int = 20, reference_concurrency: int = 4, reference_protocol: str = "prompt_logprobs",
          claims=None, retokenizer: Retokenizer | None = None, growing: bool = False, keep_parts: bool = False,
          references: dict | None = None) -> Scored:
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
    a time; reference_protocol "echo": a hosted completions API's echo with logprobs, read through
    the model's tokenizer); model_dir then needs only the model's config.json (and its tokenizer for "echo"). claims: the stream of the file's
    claims when the caller has started reading it (`score_file` peeks at the first claim).
    Claims derived from chat text are re-cut where the reference segments the text differently
    (`audit.replay.recut_claims`), with `retokenizer` or the model's own tokenizer. growing: the
    claims so far of a file still being collected (`score_claims`; a sequential audit's stop rule);
    keep_parts: keep the parts of a file a later command may extend."""
    check_writable(out, "scores file", inputs=[claims_path])  # locked while written: ResumableParts
    info = model_info(model_dir)
    if reference_url is not None:
        if engine is not None or workers is not None or ray_address is not None:
            raise VerinferError("--reference-url replaces the local replay: drop --workers / --ray-address",
                                fix="score with the remote reference or with local replay, not both at once")
        if not reference_model:
            raise VerinferError("--reference-url needs --reference-model (the name the server serves)",
                                where=reference_url, fix="e.g. --reference-model HuggingFaceTB/SmolLM2-135M-Instruct")
        engine = RemoteReference.for_model_dir(reference_url, reference_model, model_dir, logprobs=reference_logprobs,
                                               protocol=reference_protocol,
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
                         model_names=model_names, claims=claims, growing=growing, keep_parts=keep_parts)
    engine = engine or verifier_engine(model_dir, VERIFIER_NUMERICS.with_(matmul=matmul), device=device)

    def check(chunk: list[Claim]) -> None:
        check_claims_fit(chunk, claims_path, model_name=info.name, vocab_size=info.vocab_size,
                         max_positions=info.max_positions, aliases=(*info.aliases, *model_names))
        refuse_speculative(chunk)

    if retokenizer is None and has_tokenizer(model_dir):
        retokenizer = Retokenizer.for_model(model_dir)
    n_lines = len(claims) if isinstance(claims, list) else sha256_and_lines(claims_path)[1]
    with progress_bar(f"score {Path(claims_path).name} (claims)", n_lines, show_progress) as adv:
        return score_claims(claims if claims is not None else iter_claims(claims_path), engine, out,
                            model_sha=info.weights_sha256, progress=adv, growing=growing, keep_parts=keep_parts,
                            gaps=gaps, info=info, check=check, retokenizer=retokenizer,
                            references=references or (reference_engines(model_dir, engine, device)
                                                      if gaps and isinstance(engine, Engine) else None))


def scores_current(claims_path: str | Path, out: str | Path) -> bool:
    """True when `out` was written after `claims_path` last changed (its claims are all scored)."""
    out = Path(out)
    return out.is_file() and out.stat().st_mtime >= Path(claims_path).stat().st_mtime


def refuse_speculative(chunk: list[Claim]) -> None:
    """A ClaimError for a speculative claim among the plain claims this replay scores (speculative
    claims are checked against standard speculative sampling with the draft instead)."""
    for c in chunk:
        if "spec" in c.extra:
            raise ClaimError("a speculative claim (it carries `spec`) among claims scored by replay", where=c.source,
                             fix="score speculative claims on their own with `verinfer score FILE` (every claim "
                                 "of the file speculative), plain claims in another file")


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


def audit(table: pa.Table, detector: Detector, providers: list[str],
          held_out: dict[str, pa.Table] | None = None, max_tokens: int | None = None,
          sequential: bool = False) -> list[Verdict]:
    """Verdicts with confidence per provider (its held-out rows when given, else its rows of
    `table`; the first max_tokens tokens), with whom they judged, the truth of a simulated provider
    and the detector's held-out FPR at calibration. sequential: the anytime-valid audit of
    `detect.sequential` at alpha = the detector's target FPR, over the tokens in their order."""
    judge = SequentialAudit(detector, alpha=detector.target_fpr) if sequential else detector
    held = getattr(detector, "calibration_", None) and detector.calibration_.heldout
    verdicts = []
    for name in providers:
        sub = held_out[name] if held_out and name in held_out else table.filter(pc.equal(table[PROVIDER], name))
        v = judge.verdict(sub, max_tokens=max_tokens).with_(provider=name)
        if held and held.batches:  # the FPR measured on held-out honest claims when it was calibrated
            v = v.with_(heldout_fpr=held.fpr, heldout_fpr_batch_tokens=held.batch_tokens)
        verdicts.append(v.with_(honest=name in HONEST if name in PROVIDERS else None))
    return verdicts
