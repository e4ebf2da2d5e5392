"""The engine loop on TP rank 0: requests in, step plans to the executor, tokens and text out.

The engine never sees the model. Each `step()` asks the scheduler for a `StepPlan`, hands it to
`execute(plan) -> fp32 logits [rows with needs_logits, vocab]` (the worker broadcasts it to the
other ranks and runs the model), samples, detokenizes, applies the stop rules and reports every
request that progressed; with `overlap` (async output) after launching the step that follows.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from ..outputs import RequestOutput
from ..sampling_params import InvalidRequest, SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .block_manager import BlockManager
from .first_token import FirstTokenClock
from .plan import StepPlan
from .request import Request, build_output
from .sampler import Sampler, SamplerOutput
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus, make_generator
from .stop import text_stop, token_stop
from .validate import NO_TOKENIZER_NOTE, validate_request

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, execute: Callable[[StepPlan], torch.Tensor], tokenizer: Tokenizer | None, *,
                 block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_id: int | None = None, vocab_size: int | None = None,
                 overlap: bool = False, collect: Callable[[], None] | None = None,
                 prepare: Callable[[StepPlan], object] | None = None) -> None:
        self.execute = execute
        # Called with a decode step scheduled ahead (token ids still placeholders) while the step
        # before it runs: the worker packs its graph inputs, all but the ids, off the critical path.
        self.prepare = prepare
        # Called before a launched step's logits are read: raises what the step's launch left
        # unchecked (the worker's deferred collective error words), failing its requests.
        self.collect = collect
        # Process a step's outputs while the next step runs (vLLM's async output processing): worth
        # it where `execute` returns before the device finishes (CUDA), a step later elsewhere.
        self.overlap = overlap
        # Set by the engine loop: hands outputs to their readers now, True if it took them. With
        # `overlap`, the tokens that landed go out this way before a prefill launches.
        self.publish: Callable[[list[RequestOutput]], bool] | None = None
        self._in_flight: tuple[ScheduledBatch, torch.Tensor | None] | None = None
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
        self._requests: dict[str, Request] = {}
        # New requests wait here, under their own short lock, until the next step admits them:
        # behind the step lock (held through the forward and the wait for logits) the H200's HTTP
        # adds and polls queued for whole steps, TTFT p50 2.6 s at 64 streams (RESULTS, 2026-12-03).
        self._inbox: dict[str, Request] = {}
        self._inbox_lock = threading.Lock()
        self._pending: list[RequestOutput] = []  # reported at the next step (aborts, foreign outputs)
        self._seq_ids = itertools.count()
        self._gen_ids = itertools.count()
        self._lock = threading.RLock()
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_steps_ahead = 0  # decode steps scheduled while the step before them ran (overlap)
        # Where a step's wall time goes, summed: scheduling, launching the model (asynchronous on
        # a GPU), waiting for its logits and sampling, and the outputs.
        self.step_seconds = dict.fromkeys(("schedule", "execute", "sample", "postprocess"), 0.0)
        self.step_kinds = dict.fromkeys(("decode", "prefill", "mixed"), 0)
        self.first_tokens = FirstTokenClock()  # marks `out` where the engine loop hands outputs over
        # Execute seconds by step kind, summed and the longest: a mean hid served prefill and mixed
        # steps of ~0.4 s each on the H200 (bench/RESULTS.md, run 20).
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
        ids = validate_request(request_id, prompt, prompt_token_ids, params, tokenizer=self.tokenizer,
                               vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                               max_num_seqs=self.scheduler.max_num_seqs)
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
            self._inbox[request_id] = Request(request_id, prompt, list(ids), params, seqs)
            self.first_tokens.added(request_id)

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
            self.drain()  # a batch in flight still writes the KV being dropped
            return self.scheduler.preempt_all()

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside step() (aborts) that no step has reported yet."""
        with self._lock:
            outputs, self._pending = self._pending, []
            return outputs

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests or self._pending or self._inbox or self._in_flight)

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._requests) + len(self._inbox)

    # ---- the loop -----------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """A step was launched whose tokens the next step() collects (overlap only)."""
        return self._in_flight is not None

    def step(self, launch: bool = True) -> list[RequestOutput]:
        """Schedule and run one step; report every request that progressed.

        With `overlap`, a step launches the next batch before it processes the previous one's
        tokens (detokenize, stop strings, outputs), so that work runs while the device computes:
        the outputs returned are those of the batch launched by the call before. `launch=False`
        only finishes the batch in flight (pausing, draining)."""
        with self._lock:
            outputs, self._pending = self._pending, []
            landed = ahead = None
            if self._in_flight is not None:
                prev, self._in_flight = self._in_flight, None
                if launch:  # overlap only: the next decode step is scheduled while this one runs
                    ahead = self._schedule_ahead(prev[0])
                landed = self._land(prev, outputs)
            failed = None
            if launch:
                batch, kind = self._next_batch(ahead)
                if batch is not None:
                    if kind != "decode" and landed and self.publish is not None:
                        # A launch that prefills holds the host for its whole forward (34 ms a
                        # mixed step at 256 streams, H100 run 69), and the landed tokens would wait
                        # for it: the first token of every prefill in a burst, one mixed step late.
                        outputs += self._report(landed)
                        landed = None
                        if self.publish(outputs):
                            outputs = []
                    failed = self._execute(batch, kind)
            if landed:
                outputs += self._report(landed)
            if failed is None and not self.overlap and self._in_flight is not None:
                cur, self._in_flight = self._in_flight, None
                landed = self._land(cur, outputs)
                if landed:
                    outputs += self._report(landed)
            if failed is not None:
                outputs += self._fail_running(failed)
            return outputs

    def _schedule_ahead(self, flight: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step, scheduled (and its graph inputs prepared) while `flight` runs.
        Only a head start: a failure here is logged and the launch schedules the step itself,
        so `flight`, already taken off `_in_flight`, is still collected."""
        t0 = time.perf_counter()
        ahead = None
        try:
            self._admit()  # new requests go first: no decode step ahead while they can be admitted
            ahead = self.scheduler.schedule_ahead(flight)
            if ahead is not None and self.prepare is not None:
                self.prepare(ahead.plan)
        except Exception:
            log.warning("scheduling the next step ahead failed", exc_info=True)
        self.step_seconds["schedule"] += time.perf_counter() - t0
        return ahead

    def drain(self) -> None:
        """Finish the step in flight; its outputs are reported by the next step() or drain_outputs()."""
        with self._lock:
            if self._in_flight is not None:
                outputs = self.step(launch=False)  # takes the pending outputs too
                self._pending += outputs

    def _next_batch(self, ahead: ScheduledBatch | None) -> tuple[ScheduledBatch | None, str]:
        """The batch to launch and its kind: `ahead`, its tokens filled in from the batch that
        just landed, or a fresh schedule."""
        t0 = time.perf_counter()
        # A request that arrived while the step before ran (the host waiting for its logits) is
        # admitted now rather than a step later: the step scheduled ahead gives way. Served at
        # 256 streams on an H100 (run 65) that later step cost TTFT p50 +31% (206 -> 269 ms).
        if ahead is not None and self._inbox:
            ahead = None
        batch = self.scheduler.fill_ahead(ahead) if ahead is not None else None
        if batch is not None:
            self.num_steps_ahead += 1
        else:
            self._admit()
            batch = self.scheduler.schedule()
        self.step_seconds["schedule"] += time.perf_counter() - t0
        if batch.is_empty:
            return None, ""
        decodes = sum(len(c.token_ids) == 1 for c in batch.plan.chunks)
        return batch, "decode" if decodes == len(batch.plan.chunks) else "prefill" if not decodes else "mixed"

    def _execute(self, batch: ScheduledBatch, kind: str) -> Exception | None:
        """Hand the batch to the executor (asynchronous on a GPU); it is in flight after."""
        self.num_steps += 1
        self.step_kinds[kind] += 1
        if kind != "decode":
            self.first_tokens.launched(batch)
        t1 = time.perf_counter()
        try:
            logits = self.execute(batch.plan)
        except Exception as exc:  # any executor failure ends the running requests, not the engine
            return exc
        t2 = time.perf_counter()
        self.step_seconds["execute"] += t2 - t1
        by_kind = self.execute_by_kind[kind]
        by_kind[0] += t2 - t1
        by_kind[1] = max(by_kind[1], t2 - t1)
        self._in_flight = (batch, logits)
        return None

    def _fail_running(self, exc: Exception) -> list[RequestOutput]:
        self.num_failed_steps += 1
        log.error("model execution failed", exc_info=exc)
        running = dict.fromkeys(s.request_id for s in self.scheduler.running)
        return self._fail(running, f"model execution failed: {type(exc).__name__}: {exc}")

    def _land(self, flight: tuple[ScheduledBatch, torch.Tensor | None],
              outputs: list[RequestOutput]) -> list[tuple[Sequence, int, SequenceStatus | None]] | None:
        """Sample a launched batch, append its tokens and retire what a token alone stops (so the
        next schedule leaves those sequences out). Returns the rows for `_report`."""
        batch, logits = flight
        try:
            if self.collect is not None:
                self.collect()
            sampled, nan_rows = self._sample(batch, logits)
        except Exception as exc:
            outputs += self._fail_running(exc)
            return None
        t0 = time.perf_counter()
        rows = self.scheduler.postprocess(batch, sampled.token_ids)
        self.first_tokens.landed(batch)
        landed = []
        poisoned: dict[str, None] = {}
        finish, eos, max_len = self.scheduler.finish, self.eos_token_id, self.max_model_len
        for i, (seq, token, logprobs) in enumerate(zip(rows, sampled.token_ids, sampled.logprobs)):
            if seq is None:  # aborted (or stopped by a string) while this batch ran
                continue
            if nan_rows and i in nan_rows:
                seq.output_token_ids.pop()  # sampled from NaN: not a token of this request
                poisoned[seq.request_id] = None
                continue
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs)
            status = token_stop(seq, token, eos, max_len)
            if status is not None:
                finish(seq, status)
            landed.append((seq, token, status))
        if poisoned:
            # Garbage in the model (stale memory, weights not loaded): say so, emit no token.
            outputs += self._fail(poisoned, "the model returned NaN logits (weights or KV cache not valid?)")
        self.step_seconds["postprocess"] += time.perf_counter() - t0
        return landed

    def _report(self, landed: list) -> list[RequestOutput]:
        """Detokenize the landed tokens, apply the stop strings, and build the outputs."""
        t0 = time.perf_counter()
        outputs = []
        touched: dict[str, Request] = {}
        requests, finish = self._requests, self.scheduler.finish
        for seq, token, status in landed:
            rid = seq.request_id
            req = requests.get(rid)
            if req is None:  # failed (NaN, or the next launch) since it landed
                continue
            final = text_stop(seq, token, status)
            if final is not None and final is not status:
                if seq.status.is_finished:
                    seq.status = final  # a length stop that a stop string completes
                else:
                    finish(seq, final)
            if rid not in touched:
                touched[rid] = req
        wants = self.wants_progress
        for req in touched.values():
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
                "async_output": self.overlap,
                "steps_scheduled_ahead": self.num_steps_ahead,
                "first_token": self.first_tokens.stats(),
                "tokenizer": None if self.tokenizer is None else "loaded",
                "note": NO_TOKENIZER_NOTE if self.tokenizer is None else None,
            }

    # ---- internals ----------------------------------------------------------------
    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> tuple[SamplerOutput, set[int]]:
        """Sample the batch's logits rows (waits for the device); also the rows that were NaN."""
        rows = batch.sampled_seqs
        t0 = time.perf_counter()
        if logits is None and not rows:  # a step of partial prefill chunks only: nothing to sample
            return SamplerOutput([], []), set()
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(rows):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise RuntimeError(f"executor returned logits {shape}, expected [{len(rows)}, vocab]")
        nan = torch.isnan(logits).any(dim=-1)  # read after sampling: one wait for the device, not two
        out = self.sampler(logits, [s.params for s in rows], [s.generator for s in rows])
        nan_rows = {i for i, bad in enumerate(nan.tolist()) if bad}
        self.step_seconds["sample"] += time.perf_counter() - t0
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

    def _output(self, req: Request, finished: bool | None = None) -> RequestOutput:
        return build_output(req, req.finished if finished is None else finished, deltas=self.progress_deltas,
                            has_text=self.tokenizer is not None, weight_version=self.weight_version)
