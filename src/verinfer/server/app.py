"""`verinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream` as server-sent
events), GET /v1/models, GET /health. Every choice carries the token ids (vLLM's fields:
`prompt_token_ids` and `token_ids`; chat puts `prompt_token_ids` at the top level) so an auditor
never re-tokenizes text, and every response states the seed and noise backend it sampled with
(`sampling`; a request with temperature > 0 and no seed gets a random one, reported there).

Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for bad
parameters (what was wrong and what to send) and for a body that is not text (not UTF-8, a lone
UTF-16 surrogate in any string, JSON nested deeper than the parser follows), 404 for a model the server does not serve (names
are looked up in a table, never used as paths), 413 for an oversized body, 503 when more than
`Limits.max_waiting` generations are queued. Generations run in worker threads, at most
`Limits.max_concurrent` at once, each request alone with its own cache and noise stream.

Batching (`ServeConfig.batching`): "alone" (the default) never batches requests together, so a
greedy request's tokens are its batch-size-1 tokens bit for bit whatever else is running.
"continuous" decodes the greedy requests of each served model in one running batch
(server/batching.py: the determinism scheduler's loop, up to `max_batch` rows, newcomers prefilled
in chunks and joined between decode steps), as a real server does: in bf16 a request's tokens then
depend on what it shares the batch with (near-tie flips, what `verinfer determinism probe` finds).
Sampled requests always run alone.
`max_concurrent` bounds the generations that run alone in worker threads (sampled requests; every
request with "alone"); batched rows take no such slot, they are bounded by `max_batch` per model
(each model's batch is one more thread). `max_waiting` bounds all queued requests: those waiting
for a slot plus those waiting to join a batch. A request the batch loop fails gets a 503
`batch_failed` error naming the cause (an SSE error event once streaming has begun).

Determinism (`ServeConfig.deterministic`): greedy tokens are the determinism reference's tokens,
what `verinfer generate --deterministic best` (or margingate / llm42) gives the same prompt inside
any batch. `best` decodes on the fixed-shape deterministic path (determinism/invariant.py), with
either batching. `margingate` (with "continuous" only) decodes the batch on the bf16 path and
verifies only near-tie steps (top-2 margin below the model's calibrated tau, from `tau_file`) on the
fixed-shape path, repairing those whose token differs (determinism/margingate.py); its logprobs are
the batch's.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from starlette.requests import Request  # module level: FastAPI resolves the handlers' annotations here

from verinfer import retokenize
from verinfer.apps.determinism import DEFAULT_TAU_FILE
from verinfer.determinism.tau import read_tau
from verinfer.errors import VerinferError
from verinfer.sampling.noise import NOISE_BACKENDS
from verinfer.sampling.params import SamplingParams
from verinfer.server.batching import BATCHING, Batcher, BatchError, batched_steps
from verinfer.server.generation import Step, generate_steps
from verinfer.server.protocol import ChatCompletionRequest, CompletionRequest, Limits
from verinfer.server.registry import ServedModel, load_registry


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


@dataclass
class ServeConfig:
    model_dir: Path
    misconfig: str | None = None
    noise: str = "vllm-cpu"
    device: str = "cpu"
    limits: Limits = field(default_factory=Limits)
    deterministic: str | None = None  # "best" or "margingate" (module docstring)
    batching: str = "alone"           # "continuous": greedy requests share one batch per model
    max_batch: int = 16               # rows of that batch
    tau_file: Path = DEFAULT_TAU_FILE  # deterministic="margingate": the calibrated taus (by model name)
    tau: float | None = None          # ... or this tau for every model (tests)

    def __post_init__(self):
        if self.noise not in NOISE_BACKENDS:
            raise VerinferError(f"unknown noise backend {self.noise!r}", where="--noise",
                                fix=f"use one of {', '.join(NOISE_BACKENDS)}")
        if self.batching not in BATCHING:
            raise VerinferError(f"unknown batching {self.batching!r}", where="--batching",
                                fix=f"use one of {', '.join(BATCHING)}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise VerinferError(f"must be an integer of at least 1, got {self.max_batch!r}", where="--max-batch",
                                fix="use 1 or more rows per batch (default 16)")
        if self.deterministic == "margingate" and self.batching != "continuous":
            raise VerinferError("margingate verifies the steps of a batch; with --batching alone there is none",
                                where="--deterministic",
                                fix="add --batching continuous, or use --deterministic best (exact alone too)")


class Slots:
    """At most `max_concurrent` generations at once and `max_waiting` queued behind them (with
    `queued()`: the requests waiting to join a batch)."""

    def __init__(self, limits: Limits, queued=lambda: 0):
        self.limits, self.queued = limits, queued
        self.sem = asyncio.Semaphore(limits.max_concurrent)
        self.waiting = 0

    def check(self) -> None:
        n = self.waiting + self.queued()
        if n >= self.limits.max_waiting:
            raise APIError(503, f"server busy: {n} requests already queued (limit "
                                f"{self.limits.max_waiting}); retry later", type_="server_busy")

    @asynccontextmanager
    async def hold(self):
        self.check()
        self.waiting += 1
        try:
            await self.sem.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self.sem.release()


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None
    ignore_eos: bool


# --- request preparation ----------------------------------------------------------------------
def _lookup(registry: dict[str, ServedModel], name: str) -> ServedModel:
    model = registry.get(name)
    if model is None:
        raise APIError(404, f"model {name!r} is not served here; available: {sorted(registry)}", "model",
                       "model_not_found")
    return model


def _check_ids(model: ServedModel, ids: list[int], param: str) -> list[int]:
    V = model.info.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {V}) of {model.name}", param)
    if not ids:
        raise APIError(400, "the prompt is empty (no tokens)", param)
    return ids


def _encode(model: ServedModel, text: str, limits: Limits, param: str) -> list[int]:
    if len(text) > limits.max_prompt_chars:
        raise APIError(400, f"prompt has {len(text)} characters; this server accepts at most "
                            f"{limits.max_prompt_chars}", param)
    return _check_ids(model, model.tokenizer.encode(text), param)


def chat_prompt_ids(model: ServedModel, messages, limits: Limits) -> list[int]:
    """The model's chat template if its tokenizer has one, else the plain one of
    `retokenize.PLAIN_CHAT_TEMPLATE` (the testbed has none): the rule an auditor re-derives."""
    total = sum(len(m.content) for m in messages)
    if total > limits.max_prompt_chars:
        raise APIError(400, f"messages hold {total} characters; this server accepts at most "
                            f"{limits.max_prompt_chars}", "messages")
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    try:
        ids = retokenize.chat_prompt_ids(model.tokenizer, msgs)
    except retokenize.TemplateError as e:
        raise APIError(400, e.what, "messages") from None
    return _check_ids(model, ids, "messages")


def _params(body, model: ServedModel, max_tokens: int | None, n_prompt: int, noise: str, limits: Limits):
    room = model.context - n_prompt
    if room < 1:
        raise APIError(400, f"the prompt has {n_prompt} tokens, the whole context of {model.name} "
                            f"({model.context}); shorten it", "prompt")
    if max_tokens is None:
        max_tokens = min(room, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens}",
                       "max_tokens")
    if max_tokens > room:
        raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                            f"{model.name} ({model.context} positions); lower max_tokens to at most {room}",
                       "max_tokens")
    seed = body.seed
    if body.temperature > 0 and seed is None:
        seed = secrets.randbelow(2**63)
    top_k = body.top_k if body.top_k > 0 else -1
    try:
        return SamplingParams(body.temperature, top_k, body.top_p, body.min_p, seed, max_tokens, noise)
    except ValueError as e:
        raise APIError(400, str(e)) from e


def _logprobs_n(n: int | None, limits: Limits, param: str) -> int | None:
    if n is not None and n > limits.max_logprobs:
        raise APIError(400, f"{param} {n} is over this server's limit of {limits.max_logprobs}", param)
    return n


# --- text helpers -----------------------------------------------------------------------------
class Detok:
    """Incremental detokenization: emit text only once it no longer ends in a partial character."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def _tok_str(model: ServedModel, token_id: int) -> str:
    return model.tokenizer.decode([token_id])


