"""A request inside the engine (its sequences, one per sample) and the `RequestOutput` it reports."""

from __future__ import annotations

from dataclasses import dataclass

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .sequence import Sequence


@dataclass(eq=False)
class Request:
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


def build_output(req: Request, finished: bool, *, deltas: bool, has_text: bool, weight_version: int) -> RequestOutput:
    """The request's output now: whole, or (`deltas`, while unfinished) what is new since the last
    one, which each sequence's `reported` marks."""
    delta = deltas and not finished
    first = not delta or all(seq.reported == (0, 0) for seq in req.seqs)
    # The tail might be the start of a stop string that a later token completes: holding it
    # back keeps streamed text from ever shrinking.
    stops = req.params.stop_list
    hold = max(len(s) for s in stops) - 1 if stops and has_text else 0
    completions = []
    for seq in req.seqs:
        end = len(seq.output_text) if has_text else 0
        if hold and not seq.is_finished:
            end = max(0, end - hold)
        tokens, chars = seq.reported if delta else (0, 0)
        out_ids = seq.output_token_ids
        if delta:
            seq.reported = (len(out_ids), end)
        completions.append(CompletionOutput(
            seq.index, seq.output_text.slice(chars, end) if has_text else None, out_ids[tokens:],
            seq.logprobs[tokens:] if seq.logprobs is not None else None,
            seq.status.finish_reason, seq.stop_reason))
    prompt_ids = list(req.prompt_token_ids) if first else []
    return RequestOutput(req.request_id, req.prompt, prompt_ids, completions, finished, weight_version,
                         req.error, delta)
