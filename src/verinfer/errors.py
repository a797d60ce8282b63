"""User-facing errors: what was wrong, where (file:line, field), and what to do."""

from __future__ import annotations


class VerinferError(Exception):
    """An error the CLI prints without a traceback and exits non-zero on."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        parts = [f"{self.where}: {self.what}" if self.where else self.what]
        if self.fix:
            parts.append(f"  -> {self.fix}")
        return "\n".join(parts)


class ClaimError(VerinferError):
    """A claims file is malformed or does not fit the model."""


class ModelError(VerinferError):
    """A model directory is missing, malformed, or does not fit the request."""


class NumericsError(VerinferError):
    """NaN/inf logits or an unsupported numerics configuration."""


def api_error_message(e) -> str:
    """The message of an OpenAI-compatible server's error reply (an openai.APIStatusError):
    {"error": {"message": ...}} or vLLM's older {"message": ...}, else the body's start."""
    try:
        body = e.response.json()
        return body.get("error", {}).get("message") or body.get("message") or e.response.text[:300]
    except Exception:
        return str(e)[:300]


class UnknownNameError(VerinferError, ValueError):
    """A name that no registry entry has (verinfer.registry). Also a ValueError: it is an invalid
    argument value, and callers that validate arguments catch ValueError."""
