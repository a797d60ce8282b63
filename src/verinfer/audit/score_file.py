"""A claims file replayed into a scores file: the replay every audit reads (`verinfer score`, the
demo, audit-api, the chat audits and the log audit all score through `score`).

    check      each chunk of claims is checked just before it is replayed (model, vocabulary,
               context, fingerprint fields; no speculative claim): bad input stops the run with a
               ClaimError naming the line, the finished parts kept for the rerun
    replay     `audit.replay.score_claims` on the trusted engine (`verifier_engine`: bf16, SDPA),
               a Ray pool of them (`audit.ray_pool`) or a trusted vLLM server's logprobs
               (`audit.remote_reference`)
    current    `scores_current`: a scores file written after its claims file last changed is not
               replayed again
"""

from __future__ import annotations

from pathlib import Path

from verinfer.audit.remote_reference import RemoteReference
from verinfer.audit.replay import Scored, score_claims
from verinfer.claims import Claim, check_claims_fit, iter_claims
from verinfer.engine.engine import Engine
from verinfer.errors import ClaimError, VerinferError
from verinfer.io import check_writable, sha256_and_lines
from verinfer.models.load import has_tokenizer, load_model, model_info
from verinfer.numerics import Numerics
from verinfer.progress import progress_bar
from verinfer.retokenize import Retokenizer

VERIFIER_NUMERICS = Numerics(dtype="bf16", attn="sdpa")


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


__all__ = ["VERIFIER_NUMERICS", "reference_engines", "refuse_speculative", "score", "scores_current",
           "verifier_engine"]