def completion_logprobs(model: ServedModel, steps: list[Step], offset0: int = 0) -> dict:
    tokens = [_tok_str(model, s.token_id) for s in steps]
    offsets, o = [], offset0
    for t in tokens:
        offsets.append(o)
        o += len(t)
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [({_tok_str(model, i): lp for i, lp in s.top} if s.top is not None else None)
                             for s in steps],
            "text_offset": offsets}


def chat_logprobs(model: ServedModel, steps: list[Step]) -> dict:
    def entry(i, lp):
        s = _tok_str(model, i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(s.token_id, s.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in (s.top or [])]} for s in steps]}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


# --- the app ----------------------------------------------------------------------------------
class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected: its generation is stopped."""


class BodyLimit:
    """ASGI middleware: refuse request bodies over max_bytes (Content-Length or streamed) with 413."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _reply(self, send, status: int, message: str):
        body = json.dumps(APIError(status, message).body()).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cl = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"request body over this server's limit of {self.max_bytes} bytes; send a smaller request"
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                return await self._reply(send, 400, "invalid Content-Length header")
            if n > self.max_bytes:
                return await self._reply(send, 413, too_big)
        seen, started, over = 0, False, False

        async def limited_receive():
            nonlocal seen, over
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg):
            # A framework may catch _BodyTooLarge while reading the body (FastAPI answers 400 "error
            # parsing the body"): once the body went over the limit, whatever it answers becomes the 413.
            nonlocal started
            if over:
                if not started:
                    started = True
                    await self._reply(send, 413, too_big)
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                started = True
                await self._reply(send, 413, too_big)


