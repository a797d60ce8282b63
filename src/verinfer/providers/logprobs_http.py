"""Completions with top logprobs from any OpenAI-compatible endpoint (the determinism probe's
requests, `verinfer determinism probe`), through the official `openai` client.

Every request asks for `logprobs: 2` (the top two log-probabilities at every position) and, where
the endpoint takes it, `return_token_ids` (vLLM's and verinfer serve's): `connect` checks both on
a first request, and an endpoint that refuses the field, or returns no ids, is read on token
strings. A reply is returned as JSON (choices[0]); what it means is determinism/probe.py's. Every
failure is an EndpointError saying what, where and the fix: a 404 names the models the endpoint
serves, a refused `logprobs` says which servers return them.
"""

from __future__ import annotations

from verinfer.openai_client import EndpointError, endpoint_errors
from verinfer.providers.openai_http import Endpoint, openai_client

TOP_LOGPROBS = 2                      # the completions API's `logprobs`: the top-2 at every position
FIRST_REQUEST = "the first request"


class Client:
    """The endpoint's completions through the official `openai` client; every failure an
    EndpointError saying what, where and the fix."""

    def __init__(self, endpoint: Endpoint, token_ids: bool = True):
        self.endpoint, self.token_ids, self.client = endpoint, token_ids, openai_client(endpoint)

    def complete(self, prompt, max_tokens: int, request: str, temperature: float = 0.0,
                 seed: int | None = None) -> dict:
        """choices[0] of the reply to `prompt` (text or token ids) as JSON; `request` names it in errors."""
        kw = dict(model=self.endpoint.model, prompt=prompt, max_tokens=max_tokens,
                  temperature=temperature, logprobs=TOP_LOGPROBS)
        if seed is not None:
            kw["seed"] = seed
        if self.token_ids:
            kw["extra_body"] = {"return_token_ids": True}
        url = self.endpoint.base_url
        with endpoint_errors(request, url, status_fix=self.status_fix,
                             reach_fix="start the server or check --base-url (an OpenAI-compatible API ending in /v1)"):
            reply = self.client.completions.create(**kw).model_dump()
        if not reply.get("choices"):
            raise EndpointError(f"{request}: the reply holds no choices", where=url,
                                fix="probe an OpenAI-compatible completions endpoint")
        return reply["choices"][0]

    def status_fix(self, status: int, msg: str) -> str:
        """What to do about an HTTP error: the model names served (404), top logprobs refused."""
        if status == 404:
            return f"check --model: {self.served_hint()}"
        if "logprob" in msg.lower():
            return ("the endpoint refuses `logprobs`: probe one that returns top logprobs on /v1/completions "
                    "(vLLM: --max-logprobs 2 or more)")
        return "check --model and that the endpoint serves /v1/completions"

    def served_hint(self) -> str:
        """The models the endpoint lists (/v1/models), or why they are unknown."""
        try:
            names = [m.id for m in self.client.models.list()]
        except Exception as e:  # the hint of an error message: never the error itself
            return f"the endpoint's /v1/models did not answer ({type(e).__name__})"
        return f"it serves {', '.join(map(repr, names)) or 'no model'}"


def connect(endpoint: Endpoint, prompt, max_tokens: int) -> tuple[Client, dict]:
    """A client for the endpoint and choices[0] of its first (greedy) request: reachable, the model
    served. Token ids are asked for (vLLM's return_token_ids); an endpoint that refuses the field,
    or answers without ids, is read on token strings (`client.token_ids` False)."""
    client = Client(endpoint, token_ids=True)
    try:
        choice = client.complete(prompt, max_tokens, FIRST_REQUEST)
    except EndpointError as e:
        if "return_token_ids" not in e.what:
            raise
        client = Client(endpoint, token_ids=False)
        choice = client.complete(prompt, max_tokens, FIRST_REQUEST)
    client.token_ids = client.token_ids and choice.get("token_ids") is not None
    return client, choice
