"""The gateway's FastAPI app: OpenAI-compatible completions and chat completions, models, health,
readiness, metrics and the worker list.

``create_app(config)`` builds the app (it loads the tokenizer; nothing connects until a request);
``serve(config)`` runs it under uvicorn until cancelled or signalled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.common.metrics import RegistryRejectsCollector
from baton.services.gateway import openapi
from baton.services.gateway.admission import Admission, AdmissionMiddleware
from baton.services.gateway.auth import APIKeyMiddleware
from baton.services.gateway.body import BodyLimitMiddleware, StrictJSONRoute
from baton.services.gateway.dispatch import Dispatcher, SubRequest, fan_out
from baton.services.gateway.errors import (
    APIError,
    bad_request,
    model_not_found,
    unavailable,
    validation_error,
)
from baton.services.gateway.metrics import GatewayMetrics
from baton.services.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_ids,
    check_text,
)
from baton.services.gateway.readiness import Readiness
from baton.services.gateway.responses import ChatBuilder, CompletionBuilder, ResponseBuilder, TokenText
from baton.services.gateway.router import Router
from baton.services.gateway.streaming import ClientGone, SSEResponse, collect, events, unless_disconnected
from baton.services.gateway.tools import template_messages
from baton.services.grpc_tls import PLAINTEXT, GrpcTLS

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_CLOSED_REQUEST = 499
"""The status logged for a client that left before its response (nginx's convention)."""
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_ENDPOINTS = frozenset([*GENERATION_PATHS, "/v1/models", "/health", "/ready", "/metrics", "/workers"])


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    """Address uvicorn binds."""
    port: int = 8000
    """HTTP port."""
    model: str | None = None
    """A .gguf file or a Llama safetensors directory (for the tokenizer and the registry's key
    space); None is the default SmolLM2 GGUF."""
    served_model_name: str | None = None
    """The name clients send as ``model``; None is the model's own name (``SmolLM2-135M-Instruct``)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """The Redis that holds the worker registry."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """Only worker records signed with it are routed to (``common/index/record_mac.py``); None:
    every record is trusted."""
    expect_prefill: int = 0
    """``/ready`` waits for this many prefill workers in the router's list (``baton up`` sets its
    pool's size), so that the first requests are prefilled where they are meant to be."""
    request_timeout_s: float = 600.0
    """Deadline of one decode request on its worker."""
    registry_refresh_s: float = 0.5
    """How long the router reuses the decode worker list it read from Redis."""
    block_size: int = 16
    """The workers' KV block size: prompts are hashed in blocks of it for prefix-aware routing."""
    prefix_index_max_entries: int = 1_000_000
    """Bound of the model's prefix index (the workers use the same)."""
    prefix_lookup_timeout_s: float = 0.5
    """Bound of a prefix-index lookup in a request's path: past it the request is routed on load
    alone (a slow Redis costs a routing hint, not latency)."""
    max_migrations: int = 3
    """Times one decode request may resume on another decode worker after its own fails."""
    stream_progress_timeout_s: float = 10.0
    """A started stream with no chunk for this long is taken as a hung worker and migrated."""
    max_choices: int = 128
    """Most choices (prompts x ``n``) one request may ask for."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Keys clients send as ``Authorization: Bearer <key>`` on /v1/* and /workers; none: no check."""
    max_concurrent_requests: int = 512
    """Generation requests in flight at once (a stream until it ends); past it, 429. Twice one
    decode worker's default batch (256 sequences): two full workers' worth, or one with as many
    again queued; memory stays bounded by this x ``max_body_bytes`` of bodies."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body; past it, 413. A 128k-token prompt is ~0.9 MB as token ids in JSON,
    ~0.5 MB as English text, ~3 MB as fully escaped non-ASCII text."""
    log_level: str = "info"
    """uvicorn's log level."""
    grpc_tls: GrpcTLS = PLAINTEXT
    """TLS of the gateway's channels to the decode workers (``services/grpc_tls.py``)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long open requests and streams get to finish (uvicorn's graceful shutdown)."""


class Gateway:
    """What the routes share: the tokenizer, the router, the dispatcher and the metrics."""

    def __init__(self, config: GatewayConfig, tokenizer, registry_model: str, router: Router) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.registry_model = registry_model
        self.served_model = config.served_model_name or registry_model
        self.router = router
        self.metrics = GatewayMetrics(self.served_model)
        self.dispatcher = Dispatcher(
            router,
            self.metrics,
            config.request_timeout_s,
            max_migrations=config.max_migrations,
            progress_timeout_s=config.stream_progress_timeout_s,
        )
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self._warm_tokenizer()

    def _warm_tokenizer(self) -> None:
        """Compile the chat template (jinja, ~6 ms on first use) and run the tokenizer once at
        start, so that the first request after ``/ready`` pays neither."""
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - a tokenizer without a chat template serves completions
            text = "Hi"
        self.tokenizer.encode(text, add_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model:
            raise model_not_found(model)

    def check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.config.max_choices:
            raise bad_request(f"at most {self.config.max_choices} choices (prompts x n) per request", "n")

    async def encode_prompts(self, prompt: str | list) -> list[list[int]]:
        """A completion request's prompt(s) as token ids: a string, token ids, or a list of either."""
        items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not items:
            items = [[]]
        ids = [await self._encode(p) if isinstance(p, str) else list(p) for p in items]
        for one in ids:
            check_prompt_ids(one, "prompt")
        return ids

    async def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template applied and encoded exactly as ``LLM.chat`` does."""
        extras = [m.model_extra or {} for m in body.messages]
        messages = template_messages([m.for_template() for m in body.messages], extras, body.tool_mode())
        try:
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template, messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        ids = await self._encode(text, "messages")
        check_prompt_ids(ids, "messages")
        return ids

    async def _encode(self, text: str, param: str = "prompt") -> list[int]:
        check_text(text, param)
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - the tokenizer is deterministic: this input is the cause
            raise bad_request(f"the tokenizer rejected the {param}: {e}", param=param) from None

    async def respond(
        self,
        request: Request,
        builder: ResponseBuilder,
        subs: list[SubRequest],
        arrival: float,
        stream: bool,
        prompt_param: str,
        spec_param: str | None = None,
    ) -> Response:
        chunks = self.dispatcher.merged(subs, arrival, prompt_param, spec_param)
        try:
            if not stream:
                await unless_disconnected(request, collect(builder, chunks))
                return JSONResponse(builder.response())
            # The first chunk is awaited before the headers go out, so that a request the worker
            # rejects (a prompt too long, no worker) is a 4xx/5xx, not a 200 with an error event.
            first = await unless_disconnected(request, anext(chunks, None))
        except ClientGone:
            await chunks.aclose()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            await chunks.aclose()
            raise
        return SSEResponse(
            events(builder, first, chunks, self.metrics.chunk_written),
            cleanup=chunks.aclose,
            headers={"Cache-Control": "no-cache"},
        )


class RequestIdMiddleware:
    """Takes the client's ``X-Request-Id`` or makes one, exposes it as ``request.state.request_id``
    (and ``request.state.worker_request_id``, the base of the ids the workers see),
    returns it on every response, and counts responses by endpoint and status."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.lower().encode(), b"").decode("latin-1")
        valid = 0 < len(given) <= 128 and given.isprintable()
        request_id = given if valid else uuid.uuid4().hex
        # Two requests with one id would collide on a worker (the second is refused, and its abort
        # would end the first), so a client's id gets a random suffix there; ours are unique.
        worker_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if valid else request_id
        scope.setdefault("state", {}).update(request_id=request_id, worker_request_id=worker_id)
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"

        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
                self.metrics.http_requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:  # a stream already under way: nothing can be sent in its place
                raise
            # Answered here rather than by Starlette's outermost handler, so that the 500 has the
            # OpenAI shape, the request id the operator greps the log for, and its count.
            log.exception("unhandled error (request %s)", request_id)
            response = APIError(500, "internal error", type="server_error").response()
            await response(scope, receive, send_with_id)


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway app. Loads the tokenizer; Redis and the workers are reached on first use."""
    from baton.common.index.client import connect
    from baton.common.index.prefix_index import PrefixIndex
    from baton.common.index.registry import WorkerRegistry
    from baton.common.model.source import ModelSource, load_tokenizer

    source = ModelSource.resolve(config.model)
    # Every call bounded (common/index/client.py): the router reads in the background and keeps its
    # last workers while Redis is away.
    client = connect(config.redis_url)
    # The TTL only matters to writers; the gateway reads.
    index = PrefixIndex(client, source.name, max_entries=config.prefix_index_max_entries)
    registry = WorkerRegistry(client, source.name, ttl_s=6.0, secret=config.cluster_secret)
    router = Router(
        registry,
        config.registry_refresh_s,
        prefix_index=index,
        block_size=config.block_size,
        lookup_timeout_s=config.prefix_lookup_timeout_s,
        tls=config.grpc_tls,
    )
    gw = Gateway(config, load_tokenizer(source), source.name, router)
    rejects = RegistryRejectsCollector(lambda: registry.num_rejected, {"model_name": gw.served_model})
    gw.metrics.registry.register(rejects)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await router.close()
        await asyncio.to_thread(client.close)

    app = FastAPI(title="Baton gateway", lifespan=lifespan)
    app.state.gateway = gw
    app.router.route_class = StrictJSONRoute
    _add_front_door(app, config, gw.metrics)
    _add_error_handlers(app)
    _add_generation_routes(app, gw)
    _add_service_routes(app, gw)
    openapi.install(app, api_keys=bool(config.api_keys))
    return app


def _add_front_door(app: FastAPI, config: GatewayConfig, metrics: GatewayMetrics) -> None:
    """What runs before a route, outermost first: the request id (so every answer carries one and
    is counted), the API key, admission, the body limit. A request without a valid key takes no
    slot, and one that is not admitted is not read."""
    admission = Admission(config.max_concurrent_requests, on_change=metrics.admitted.set)
    app.state.admission = admission
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, on_reject=metrics.rejection("body_too_large")
    )
    app.add_middleware(
        AdmissionMiddleware,
        admission=admission,
        paths=GENERATION_PATHS,
        on_reject=metrics.rejection("concurrency"),
    )
    if config.api_keys:
        app.add_middleware(
            APIKeyMiddleware, keys=config.api_keys, on_reject=metrics.rejection("unauthorized")
        )
    app.add_middleware(RequestIdMiddleware, metrics=metrics)


def _add_error_handlers(app: FastAPI) -> None:
    def error(request: Request, e: APIError) -> Response:
        if e.status >= 500:  # not the client's doing: the operator needs to see it
            log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return e.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return error(request, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return error(request, validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error(request, APIError(e.status_code, str(e.detail), type=kind, headers=e.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}", type="server_error").response()


def _add_generation_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/v1/completions", response_model=None, responses=openapi.GENERATION)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        gw.check_model(body.model)
        body.check_supported()
        params = body.sampling_params()
        prompts = await gw.encode_prompts(body.prompt)
        gw.check_choices(len(prompts), params.n)
        request_id = request.state.request_id
        subs = fan_out(request.state.worker_request_id, prompts, params)
        builder = CompletionBuilder(
            request_id,
            gw.served_model,
            subs,
            gw.token_text,
            body.logprobs is not None,
            body.include_usage,
            body.return_token_ids,
        )
        return await gw.respond(
            request, builder, subs, arrival, body.stream, "prompt", body.constraint_field()
        )

    @app.post("/v1/chat/completions", response_model=None, responses=openapi.CHAT)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        gw.check_model(body.model)
        params = body.sampling_params()
        gw.check_choices(1, params.n)
        ids = await gw.encode_chat(body)
        request_id = request.state.request_id
        subs = fan_out(request.state.worker_request_id, [ids], params)
        builder = ChatBuilder(
            request_id,
            gw.served_model,
            subs,
            gw.token_text,
            body.logprobs,
            body.include_usage,
            body.return_token_ids,
            tools=body.tool_mode(),
        )
        return await gw.respond(
            request, builder, subs, arrival, body.stream, "messages", body.constraint_field()
        )


def _add_service_routes(app: FastAPI, gw: Gateway) -> None:
    def model_card() -> dict:
        return {"id": gw.served_model, "object": "model", "created": gw.created, "owned_by": "baton"}

    @app.get("/v1/models", response_model=None, responses=openapi.doc(openapi.ModelList, openapi.MODELS))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get(
        "/v1/models/{model:path}",
        response_model=None,
        responses=openapi.doc(openapi.ModelCard, openapi.MODEL),
    )
    async def model(model: str) -> dict:
        gw.check_model(model)
        return model_card()

    @app.get("/health", response_model=None, responses=openapi.doc(openapi.Health, openapi.OPEN))
    async def health() -> dict:
        return {"status": "ok"}

    readiness = Readiness(gw.router, expect_prefill=gw.config.expect_prefill)

    @app.get("/ready", response_model=None, responses=openapi.doc(openapi.Readiness, openapi.READY))
    async def ready() -> JSONResponse:
        # Ready while a decode worker the router knows answers its health check, Redis or not (and
        # once the prefill workers expected are known).
        state = await readiness.check()
        return JSONResponse(state.body(), status_code=200 if state.ready else 503)

    @app.get("/metrics", response_model=None, responses=openapi.METRICS)
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers", response_model=None, responses=openapi.doc(openapi.WorkerList, openapi.WORKERS))
    async def workers() -> dict:
        try:
            found = await gw.router.list_workers()
        except Exception as e:  # noqa: BLE001 - Redis down: say so in the API's shape
            raise unavailable(
                f"the worker registry is unreachable: {e}", code="registry_unavailable"
            ) from None
        return {"workers": [w.to_dict() for w in found]}


def make_server(config: GatewayConfig) -> uvicorn.Server:
    """A uvicorn server around ``create_app(config)``; ``serve()`` runs it, tests drive it directly."""
    app = create_app(config)
    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            lifespan="on",
            timeout_graceful_shutdown=config.drain_timeout_s,
        )
    )


async def serve(config: GatewayConfig) -> None:
    """Run the gateway until SIGINT/SIGTERM (uvicorn's handlers) or cancellation."""
    await make_server(config).serve()
