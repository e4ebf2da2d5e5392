"""The engine loop on TP rank 0: requests in, step plans to the executor, tokens and text out.

The engine never sees the model. Each `step()` asks the scheduler for a `StepPlan`, hands it to
`execute(plan) -> fp32 logits [rows with needs_logits, vocab]` (the worker broadcasts it to the
other ranks and runs the model), samples, detokenizes, applies the stop rules and reports every
request that progressed with its cumulative output.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import InvalidRequest, SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .block_manager import BlockManager
from .plan import StepPlan
from .sampler import Sampler, SamplerOutput
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus, make_generator

log = logging.getLogger(__name__)

NO_TOKENIZER_NOTE = "no tokenizer for this model: outputs carry token ids only (text is None)"


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    error: str | None = None

    @property
    def finished(self) -> bool:
        for seq in self.seqs:
            if not seq.is_finished:
                return False
        return True


class LLMEngine:
    def __init__(self, execute: Callable[[StepPlan], torch.Tensor], tokenizer: Tokenizer | None, *,
                 block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_id: int | None = None, vocab_size: int | None = None) -> None:
        self.execute = execute
        self.tokenizer = tokenizer
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        if vocab_size is None and tokenizer is not None:
            vocab_size = tokenizer.vocab_size
        self.eos_token_id = eos_token_id
        # Prompt ids are checked against this; the worker passes the model's own vocab_size.
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        self.sampler = Sampler()
        self.weight_version = 0  # set by the worker after a weight update; tags every output
        self._requests: dict[str, _Request] = {}
        # New requests wait here, under their own short lock, until the next step admits them:
        # add_request must not wait for a running step (which holds _lock through the model's
        # forward and the wait for its logits). Behind the step lock, the H200's HTTP clients'
        # adds and the output polls queued for whole steps: TTFT p50 2.6 s at 64 streams, 11.8 s
        # at 256, with tokens reaching the streams in bursts (bench/RESULTS.md, 2026-12-03).
        self._inbox: dict[str, _Request] = {}
        self._inbox_lock = threading.Lock()
        self._pending: list[RequestOutput] = []  # reported at the next step (aborts, foreign outputs)
        self._seq_ids = itertools.count()
        self._gen_ids = itertools.count()
        self._lock = threading.RLock()
        self.num_steps = 0
        self.num_failed_steps = 0
        # Where a step's wall time goes, summed: scheduling, launching the model (asynchronous on
        # a GPU), waiting for its logits and sampling, and the outputs. On the H200 a decode
        # step's graph takes 5 ms; these say what the rest of a served step costs.
        self.step_seconds = dict.fromkeys(("schedule", "execute", "sample", "postprocess"), 0.0)
        self.step_kinds = dict.fromkeys(("decode", "prefill", "mixed"), 0)
        # Execute seconds by step kind, summed and the longest: a mean over all steps hid that
        # served prefill and mixed steps each took ~0.4 s on the H200 (bench/RESULTS.md, run 20).
        self.execute_by_kind = {k: [0.0, 0.0] for k in self.step_kinds}
        # request id -> whether anyone reads its outputs before it finishes (a stream); None: all.
        # The engine loop's blocking generate() waits for final outputs only, so per-step
        # RequestOutputs of its requests (token lists copied every step) are not built.
        self.wants_progress: Callable[[str], bool] | None = None
        # Progress outputs (not final ones) as deltas since the last (RequestOutput.delta): the
        # engine loop turns this on for the HTTP controller, which rebuilds whole outputs.
        self.progress_deltas = False
        if tokenizer is None:
            log.warning(NO_TOKENIZER_NOTE)

    # ---- requests -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams) -> None:
        """Validate and queue a request (InvalidRequest says why not); the next step admits it.
        Never waits for a running step."""
        ids = self._validate(request_id, prompt, prompt_token_ids, params)
        seqs = []
        for index in range(params.n):
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=index,
                           prompt_token_ids=list(ids), params=params,
                           generator=make_generator(params.seed, index),
                           logprobs=[] if params.logprobs is not None else None)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seqs.append(seq)
        with self._inbox_lock:
            if request_id in self._requests or request_id in self._inbox:
                raise InvalidRequest(f"request_id {request_id!r} is already in use")
            self._inbox[request_id] = _Request(request_id, prompt, list(ids), params, seqs)

    def _admit(self) -> None:
        """Queued requests into the scheduler (under _lock). Under the inbox lock throughout, so
        a request id is always in one of the two maps for add_request's check."""
        with self._inbox_lock:
            for rid, req in self._inbox.items():
                self._requests[rid] = req
                for seq in req.seqs:
                    self.scheduler.add(seq)
            self._inbox = {}

    def abort_request(self, request_id: str, reason: str | None = None) -> bool:
        """Stop a request; its final output (finish_reason "abort", `reason` in its error field)
        comes with the next step() or drain_outputs()."""
        with self._lock:
            self._admit()
            req = self._requests.pop(request_id, None)
            if req is None:
                return False
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            req.error = reason
            self._pending.append(self._output(req))
            return True

    def abort_all(self, reason: str | None = None) -> list[str]:
        """Abort every unfinished request; returns their ids."""
        with self._lock:
            self._admit()
            ids = list(self._requests)
            for rid in ids:
                self.abort_request(rid, reason)
            return ids

    def preempt_all(self) -> int:
        """Drop the KV of every running sequence (the cache is about to sleep); requests stay and
        are recomputed after wake with the same tokens. Returns how many sequences moved."""
        with self._lock:
            return self.scheduler.preempt_all()

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside step() (aborts) that no step has reported yet."""
        with self._lock:
            outputs, self._pending = self._pending, []
            return outputs

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests or self._pending or self._inbox)

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._requests) + len(self._inbox)

    # ---- the loop -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock:
            outputs, self._pending = self._pending, []
            t0 = time.perf_counter()
            self._admit()
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            self.num_steps += 1
            decodes = sum(len(c.token_ids) == 1 for c in batch.plan.chunks)
            kind = "decode" if decodes == len(batch.plan.chunks) else "prefill" if not decodes else "mixed"
            self.step_kinds[kind] += 1
            self.step_seconds["schedule"] += time.perf_counter() - t0
            try:
                sampled, nan_rows = self._run(batch, kind)
            except Exception as exc:  # any executor failure ends the running requests, not the engine
                self.num_failed_steps += 1
                log.error("model execution failed", exc_info=exc)
                running = dict.fromkeys(s.request_id for s in self.scheduler.running)
                return outputs + self._fail(running, f"model execution failed: {type(exc).__name__}: {exc}")
            t0 = time.perf_counter()
            touched: dict[str, _Request] = {}
            poisoned: dict[str, None] = {}
            rows = self.scheduler.postprocess(batch, sampled.token_ids)
            requests = self._requests
            for i, (seq, token, logprobs) in enumerate(zip(rows, sampled.token_ids, sampled.logprobs)):
                if nan_rows and i in nan_rows:
                    seq.output_token_ids.pop()  # sampled from NaN: not a token of this request
                    poisoned[seq.request_id] = None
                    continue
                if seq.logprobs is not None:
                    seq.logprobs.append(logprobs)
                self._after_token(seq, token)
                rid = seq.request_id
                if rid not in touched:
                    touched[rid] = requests[rid]
            if poisoned:
                # Garbage in the model (stale memory, weights not loaded): say so, emit no token.
                outputs += self._fail(poisoned, "the model returned NaN logits (weights or KV cache not valid?)")
            wants = self.wants_progress
            for req in touched.values():
                if req.request_id in poisoned:
                    continue
                finished = req.finished
                if finished or wants is None or wants(req.request_id):
                    outputs.append(self._output(req, finished))
                if finished:
                    del self._requests[req.request_id]
            self.step_seconds["postprocess"] += time.perf_counter() - t0
            return outputs

    def generate(self, requests: Iterable[str | list[int] | tuple[str | list[int], SamplingParams]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Offline convenience: run until the given requests finish; final outputs in input order.

        Each item is a text prompt, a list of token ids, or (prompt, SamplingParams); `params`
        (default: SamplingParams()) applies to bare prompts. Outputs of other requests met on the
        way are kept for the next step().
        """
        with self._lock:
            ids: list[str] = []
            try:
                for item in requests:
                    prompt, item_params = item if isinstance(item, tuple) else (item, params or SamplingParams())
                    rid = f"generate-{next(self._gen_ids)}"
                    text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
                    self.add_request(rid, text, token_ids, item_params)
                    ids.append(rid)
            except InvalidRequest:
                for rid in ids:  # all or nothing
                    self._drop(rid)
                raise
            wanted, final = set(ids), {}
            while len(final) < len(ids):
                for out in self.step():
                    if out.request_id not in wanted:
                        self._pending.append(out)
                    elif out.finished:
                        final[out.request_id] = out
            return [final[rid] for rid in ids]

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + len(self._inbox),
                "requests": len(self._requests) + len(self._inbox),
                "free_blocks": self.block_manager.num_free_blocks,
                "num_blocks": self.block_manager.num_blocks,
                "block_size": self.block_manager.block_size,
                "preemptions": self.scheduler.num_preemptions,
                "steps": self.num_steps,
                "failed_steps": self.num_failed_steps,
                "step_kinds": dict(self.step_kinds),
                "step_seconds": {k: round(v, 6) for k, v in self.step_seconds.items()},
                "execute_seconds_by_kind": {k: {"total": round(t, 6), "max": round(m, 6)}
                                            for k, (t, m) in self.execute_by_kind.items()},
                "weight_version": self.weight_version,
                "tokenizer": None if self.tokenizer is None else "loaded",
                "note": NO_TOKENIZER_NOTE if self.tokenizer is None else None,
            }

    # ---- internals ----------------------------------------------------------------
    def _run(self, batch: ScheduledBatch, kind: str) -> tuple[SamplerOutput, set[int]]:
        rows = batch.sampled_seqs
        t0 = time.perf_counter()
        logits = self.execute(batch.plan)
        t1 = time.perf_counter()
        self.step_seconds["execute"] += t1 - t0
        by_kind = self.execute_by_kind[kind]
        by_kind[0] += t1 - t0
        by_kind[1] = max(by_kind[1], t1 - t0)
        if logits is None and not rows:  # a step of partial prefill chunks only: nothing to sample
            return SamplerOutput([], []), set()
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(rows):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise RuntimeError(f"executor returned logits {shape}, expected [{len(rows)}, vocab]")
        nan = torch.isnan(logits).any(dim=-1)  # read after sampling: one wait for the device, not two
        out = self.sampler(logits, [s.params for s in rows], [s.generator for s in rows])
        nan_rows = {i for i, bad in enumerate(nan.tolist()) if bad}
        self.step_seconds["sample"] += time.perf_counter() - t1
        return out, nan_rows

    def _fail(self, request_ids: Iterable[str], message: str) -> list[RequestOutput]:
        """End these requests with finish_reason "error"; their KV may be half-written or garbage."""
        outputs = []
        for rid in request_ids:
            req = self._requests.pop(rid)
            req.error = message
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
            outputs.append(self._output(req))
        return outputs

    def _drop(self, request_id: str) -> None:
        """Forget a request without reporting it."""
        self._admit()
        for seq in self._requests.pop(request_id).seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def _after_token(self, seq: Sequence, token: int) -> None:
        """Detokenize the new token and retire the sequence if a stop rule fires (vLLM's order)."""
        params = seq.params
        delta = ""
        if seq.detokenizer is not None:
            delta = seq.detokenizer.add(token)
            seq.output_text += delta
        status = None
        # Sequence.num_tokens / num_output_tokens inline: the properties cost ~0.2 ms a 256-stream step.
        num_out = len(seq.output_token_ids)
        if token == self.eos_token_id and not params.ignore_eos:
            status = SequenceStatus.FINISHED_STOPPED
        elif params.stop_token_ids and token in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif params.stop_list and self._stop_string(seq, len(delta)):
            status = SequenceStatus.FINISHED_STOPPED
        elif len(seq.prompt_token_ids) + num_out >= self.max_model_len or (
                params.max_tokens is not None and num_out >= params.max_tokens):
            status = SequenceStatus.FINISHED_LENGTH
        if status is None:
            return
        if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += seq.detokenizer.flush()
        self.scheduler.finish(seq, status)

    @staticmethod
    def _stop_string(seq: Sequence, delta_len: int) -> bool:
        """Find a stop string that the new text completes; cut the text there."""
        text, params = seq.output_text, seq.params
        best: tuple[int, str] | None = None
        for stop in params.stop_list:
            # Only a match overlapping the new text is new; older text was checked before.
            idx = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        seq.output_text = text[:idx + (len(stop) if params.include_stop_str_in_output else 0)]
        seq.stop_reason = stop
        return True

    def _output(self, req: _Request, finished: bool | None = None) -> RequestOutput:
        if finished is None:
            finished = req.finished
        delta = self.progress_deltas and not finished
        first = not delta or all(seq.reported == (0, 0) for seq in req.seqs)
        # The tail might be the start of a stop string that a later token completes: holding it
        # back keeps streamed text from ever shrinking.
        stops = req.params.stop_list
        hold = max(len(s) for s in stops) - 1 if stops and self.tokenizer is not None else 0
        has_text = self.tokenizer is not None
        completions = []
        for seq in req.seqs:
            text = None
            if has_text:
                text = seq.output_text
                if hold and not seq.is_finished:
                    text = text[:max(0, len(text) - hold)]
            tokens, chars = seq.reported if delta else (0, 0)
            out_ids = seq.output_token_ids
            if delta:
                seq.reported = (len(out_ids), len(text) if has_text else 0)
            completions.append(CompletionOutput(
                seq.index, None if text is None else text[chars:], out_ids[tokens:],
                seq.logprobs[tokens:] if seq.logprobs is not None else None,
                seq.status.finish_reason, seq.stop_reason))
        prompt_ids = list(req.prompt_token_ids) if first else []
        return RequestOutput(req.request_id, req.prompt, prompt_ids, completions, finished, self.weight_version,
                             req.error, delta)

    def _validate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                  params: SamplingParams) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n > self.scheduler.max_num_seqs:
            raise InvalidRequest(f"n={params.n} is larger than max_num_seqs={self.scheduler.max_num_seqs}")
        if params.stop_list and self.tokenizer is None:
            raise InvalidRequest(f"stop strings need a tokenizer; {NO_TOKENIZER_NOTE} - use stop_token_ids")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequest("either prompt or prompt_token_ids is required")
            if not isinstance(prompt, str):
                raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise InvalidRequest(f"a text prompt needs a tokenizer; {NO_TOKENIZER_NOTE} - send prompt_token_ids")
            if not prompt:
                raise InvalidRequest("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt_token_ids
            if not isinstance(ids, list | tuple) or any(type(t) is not int for t in ids):
                raise InvalidRequest("prompt_token_ids must be a list of integers")
        if not ids:
            raise InvalidRequest("prompt is empty")
        bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no "
                                 f"room to generate (the prompt must be shorter than max_model_len)")
        return list(ids)
