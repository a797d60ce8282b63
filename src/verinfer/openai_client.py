"""The official `openai` client, built in one place, and its failures read in one place.

    new_client(base_url, api_key, timeout=, max_retries=)   -> openai.OpenAI (the [server] extra)
    with endpoint_errors(request, where, reach_fix=, status_fix=):
        client.completions.create(...)                      # openai errors -> EndpointError

The client retries refused connections, timeouts, 429 and 5xx with exponential backoff and honours
the server's Retry-After (`max_retries`); what still fails leaves the block as a VerinferError
saying what (the request, unreachable or the HTTP status with the server's own message), where
(the endpoint) and what to do. Each caller keeps its own wording through the parameters.

A top-level module, not in `providers/`: providers and audit are independent siblings of one
import-linter layer, and both build clients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from verinfer.errors import VerinferError, api_error_message

INSTALL_FIX = 'pip install -e ".[server]" (the [server] extra has the official openai client)'

StatusFix = Callable[[int, str], str]                         # (HTTP status, server message) -> fix
SpecialStatus = Callable[[int, str], "tuple[str, str] | None"]  # -> (what, fix), or None: the usual wording


class EndpointError(VerinferError):
    """The endpoint could not be reached or answered something unusable."""


def new_client(base_url: str, api_key: str = "EMPTY", *, timeout: float, max_retries: int):
    """An openai.OpenAI for an OpenAI-compatible API (base_url ends in /v1); a VerinferError with
    the install command when the `openai` package is missing."""
    try:
        import openai
    except ImportError as e:
        raise VerinferError("the `openai` package is not installed", fix=INSTALL_FIX) from e
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)


@contextmanager
def endpoint_errors(request: str | None, where: str, *, reach_fix: str, status_fix: str | StatusFix,
                    target: str | None = None, answered: str = "", special: SpecialStatus | None = None,
                    error: type[VerinferError] = EndpointError) -> Iterator[None]:
    """Raise the openai client's failures inside the block as `error` (where=`where`, the openai
    error as its cause), each `what` opening with "{request}: " unless request is None:
      APIConnectionError, APITimeoutError -> "cannot reach {target} ({type}: {error text})", fix
          reach_fix; target is `where` unless given (e.g. the base URL where `where` names a vendor);
      APIStatusError -> special(status, message) where given and not None: its (what, fix); else
          "{answered}HTTP {status}: {message}", fix status_fix (or status_fix(status, message));
    message is the server's own error message (`errors.api_error_message`)."""
    import openai

    head = "" if request is None else f"{request}: "
    try:
        yield
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        raise error(f"{head}cannot reach {target or where} ({type(e).__name__}: {e})", where=where,
                    fix=reach_fix) from e
    except openai.APIStatusError as e:
        msg = api_error_message(e)
        said = special(e.status_code, msg) if special is not None else None
        what, fix = said or (f"{answered}HTTP {e.status_code}: {msg}",
                             status_fix if isinstance(status_fix, str) else status_fix(e.status_code, msg))
        raise error(f"{head}{what}", where=where, fix=fix) from e