def framework_error_message(e) -> str:
    """What an HTTPException of the framework says (unknown route, wrong method, unreadable body);
    for a body its JSON parser could not read, why (FastAPI raises it from the parser's error)."""
    cause = e.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not UTF-8 text (byte {cause.start}: {cause.reason}); "
                "send the JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply to parse; send a flat object of the request's fields"
    return str(e.detail)


def create_app(registry: dict[str, ServedModel], cfg: ServeConfig):
    from fastapi import FastAPI

    batchers = make_batchers(registry, cfg)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        for b in batchers.values():  # each loop thread ends after its step in flight
            await asyncio.to_thread(b.stop)

    app = FastAPI(title="verinfer", description="OpenAI-compatible, auditable inference server", lifespan=lifespan)
    app.state.batchers = batchers
    runner = _Runner(batchers, cfg.limits)
    _add_error_handlers(app)
    _add_meta_routes(app, registry)
    _add_completions(app, registry, cfg, runner)
    _add_chat(app, registry, cfg, runner)
    return BodyLimit(app, cfg.limits.max_body_bytes)


def _meta(model: ServedModel, params: SamplingParams) -> dict:
    return {"seed": params.seed, "noise": params.noise}


def _usage(jobs: list[Job], outs: list[int]) -> dict:
    p = sum(len(j.prompt_ids) for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": sum(outs), "total_tokens": p + sum(outs)}


class _Runner:
    """How a request's jobs run: a greedy job of a continuously batched model in its batch, any other
    alone in a worker thread, in a slot of max_concurrent (the slots are made in the running loop)."""

    def __init__(self, batchers: dict, limits):
        self.batchers, self.limits, self._slots = batchers, limits, None

    def slots(self) -> Slots:
        if self._slots is None:  # created inside the running event loop
            self._slots = Slots(self.limits, lambda: sum(b.waiting for b in self.batchers.values()))
        return self._slots

    async def stream(self, model: ServedModel, rid: str, job: Job) -> AsyncIterator[Step]:
        """The job's Steps: a greedy job of a continuously batched model from its batch, any other
        decoded alone in a worker thread, one step at a time, in a slot of max_concurrent."""
        from starlette.concurrency import iterate_in_threadpool

        batcher = self.batchers.get(id(model))
        run = model.provider.run_params(job.params)  # what a misconfigured server really decodes with
        if batcher is not None and run.greedy:
            self.slots().check()
            try:
                async for step in batched_steps(batcher, rid, job.prompt_ids, run, logprobs=job.logprobs,
                                                ignore_eos=job.ignore_eos):
                    yield step
            except BatchError as e:
                raise APIError(503, str(e), type_="batch_failed") from e
            return
        async with self.slots().hold():
            it = generate_steps(model, rid, job.prompt_ids, job.params, logprobs=job.logprobs,
                                ignore_eos=job.ignore_eos)
            async for step in iterate_in_threadpool(it):
                yield step

    async def run(self, model: ServedModel, rid: str, job: Job, request: Request) -> list[Step]:
        """All the job's Steps; a client that disconnected stops it between two steps (its slot or
        batch row is freed, no more compute is spent on it)."""
        steps = []
        async with aclosing(self.stream(model, rid, job)) as it:
            async for step in it:
                steps.append(step)
                if step.finish_reason is None and await request.is_disconnected():
                    raise _ClientGone()
        return steps



def _add_error_handlers(app) -> None:
    """verinfer's APIError, request validation, HTTP and client-gone errors as OpenAI error bodies."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError):
        errs = e.errors()
        parts, param = [], None
        for err in errs[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
            param = param or (loc[0] if loc else getattr((err.get("ctx") or {}).get("error"), "param", None))
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                msg = "unknown field (not supported by this server)"
            parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
        return JSONResponse(APIError(400, "invalid request: " + "; ".join(parts), param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, framework_error_message(e)).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(_ClientGone)
    async def _client_gone(_req: Request, _e: _ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it



def _add_meta_routes(app, registry: dict[str, ServedModel]) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "verinfer", "root": m.name,
             "max_model_len": m.context} for name, m in sorted(registry.items())]}



def _add_completions(app, registry: dict[str, ServedModel], cfg: ServeConfig, runner: _Runner) -> None:
    from fastapi.responses import StreamingResponse

    limits = cfg.limits

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model = _lookup(registry, body.model)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "`prompt` is empty", "prompt")
        if len(prompts) > limits.max_prompts:
            raise APIError(400, f"{len(prompts)} prompts in one request; this server accepts at most "
                                f"{limits.max_prompts}", "prompt")
        lp = _logprobs_n(body.logprobs, limits, "logprobs")
        jobs = []
        for p in prompts:
            ids = _encode(model, p, limits, "prompt") if isinstance(p, str) else _check_ids(model, list(p), "prompt")
            jobs.append(Job(ids, _params(body, model, body.max_tokens, len(ids), cfg.noise, limits), lp,
                            body.ignore_eos))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            runner.slots().check()

            async def events():
                outs = []
                try:
                    for i, job in enumerate(jobs):
                        dt, n, first = Detok(model.tokenizer), 0, True
                        async for s in runner.stream(model, f"{rid}-{i}", job):
                            n += 1
                            choice = {"index": i, "text": dt.add(s.token_id, s.finish_reason is not None),
                                      "logprobs": completion_logprobs(model, [s]) if job.logprobs is not None else None,
                                      "finish_reason": s.finish_reason, "token_ids": [s.token_id]}
                            if first:
                                choice["prompt_token_ids"], first = job.prompt_ids, False
                            yield _sse({**head, "choices": [choice], "sampling": _meta(model, job.params)})
                        outs.append(n)
                    if body.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(jobs, outs)})
                except APIError as e:
                    yield _sse(e.body())
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        results = await asyncio.gather(*[runner.run(model, f"{rid}-{i}", j, request) for i, j in enumerate(jobs)])
        choices = []
        for i, (job, steps) in enumerate(zip(jobs, results)):
            ids = [s.token_id for s in steps]
            choices.append({"index": i, "text": model.tokenizer.decode(ids, skip_special_tokens=True),
                            "logprobs": completion_logprobs(model, steps) if job.logprobs is not None else None,
                            "finish_reason": steps[-1].finish_reason, "prompt_token_ids": job.prompt_ids,
                            "token_ids": ids})
        return {**head, "choices": choices, "usage": _usage(jobs, [len(r) for r in results]),
                "sampling": _meta(model, jobs[0].params)}



def _add_chat(app, registry: dict[str, ServedModel], cfg: ServeConfig, runner: _Runner) -> None:
    from fastapi.responses import StreamingResponse

    limits = cfg.limits

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        model = _lookup(registry, body.model)
        ids = chat_prompt_ids(model, body.messages, limits)
        lp = _logprobs_n(body.n_logprobs, limits, "top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = Job(ids, _params(body, model, max_tokens, len(ids), cfg.noise, limits), lp, body.ignore_eos)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            runner.slots().check()
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}

            async def events():
                dt, n = Detok(model.tokenizer), 0
                try:
                    yield _sse({**head, "prompt_token_ids": ids, "sampling": _meta(model, job.params),
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
                    async for s in runner.stream(model, rid, job):
                        n += 1
                        yield _sse({**head, "choices": [{
                            "index": 0, "delta": {"content": dt.add(s.token_id, s.finish_reason is not None)},
                            "logprobs": chat_logprobs(model, [s]) if lp is not None else None,
                            "finish_reason": s.finish_reason, "token_ids": [s.token_id]}]})
                    if body.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage([job], [n])})
                except APIError as e:
                    yield _sse(e.body())
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        steps = await runner.run(model, rid, job, request)
        out = [s.token_id for s in steps]
        return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
                "prompt_token_ids": ids, "sampling": _meta(model, job.params),
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": model.tokenizer.decode(out, skip_special_tokens=True)},
                             "logprobs": chat_logprobs(model, steps) if lp is not None else None,
                             "finish_reason": steps[-1].finish_reason, "token_ids": out}],
                "usage": _usage([job], [len(out)])}


def make_batchers(registry: dict[str, ServedModel], cfg: ServeConfig) -> dict[int, Batcher]:
    """id(served model) -> its Batcher with continuous batching (one per model, whatever its
    names), else empty. Their threads start at the first batched request. With margingate each
    model's tau is read here (a model without one fails before the server starts)."""
    if cfg.batching != "continuous":
        return {}
    models = {id(m): m for m in registry.values()}

    def tau(m: ServedModel) -> float:
        if cfg.deterministic != "margingate":
            return 0.0
        return cfg.tau if cfg.tau is not None else read_tau(cfg.tau_file, m.name, policy="margingate")
    return {k: Batcher(m, cfg.max_batch, deterministic=cfg.deterministic, tau=tau(m)) for k, m in models.items()}


def check_listen(port: int, threads: int | None, host: str = "127.0.0.1") -> None:
    """A VerinferError naming the option for a port outside 0-65535 (0: any free port), a port another
    process already listens on (bound here with SO_REUSEADDR, as uvicorn binds, and let go), or fewer
    than one torch thread, before any model is loaded."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise VerinferError(f"not a TCP port: {port!r}", where="--port", fix="use a port in 1-65535, e.g. --port 8000")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise VerinferError(f"must be at least 1, got {threads!r}", where="--threads",
                            fix="use 1 or more torch threads, or leave --threads out for torch's choice")
    if port:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise VerinferError(f"cannot listen on {host}:{port} ({e.strerror or e})", where="--port",
                                    fix="choose another --port (another process holds this one), or --port 0 for "
                                        "any free port") from None


def serve(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8000, threads: int | None = None,
          log_level: str = "info") -> None:
    """Load the models (errors surface before the port opens) and run uvicorn until stopped."""
    import torch
    import uvicorn

    check_listen(port, threads, host)
    if threads is not None:
        torch.set_num_threads(threads)
    registry = load_registry(cfg.model_dir, misconfig=cfg.misconfig, device=cfg.device,
                             deterministic=cfg.deterministic)
    app = create_app(registry, cfg)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
