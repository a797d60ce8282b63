"""verinfer: make LLM inference checkable and reproducible.

The Python API (`verinfer.api`: audit_endpoint, audit_vendors, audit_log, score_claims) is
exported here and loads on first use, so `import verinfer` stays cheap."""

from verinfer._version import __version__

_API = ("audit_endpoint", "audit_vendors", "audit_log", "score_claims", "ChatEndpoint", "ChatAuditResult",
        "VendorResult", "Scored")


def __getattr__(name: str):
    if name in _API:  # imported on first use: `import verinfer` loads no layer
        import importlib

        return getattr(importlib.import_module("verinfer.api"), name)
    raise AttributeError(f"module 'verinfer' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
