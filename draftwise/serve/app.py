"""The OpenAI-compatible HTTP API (FastAPI) over an ``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus). The routes live at module level on ``router`` and find
the engine on ``request.app.state.ctx`` (a ``ServerContext``); ``create_app`` puts them together. With
an API key, the ``/v1`` routes want ``Authorization: Bearer KEY``; /health and /metrics stay open (they
reveal no text).

Every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status; a request never
takes the server down. A client that disconnects (streaming or not) is cancelled in the engine, which
frees its rows before the next step. While the engine drains (SIGTERM, see ``server.py``) every
generation request is answered 503 with ``Retry-After`` and /health says ``draining``.

Responses carry an extension object: ``"draftwise": {"method", "acceptance_rate" (α),
"mean_accepted_length" (τ, bonus token included), "drafted", "accepted"}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DraftwiseError, PromptTooLongError
from ..sampling import SamplingParams
from .engine import Engine, EngineFailure, EngineFullError, EngineStoppedError, ServeSequence
from .metrics import CONTENT_TYPE_LATEST
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("draftwise.serve")

RETRY_AFTER_S = "1"  # a 503's Retry-After (seconds): the queue was full, or this server is shutting down
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there
_TYPE_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\]|[a-z-]+\[.*\])")


@dataclass
class ServerContext:
    """What the routes need, kept on ``app.state.ctx``: the engine, the model id clients send, the API key."""

    engine: Engine
    model_name: str
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def context(request: Request) -> ServerContext:
    return request.app.state.ctx


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Starts the engine thread (the chat template's tokenizer loaded before the first request) and stops
    it at shutdown."""
    engine = app.state.ctx.engine
    loop = asyncio.get_running_loop()
    if engine.tokenizer.has_chat_template:
        await loop.run_in_executor(None, lambda: engine.tokenizer.hf)
    engine.start()
    yield
    await loop.run_in_executor(None, engine.stop)


# ---- auth, draining and containment, around every route (before the body is read) ------------------
def check_key(request: Request) -> None:
    api_key = context(request).api_key
    if api_key is None or not request.url.path.startswith("/v1"):
        return  # /health and /metrics stay open (they reveal no text)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")


def check_admitting(request: Request) -> None:
    """After SIGTERM (``Engine.drain``) generation requests are refused at once, body unread."""
    if request.method == "POST" and context(request).engine.draining:
        raise APIError(503, "the server is shutting down; retry on another replica or after its restart",
                       "server_error", code="shutting_down")


