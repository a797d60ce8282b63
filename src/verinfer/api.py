"""verinfer from Python: one function per job, each returning a typed result; the `verinfer`
command calls these same functions. Importing `verinfer` is cheap: they load on first use.

    import verinfer

    res = verinfer.audit_endpoint("https://api.example/v1", "org/model", trusted_model="smollm2-135m-instruct",
                                  api_key_env="EXAMPLE_API_KEY", n=64)
    res.vendor("endpoint").flagged, res.vendor("endpoint").nearest_band

    res = verinfer.audit_vendors("vendors.toml", trusted_model="smollm2-135m-instruct")   # side by side
    res = verinfer.audit_log("chat-log.jsonl", trusted_model="smollm2-135m-instruct")     # past conversations
    scored = verinfer.score_claims("claims.jsonl", "scores.parquet", trusted_model=...)   # one row per token

trusted_model: the trusted local copy of the model the endpoints claim to serve: a directory, a
name from `verinfer models list`, or None for the shipped testbed target. settings: the fields of
`core.chat.ChatAuditConfig` (n, max_tokens, seed, system_prompt, tokens, sequential,
target_fpr, honest, calib_n, bands, device, matmul, and the sampling: temperature, top_p, top_k,
min_p, noise, mode; temperature > 0 audits seeded, a vendor that ignores seeds is judged unseeded
by `unseeded_detector`, "pit-uniformity" or "xent-excess": its row's `mode` and `note`).
"""

from __future__ import annotations

from pathlib import Path

from verinfer.apps.audit_chat import (ChatAuditConfig, ChatAuditResult, VendorResult, audit_vendors as _audit_vendors,
                                      audit_endpoint as _audit_endpoint, read_vendors)
from verinfer.apps.audit_log import audit_log as _audit_log
from verinfer.audit.replay import Scored
from verinfer.models.catalog import trusted_model_dir
from verinfer.providers.chat_http import ChatEndpoint

DEFAULT_OUT = Path("runs/audit-chat")


def _config(trusted_model, out_dir, settings: dict) -> ChatAuditConfig:
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    return ChatAuditConfig(trusted_model_dir(trusted_model), Path(out_dir), **settings)


def audit_endpoint(base_url: str, model: str, *, trusted_model: str | Path | None = None,
                   out_dir: str | Path = DEFAULT_OUT, api_key_env: str | None = None, extra: dict | str | None = None,
                   concurrency: int = 4, timeout: float = 120.0, show_progress: bool = True,
                   **settings) -> ChatAuditResult:
    """Audit one chat endpoint (`/v1/chat/completions`, text replies) at temperature 0 or seeded: the verdict,
    the nearest reference band, and what the audit cost (`ChatAuditResult.vendor("endpoint")`)."""
    return _audit_endpoint(base_url, model, _config(trusted_model, out_dir, settings), api_key_env=api_key_env,
                           extra=extra, concurrency=concurrency, timeout=timeout, show_progress=show_progress)


def audit_vendors(vendors: str | Path | list[ChatEndpoint], *, trusted_model: str | Path | None = None,
                  out_dir: str | Path = DEFAULT_OUT, show_progress: bool = True, **settings) -> ChatAuditResult:
    """Audit several chat endpoints side by side (a vendors TOML file or a list of ChatEndpoint):
    the same prompts, one calibrated detector, reference bands; vendors.json / .md / .html."""
    eps = read_vendors(vendors) if isinstance(vendors, (str, Path)) else list(vendors)
    return _audit_vendors(eps, _config(trusted_model, out_dir, settings), show_progress=show_progress)


def audit_log(log: str | Path, *, trusted_model: str | Path | None = None, out_dir: str | Path = DEFAULT_OUT,
              skip_unusable: bool = False, neutral_fields: tuple[str, ...] = (), noise: str | None = None,
              vendors_file: str | Path | None = None, show_progress: bool = True, **settings) -> ChatAuditResult:
    """Audit a log of past chat exchanges (OpenAI request/response JSON, one per line): a row per
    model the log names and sampling, reference bands run on the log's own conversations. Greedy
    exchanges are judged greedy; sampled ones with a seed seeded, with the sampler the auditor
    declares (noise; vendors_file: a vendors TOML whose `noise` names a vendor's); the others are
    judged unseeded, a row per model and sampling (`modes`: claims judged per mode). neutral_fields: request
    fields of the log's own that change no token (`providers.chat_contract`)."""
    return _audit_log(Path(log), _config(trusted_model, out_dir, settings), skip_unusable=skip_unusable,
                      neutral=tuple(neutral_fields), noise=noise, vendors_file=vendors_file,
                      show_progress=show_progress)


def score_claims(claims: str | Path, out: str | Path, *, trusted_model: str | Path | None = None,
                 show_progress: bool = True, **options) -> Scored:
    """Replay a claims file with the trusted model: one Parquet row per token with every score
    (`apps.pipeline.score`'s options: device, matmul, gaps, reference_url, ...)."""
    from verinfer.apps.pipeline import score

    return score(Path(claims), trusted_model_dir(trusted_model), Path(out), show_progress=show_progress, **options)


__all__ = ["ChatAuditResult", "ChatEndpoint", "Scored", "VendorResult", "audit_endpoint", "audit_log",
           "audit_vendors", "score_claims"]
