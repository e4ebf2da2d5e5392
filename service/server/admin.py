"""Admin routes (Bearer admin key): sleep / wake_up / pause / resume / update_weights, status,
collective_rpc diagnostics and restart. Without a configured key they answer 403."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request

from ..cluster.worker_rpc import DIAGNOSTICS
from ..lifecycle import CoordinationError
from .controller import Controller
from .protocol import APIError


def require_admin(request: Request) -> None:
    key = request.app.state.admin_key
    if not key:
        raise APIError(403, "the admin API is off: start the server with --admin-key KEY (or set "
                            "LATENTSERVE_ADMIN_KEY)", code="admin_disabled")
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "admin calls need 'Authorization: Bearer <admin key>'", code="invalid_admin_key")


router = APIRouter(dependencies=[Depends(require_admin)])
Mode = Literal["abort", "wait", "keep"]  # what a pause or sleep does with the requests in flight
MAX_TIMEOUT_S = 86400.0  # a day: longer waits overflow the clocks they end up in (and nobody means them)

# Bodies these routes read themselves (any content type, see _json_object); published so the
# schema (and clients generated from it, and the fuzzer) know them.
_TENSOR_META = {"type": "object", "required": ["name", "shape", "dtype"], "properties": {
    "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "dtype": {"type": "string", "enum": ["float32", "bfloat16", "float16"]}}}
UPDATE_WEIGHTS_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "minProperties": 1, "maxProperties": 1,
    "description": "exactly one weight source (docs/rlhf.md)",
    "properties": {
        "path": {"type": "string", "description": "a checkpoint directory on the server"},
        "group": {"type": "object", "required": ["port", "tensors"], "properties": {
            "host": {"type": "string"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "tensors": {"type": "array", "minItems": 1, "items": _TENSOR_META},
            "bucket_bytes": {"type": "integer", "minimum": 1}, "backend": {"type": "string", "enum": ["gloo", "nccl"]},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0}}},
        "refs": {"type": "object", "required": ["token"], "properties": {"token": {"type": "string"}}}}}}}}
COLLECTIVE_RPC_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["method"], "properties": {
        "method": {"type": "string", "enum": list(DIAGNOSTICS),
                   "description": "a read-only diagnostic (test hooks too with --enable-test-hooks)"},
        "args": {"type": "array"}, "ranks": {"type": "array", "items": {"type": "integer"}},
        "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}}}}}}


def _ctl(request: Request) -> Controller:
    return request.app.state.controller


async def _json_object(request: Request) -> dict:
    """The JSON body whatever the content type says (curl -d sends a form type)."""
    try:
        body = await request.json()
    except ValueError as e:
        raise APIError(422, f"the body must be a JSON object: {e}") from e
    if not isinstance(body, dict):
        raise APIError(422, "the body must be a JSON object")
    return body


async def _transition(ctl: Controller, op: str, fn, *args) -> dict:
    """Run a blocking coordinator transition in a thread; time it; map its errors to HTTP."""
    if ctl.restarting and op != "restart":
        raise APIError(503, "the ranks are restarting; retry shortly", retry=True)
    t0 = time.perf_counter()
    try:
        result = await asyncio.to_thread(fn, *args)
    except CoordinationError as e:
        ctl.metrics.transition_seconds.labels(op, str(e.status)).observe(time.perf_counter() - t0)
        extra = {"ranks": e.ranks} if e.ranks is not None else None
        raise APIError(e.status, str(e), code=f"{op}_failed", extra=extra, retry=e.retry) from e
    seconds = time.perf_counter() - t0
    ctl.metrics.transition_seconds.labels(op, "ok").observe(seconds)
    result.update(ctl.coordinator.snapshot())  # the state after the transition, not during it
    result["http_seconds"] = seconds
    return result


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1, ge=0, le=2), mode: Mode = Query("abort"),
                timeout: float | None = Query(None, gt=0, le=MAX_TIMEOUT_S)) -> dict:
    ctl = _ctl(request)
    return await _transition(ctl, "sleep", ctl.coordinator.sleep, level, mode, timeout)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[Literal["weights", "kv_cache"]] | None = Query(None),
                  timeout: float | None = Query(None, gt=0, le=MAX_TIMEOUT_S)) -> dict:
    ctl = _ctl(request)
    return await _transition(ctl, "wake_up", ctl.coordinator.wake_up, tags, timeout)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return _ctl(request).coordinator.is_sleeping()


@router.post("/pause")
async def pause(request: Request, mode: Mode = Query("keep"),
                timeout: float | None = Query(None, gt=0, le=MAX_TIMEOUT_S)) -> dict:
    ctl = _ctl(request)
    return await _transition(ctl, "pause", ctl.coordinator.pause, mode, timeout)


@router.post("/resume")
async def resume(request: Request) -> dict:
    ctl = _ctl(request)
    return await _transition(ctl, "resume", ctl.coordinator.resume)


@router.post("/update_weights", openapi_extra={"requestBody": UPDATE_WEIGHTS_BODY})
async def update_weights(request: Request, timeout: float | None = Query(None, gt=0, le=MAX_TIMEOUT_S)) -> dict:
    """The body names one weight source: {"path": DIR} here; other transports register their key."""
    ctl = _ctl(request)
    body = await _json_object(request)
    return await _transition(ctl, "update_weights", ctl.coordinator.update_weights, body, timeout)


@router.get("/v1/status")
async def status(request: Request) -> dict:
    ctl = _ctl(request)
    if ctl.restarting:
        raise APIError(503, "the ranks are restarting; retry shortly", retry=True)
    return await asyncio.to_thread(ctl.status)


@router.post("/collective_rpc", openapi_extra={"requestBody": COLLECTIVE_RPC_BODY})
async def collective_rpc(request: Request) -> dict:
    ctl = _ctl(request)
    body = await _json_object(request)
    method = body.get("method")
    args, kwargs, timeout = body.get("args") or [], body.get("kwargs") or {}, body.get("timeout")
    ranks = body.get("ranks")
    if not isinstance(method, str) or not isinstance(args, list) or not isinstance(kwargs, dict) or \
            not (ranks is None or isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)):
        raise APIError(422, "body: {'method': str, 'args': list?, 'ranks': [int]?, 'timeout': seconds?}",
                       param="method")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout <= MAX_TIMEOUT_S):
        raise APIError(422, f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]", param="timeout")
    if ctl.restarting:
        raise APIError(503, "the ranks are restarting; retry shortly", retry=True)
    outcomes = await asyncio.to_thread(ctl.collective_rpc, method, args, kwargs, timeout, ranks)
    if not all(o["ok"] for o in outcomes):
        status = 504 if any(o.get("timeout") for o in outcomes) else 500
        errors = "; ".join(o["error"] for o in outcomes if not o["ok"])
        raise APIError(status, f"collective_rpc({method}) failed: {errors}", extra={"ranks": outcomes})
    return {"method": method, "results": [o["result"] for o in outcomes if not o.get("skipped")]}


@router.post("/restart")
async def restart(request: Request) -> dict:
    ctl = _ctl(request)
    return await _transition(ctl, "restart", ctl.restart)
