"""One generated sequence (a request with n > 1 owns n of them) and its lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..output_text import OutputText
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        # Identity tests: `self not in (WAITING, RUNNING)` scanned the tuple through Enum.__eq__,
        # ~10% of an engine step's host time at 256 streams (bench/stream_outputs.py).
        return self is not _RUNNING and self is not _WAITING

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM finish_reason string, None while the sequence lives."""
        return self.value if self.is_finished else None


_WAITING, _RUNNING = SequenceStatus.WAITING, SequenceStatus.RUNNING


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """A CPU generator per seeded sequence: CPU so the stream is the same whatever device the logits
    are on; seed + index so the n samples of one request differ."""
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(seed + index)
    return g


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Reset to 0 on preemption: the cache is recomputed.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Row of the linear-attention state cache while running (None while waiting); like the
    # blocks, it is given up on preemption and the state recomputed.
    state_slot: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    # Lives in the sequence (not the scheduler) so its state survives preemption: a recompute
    # re-derives the KV, never re-samples, so the generator advances once per output token.
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    output_text: OutputText = field(default_factory=OutputText)  # grown a token at a time
    arrival_time: float = field(default_factory=time.monotonic)
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # (output tokens, text chars) already reported in delta outputs (LLMEngine.progress_deltas)
    reported: tuple[int, int] = (0, 0)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating the whole history (decode steps read 1 token)."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]