class GuardedRoute(APIRoute):
    """Authenticates and refuses while draining before the body is parsed (bad JSON without a key is a
    401, not a 400), and answers an unexpected exception with a 500 for that request alone. Starlette's
    last-resort handler would re-raise it after responding, and the server would then drop the keep-alive
    connection under the client's next, unrelated request."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                check_key(request)
                check_admitting(request)
                return await handler(request)
            except (APIError, DraftwiseError, RequestValidationError, StarletteHTTPException):
                raise  # answered by the handlers below
            except Exception as e:
                log.exception("unhandled error in %s", request.url.path)
                return _error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))
        return guarded


router = APIRouter(route_class=GuardedRoute)


# ---- errors --------------------------------------------------------------------------------------------
async def on_api_error(request: Request, e: APIError):
    return _error_response(e)


async def on_validation_error(request: Request, e: RequestValidationError):
    return _error_response(validation_error(e))


async def on_http_error(request: Request, e: StarletteHTTPException):
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return _error_response(APIError(e.status_code, str(e.detail), kind))


async def on_draftwise_error(request: Request, e: DraftwiseError):
    return _error_response(APIError(400, str(e)))


async def on_internal_error(request: Request, e: Exception):
    log.exception("unhandled error")
    return _error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))


# ---- routes --------------------------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request):
    ctx = context(request)
    snap = ctx.engine.snapshot()
    if not snap["alive"]:
        return JSONResponse({"status": "error", **snap}, status_code=503)
    if snap["draining"]:  # a load balancer stops sending requests here
        return JSONResponse({"status": "draining", **snap}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
    return {"status": "ok", "model": ctx.model_name, "method": ctx.engine.method, **snap}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(context(request).engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    ctx = context(request)
    engine = ctx.engine
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "draftwise",
        "max_model_len": engine.max_model_len,
        "draftwise": {"methods": list(engine.served_methods), "max_gamma": engine.cfg.gamma}}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = context(request)
    texts = body.prompts()
    if not texts:
        raise APIError(400, "empty prompt: give at least one prompt", param="prompt")
    check_common(ctx, body, len(texts))
    prompts = [check_ids(p, ctx.engine) if isinstance(p, list)
               else await run_in_threadpool(ctx.engine.tokenizer.encode, p) for p in texts]
    return await generate(request, ctx, body, prompts, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = context(request)
    check_common(ctx, body, 1)
    try:
        messages = [m.as_template_message() for m in body.messages]
        ids = await run_in_threadpool(ctx.engine.tokenizer.apply_chat, messages)
    except DraftwiseError as e:
        raise APIError(400, str(e), param="messages") from None
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:  # the template refused them
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
    return await generate(request, ctx, body, [ids], "chat")


def check_common(ctx: ServerContext, body, num_prompts: int) -> None:
    if body.model != ctx.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    for param, message in body.unsupported():
        raise APIError(400, message, param=param)
    total, most = num_prompts * body.n, ctx.engine.rows + ctx.engine.cfg.max_queue
    if total > most:
        raise APIError(400, f"{num_prompts} prompt(s) × n={body.n} = {total} choices; this server holds at "
                            f"most {most} at once", param="n")


# ---- generation ----------------------------------------------------------------------------------------
async def generate(request: Request, ctx: ServerContext, body, prompts: list[list[int]], kind: str):
    """Submit the request's choices and answer as one JSON object or as a server-sent event stream."""
    engine = ctx.engine
    chat = kind == "chat"
    seqs = sequences(engine, body, prompts, chat)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    try:
        engine.submit(rid, seqs, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    except EngineFullError as e:
        raise APIError(503, str(e), "server_error", code="server_overloaded") from None
    except EngineStoppedError as e:
        raise APIError(503, str(e), "server_error", code="shutting_down") from None
    reply = Reply(engine, rid, {"id": rid, "created": int(time.time()), "model": ctx.model_name}, seqs, events,
                  chat, sum(len(p) for p in prompts))
    if body.stream:
        return StreamingResponse(reply.stream(body.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await reply.collect(request)


def sequences(engine: Engine, body, prompts: list[list[int]], chat: bool) -> list[ServeSequence]:
    """One ``ServeSequence`` per choice (``n`` per prompt), its limits checked against the context."""
    opts = body.draftwise
    param = "messages" if chat else "prompt"
    seqs = []
    for p_i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, "empty prompt: give at least one token", param=param)
        room = engine.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server's context is "
                                f"{engine.max_model_len} tokens (--max-model-len)",
                           param=param, code="context_length_exceeded")
        max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) + prompt ({len(ids)} tokens) exceeds the context "
                                f"of {engine.max_model_len} tokens; max_tokens can be at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        for j in range(body.n):
            try:
                params = SamplingParams(
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                    max_tokens=max_tokens, stop=tuple(body.stop), ignore_eos=body.ignore_eos,
                    seed=None if body.seed is None else (body.seed + j) % (1 << 64))  # choice j: seed + j
                seqs.append(engine.new_sequence(ids, params, index=p_i * body.n + j,
                                                method=opts.method if opts else None,
                                                gamma=opts.gamma if opts else None))
            except PromptTooLongError as e:
                raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
            except DraftwiseError as e:
                raise APIError(400, str(e), param="draftwise" if opts else None) from None
    return seqs


