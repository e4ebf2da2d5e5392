"""OpenAI wire format: request models, error bodies, and the responses built from engine outputs.

Requests are validated in two layers: pydantic checks types (FastAPI answers 422), then
`to_sampling_params` lets `SamplingParams.validate` check ranges (also 422), so a bad value
gets the same message from the HTTP API as from the offline LLM.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import InvalidRequest, SamplingParams

# OpenAI's error `type` per status; clients switch on the status, people read the type.
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "conflict_error", 422: "invalid_request_error",
    500: "internal_error", 501: "not_implemented_error", 503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answer: status, message and the OpenAI-style body that carries them."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 extra: dict | None = None, retry: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}
        self.retry = retry  # worth retrying (a transition in progress), tells the openai client so

    def body(self) -> dict:
        err = {"message": self.message, "type": _ERROR_TYPES.get(self.status, "error"),
               "param": self.param, "code": self.code}
        return {"error": err, **self.extra}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat, plus vLLM's extensions (top_k, ignore_eos, ...)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extensions
    repetition_penalty: float | None = None  # vLLM's; `vllm bench serve` always sends 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _common(self) -> dict:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(422, f"{name} is not supported", param=name, code="unsupported_parameter")
        if self.repetition_penalty not in (None, 1.0):
            raise APIError(422, "repetition_penalty other than 1.0 is not supported", param="repetition_penalty",
                           code="unsupported_parameter")
        return dict(n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, seed=self.seed,
                    stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                    skip_special_tokens=self.skip_special_tokens,
                    include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """(text, token ids) per prompt: a string, a list of strings, token ids, or lists of them."""
        p = self.prompt
        if isinstance(p, str):
            return [(p, None)]
        if not p:
            raise APIError(422, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]
        if all(isinstance(x, str) for x in p):
            return [(x, None) for x in p]
        if any(not x for x in p):
            raise APIError(422, "a token-id prompt must not be empty", param="prompt")
        return [(None, list(x)) for x in p]

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise APIError(422, "echo is not supported", param="echo", code="unsupported_parameter")
        if self.best_of not in (None, self.n):
            raise APIError(422, "best_of is not supported", param="best_of", code="unsupported_parameter")
        return _build(self._common(), max_tokens=self.max_tokens, logprobs=self.logprobs)


# OpenAI and vLLM spellings of image, video and audio parts.
_MEDIA_PARTS = ("image_url", "input_image", "image", "image_embeds", "video_url", "video", "input_audio", "audio_url")


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") in _MEDIA_PARTS:
                raise APIError(400, f"{part.get('type')!r} content is not supported: this service serves the text "
                               "model only (Kimi-K3's vision tower is not loaded)", param="messages")
            if part.get("type") != "text":
                raise APIError(422, f"only text content parts are supported, got {part.get('type')!r}",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def template_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(422, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return _build(self._common(), max_tokens=self.max_completion_tokens or self.max_tokens,
                      logprobs=logprobs)


def _build(common: dict, **kw) -> SamplingParams:
    try:
        return SamplingParams(**common, **kw)
    except InvalidRequest as e:
        raise APIError(422, str(e), code="invalid_parameter") from e


# ---- responses -----------------------------------------------------------------
TokenText = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(c: CompletionOutput, start: int, token_text: TokenText, offset: int = 0) -> dict | None:
    """The legacy completions format for tokens [start:], text offsets counted from `offset`."""
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
        s = token_text(tid)
        tokens.append(s)
        token_lps.append(lps.get(tid))
        tops.append({token_text(t): lp for t, lp in sorted(lps.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, start: int, token_text: TokenText, top_n: int) -> dict | None:
    if c.logprobs is None:
        return None

    def entry(tid: int, lp: float) -> dict:
        s = token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(tid, lps.get(tid)), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def completion_response(rid: str, model: str, outs: list[RequestOutput], token_text: TokenText) -> dict:
    choices = []
    for p, out in enumerate(outs):
        n = len(out.outputs)
        for c in sorted(out.outputs, key=lambda c: c.index):
            choices.append({"index": p * n + c.index, "text": c.text or "",
                            "logprobs": completion_logprobs(c, 0, token_text),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "token_ids": c.token_ids})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs), "weight_version": _version(outs)}


def chat_response(rid: str, model: str, out: RequestOutput, token_text: TokenText, top_n: int) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text or ""},
                "logprobs": chat_logprobs(c, 0, token_text, top_n), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "token_ids": c.token_ids}
               for c in sorted(out.outputs, key=lambda c: c.index)]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out]), "weight_version": out.weight_version}


def _version(outs: list[RequestOutput]) -> int:
    # One HTTP request may span a weight update only in keep mode; report the newest.
    return max((o.weight_version for o in outs), default=0)

