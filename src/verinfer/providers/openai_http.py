"""A claim producer over HTTP: any OpenAI-compatible completions endpoint (verinfer serve, vLLM,
a provider's API), through the official `openai` client. Prompts go out as token ids; the
endpoint's prompt and output token ids come back (vLLM's `return_token_ids`; verinfer serve
always sends them). Text is never re-tokenized: an endpoint that returns no token ids cannot be
audited and says so."""

from __future__ import annotations

from dataclasses import dataclass

from verinfer.errors import VerinferError
from verinfer.sampling.params import SamplingParams


class EndpointError(VerinferError):
    """The endpoint could not be reached or answered something unusable."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str                 # the name the endpoint serves
    api_key: str = "EMPTY"
    timeout: float = 120.0
    max_retries: int = 2
    ignore_eos: bool = False   # vLLM / verinfer serve extension; fixed-length outputs


def openai_client(endpoint: Endpoint):
    try:
        import openai
    except ImportError as e:  # pragma: no cover - the [server] extra brings it
        raise VerinferError("the `openai` package is not installed",
                            fix='pip install -e ".[server]" (the [server] extra has the official openai client)') from e
    return openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, timeout=endpoint.timeout,
                         max_retries=endpoint.max_retries)


def request_completion(client, cfg: Endpoint, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[int], str]:
    """One completion; returns (prompt ids, output ids, finish reason) as the endpoint reports them."""
    import openai

    extra = {"return_token_ids": True}
    if params.top_k > 0:
        extra["top_k"] = params.top_k
    if params.min_p > 0:
        extra["min_p"] = params.min_p
    if cfg.ignore_eos:
        extra["ignore_eos"] = True
    kwargs = dict(model=cfg.model, prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
                  top_p=params.top_p, extra_body=extra)
    if params.seed is not None:
        kwargs["seed"] = params.seed
    try:
        resp = client.completions.create(**kwargs)
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        raise EndpointError(f"cannot reach {cfg.base_url} ({type(e).__name__}: {e})", where=cfg.base_url,
                            fix="start the server or check --base-url; rerun the same command to resume") from e
    except openai.APIStatusError as e:
        raise EndpointError(f"the endpoint answered HTTP {e.status_code}: {_err_message(e)}", where=cfg.base_url,
                            fix="check --model and the sampling options the endpoint accepts") from e
    choice = resp.choices[0]
    extra_fields = choice.model_extra or {}
    out_ids, prompt_ids = extra_fields.get("token_ids"), extra_fields.get("prompt_token_ids")
    if out_ids is None:
        raise EndpointError("the endpoint returned no output token ids (choices[0].token_ids)", where=cfg.base_url,
                            fix="verinfer never re-tokenizes text: audit an endpoint that returns token ids "
                                "(verinfer serve; vLLM >= 0.10.2 with return_token_ids)")
    if prompt_ids is None:
        prompt_ids = (resp.model_extra or {}).get("prompt_token_ids") or prompt
    return list(prompt_ids), list(out_ids), choice.finish_reason or "length"


def _err_message(e) -> str:
    try:
        body = e.response.json()
        return body.get("error", {}).get("message") or body.get("message") or e.response.text[:300]
    except Exception:
        return str(e)[:300]


def probe_seeds(client, endpoint: Endpoint, prompt: list[int], params: SamplingParams) -> bool:
    """True if the endpoint gives the same tokens twice for the same seeded request."""
    a = request_completion(client, endpoint, prompt, params)[1]
    b = request_completion(client, endpoint, prompt, params)[1]
    return a == b