@dataclass
class Reply:
    """One submitted request's answer, built from the engine's events: ``collect`` (one JSON object) or
    ``stream`` (server-sent events). Either cancels the request in the engine when the client leaves."""

    engine: Engine
    rid: str
    head: dict  # id, created, model
    seqs: list[ServeSequence]
    events: asyncio.Queue
    chat: bool
    prompt_tokens: int

    async def collect(self, request: Request):
        texts = [""] * len(self.seqs)
        open_ = len(self.seqs)
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL_S
        try:
            while open_:
                # every DISCONNECT_POLL_S, whether or not tokens came meanwhile: a running request's events
                # never leave the queue empty that long, and its client may have gone all the same
                try:
                    ev = await asyncio.wait_for(self.events.get(), max(0.0, check_at - loop.time()))
                except TimeoutError:
                    ev = None
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        self.engine.cancel(self.rid)
                        return Response(status_code=499)
                    check_at = loop.time() + DISCONNECT_POLL_S
                if ev is None:
                    continue
                if isinstance(ev, EngineFailure):
                    raise APIError(500, ev.message, "server_error")
                texts[ev.index] += ev.text
                if ev.finish_reason is not None:
                    open_ -= 1
        except asyncio.CancelledError:
            self.engine.cancel(self.rid)
            raise
        by_index = sorted(self.seqs, key=lambda s: s.index)
        if self.chat:
            choices = [{"index": s.index, "message": {"role": "assistant", "content": texts[s.index]},
                        "finish_reason": s.finish_reason, "logprobs": None} for s in by_index]
        else:
            choices = [{"index": s.index, "text": texts[s.index], "finish_reason": s.finish_reason,
                        "logprobs": None} for s in by_index]
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                "usage": usage(self.prompt_tokens, self.seqs), "draftwise": extension(self.seqs)}

    def chunk(self, index: int, text: str | None, finish: str | None, role: bool = False, ext=None) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
        data = {**self.head, "object": self.object, "choices": [choice]}
        if ext is not None:
            data["draftwise"] = ext
        return sse(data)

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        open_ = len(self.seqs)
        by_index = {s.index: s for s in self.seqs}
        try:
            if self.chat:
                for s in self.seqs:
                    yield self.chunk(s.index, None, None, role=True)
            while open_:
                ev = await self.events.get()
                if isinstance(ev, EngineFailure):
                    yield sse(APIError(500, ev.message, "server_error").body())
                    break
                if ev.finish_reason is None:
                    if ev.text:
                        yield self.chunk(ev.index, ev.text, None)
                    continue
                open_ -= 1
                if ev.text:
                    yield self.chunk(ev.index, ev.text, None)
                yield self.chunk(ev.index, None, ev.finish_reason, ext=extension([by_index[ev.index]]))
            if include_usage and not open_:
                yield sse({**self.head, "object": self.object, "choices": [],
                           "usage": usage(self.prompt_tokens, self.seqs), "draftwise": extension(self.seqs)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the response task is cancelled) or the stream ended
            if open_:
                self.engine.cancel(self.rid)


def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app over ``engine``: the module's routes and error handlers; its lifespan starts the engine
    thread and stops it at shutdown."""
    app = FastAPI(title="draftwise", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ServerContext(engine, model_name, api_key)
    app.include_router(router)
    for exc, handler in ((APIError, on_api_error), (RequestValidationError, on_validation_error),
                         (StarletteHTTPException, on_http_error), (DraftwiseError, on_draftwise_error),
                         (Exception, on_internal_error)):
        app.add_exception_handler(exc, handler)

    def openapi() -> dict:
        """FastAPI's schema, plus what this server accepts for ``model``: its one model name (so that
        clients and schema-driven fuzzers such as schemathesis know the valid value)."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                props = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
                if "model" in props:
                    props["model"]["enum"] = [model_name]
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
    return app


# ---- helpers ---------------------------------------------------------------------------------------
def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, seqs: list[ServeSequence]) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens read from the prefix
    cache, the fewest any choice's prefill read (a later choice may find the blocks an earlier one left)."""
    completion = sum(s.num_output for s in seqs)
    cached = min((s.stats.cached_tokens for s in seqs), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extension(seqs: list[ServeSequence]) -> dict:
    """α and τ over the given choices (τ counts the bonus token; 1.00 for plain decoding)."""
    drafted = sum(s.stats.drafted for s in seqs)
    accepted = sum(s.stats.accepted for s in seqs)
    tokens = sum(s.stats.new_tokens for s in seqs)
    passes = sum(s.stats.target_passes for s in seqs)
    methods = sorted({s.method for s in seqs})
    return {"method": methods[0] if len(methods) == 1 else methods,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_length": round(tokens / passes, 4) if passes else 0.0,
            "drafted": drafted, "accepted": accepted}


def check_ids(ids: list[int], engine: Engine) -> list[int]:
    vocab = engine.dw.target.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return ids


def _error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if e.status == 503 else None  # overloaded or shutting down
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def validation_error(e: RequestValidationError) -> APIError:
    """A pydantic error list → one OpenAI-style error naming the first offending parameter."""
    errs = e.errors()
    if not errs:
        return APIError(400, "invalid request")
    err = errs[0]
    # drop "body" and union-member tags ("str", "list[int]") pydantic puts in the location
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _TYPE_TAG.fullmatch(str(x))]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if err.get("type") == "invalid_text":
        param = err["ctx"]["param"]
        return APIError(400, err["msg"], param=param.split("[")[0].split(".")[0] or None)
    if err.get("type") == "missing" and not loc:
        return APIError(400, "the request needs a JSON body")
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "missing required parameter"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)
