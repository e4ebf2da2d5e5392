"""`latentserve serve`: the FastAPI controller over the ranks (Ray actors, or with
`--distributed-executor-backend mp` one process per rank), under uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..client import SERVER_KEEP_ALIVE_S
from ..engine_config import EngineConfig, engine_kwargs
from ..log import get_logger
from . import admin, completions
from .controller import Controller
from .protocol import APIError

log = get_logger("server")


class ArrivalStamp:
    """Stamps each HTTP request with the time the ASGI app first sees it (`request.state.arrival`),
    before FastAPI reads and validates its body: the first token's `http` part. A plain ASGI
    wrapper, so nothing runs per streamed chunk."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.monotonic()
        await self.app(scope, receive, send)


def create_app(controller: Controller, admin_key: str | None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await controller.start_background()
        yield
        await controller.close()

    app = FastAPI(title="latentserve", lifespan=lifespan)
    app.state.controller = controller
    app.state.admin_key = admin_key
    app.add_middleware(ArrivalStamp)
    app.include_router(completions.router)
    app.include_router(admin.router)

    def count(request: Request, status: int) -> None:
        endpoint = completions.ENDPOINTS.get(request.url.path)
        if endpoint:
            controller.metrics.requests.labels(endpoint, str(status)).inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        count(request, e.status)
        # The openai client retries 409/5xx by default; only a transition in progress is worth it.
        headers = {"x-should-retry": "true" if e.retry else "false"}
        if e.retry:
            headers["retry-after"] = "1"
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        count(request, 422)
        body = APIError(422, msg, param=where or None, code="invalid_parameter").body()
        return JSONResponse(body, status_code=422, headers={"x-should-retry": "false"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        # The framework's own answers (unknown path, wrong method, a body that is not JSON) in
        # OpenAI's error shape like every other error.
        count(request, e.status_code)
        codes = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}
        body = APIError(e.status_code, str(e.detail), code=codes.get(e.status_code, "http_error")).body()
        headers = {**(e.headers or {}), "x-should-retry": "false"}
        return JSONResponse(body, status_code=e.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        count(request, 500)
        log.error("unhandled", path=request.url.path, error=f"{type(e).__name__}: {e}", exc_info=True)
        body = APIError(500, f"{type(e).__name__}: {e}", code="internal_error").body()
        return JSONResponse(body, status_code=500, headers={"x-should-retry": "false"})

    @app.get("/health")
    async def health():
        ok, body = controller.health_report()
        if not ok:  # the status report, plus the error shape every other error answer has
            body["error"] = APIError(503, body.get("reason") or "unhealthy", code="unhealthy").body()["error"]
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(controller.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    backend = getattr(args, "distributed_executor_backend", "ray")
    config = EngineConfig(**engine_kwargs(args)).resolve()
    controller = Controller(config, model_name=args.served_model_name or args.model,
                            enable_test_hooks=args.enable_test_hooks, deadline_s=args.rank_deadline_s,
                            request_timeout_s=args.request_timeout_s, weight_snapshot=args.weight_snapshot, backend=backend,
                            stream_interval=args.stream_interval)
    if not args.admin_key:
        log.warning("admin_api_off", reason="no --admin-key or LATENTSERVE_ADMIN_KEY: /sleep, /wake_up and "
                                            "the other admin routes answer 403")
    if args.enable_test_hooks:
        log.warning("test_hooks_on", note="state-changing collective_rpc hooks are allowed; never in production")
    t0 = time.perf_counter()
    try:
        controller.load()
        app = create_app(controller, args.admin_key)
        log.info("listening", url=f"http://{args.host}:{args.port}", startup_seconds=round(time.perf_counter() - t0, 1))
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                    timeout_keep_alive=SERVER_KEEP_ALIVE_S)
    finally:
        ray = sys.modules.get("ray")  # imported only by the Ray backend
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    return 0
