"""Request outputs, mirroring vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .output_text import OutputText


@dataclass
class CompletionOutput:
    index: int
    text: str | None  # an OutputText while the HTTP controller extends an unfinished stream
    token_ids: list[int]
    # One dict per generated token: {token_id: logprob}, the chosen token always included.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        # Positional fields: the default pickle of a dataclass writes every object's __dict__ by
        # name, and a 256-stream step ships 512 of these to the controller (bench/host_step.py).
        return CompletionOutput, (self.index, self.text, self.token_ids, self.logprobs, self.finish_reason,
                                  self.stop_reason)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    weight_version: int = 0
    error: str | None = None
    # A stream's progress since its last output (token ids, text and logprobs appended since
    # then; the prompt's ids only in the first), as the engine loop reports it to the HTTP
    # controller, which `extend`s one whole output per request. Whole outputs every step cost
    # O(prompt + output) per stream per step: 225 ms a step for 256 streams of a 4096-token
    # prompt at 1024 tokens out (building, pickling, unpickling), against an 8 ms decode step.
    delta: bool = False

    def __reduce__(self):
        return RequestOutput, (self.request_id, self.prompt, self.prompt_token_ids, self.outputs, self.finished,
                               self.weight_version, self.error, self.delta)

    def extend(self, delta: RequestOutput) -> None:
        """Append a delta output of the same request to this whole one. The text grows as an
        OutputText (len, forward slices and str() as a str's): only the HTTP controller extends,
        for an unfinished stream, and the engine's finished output is a whole one with a str."""
        mine = {c.index: c for c in self.outputs}
        for d in delta.outputs:
            c = mine.get(d.index)
            if c is None:
                self.outputs.append(CompletionOutput(d.index, d.text, list(d.token_ids),
                                                     None if d.logprobs is None else list(d.logprobs),
                                                     d.finish_reason, d.stop_reason))
                continue
            c.token_ids.extend(d.token_ids)
            if d.text is not None:  # a str grown by + copied the whole text every delta
                if not isinstance(c.text, OutputText):
                    c.text = OutputText(c.text or "")
                c.text.append(d.text)
            if d.logprobs is not None:  # in place: a new list every delta made a 32k-token rollout 1.8 s
                if c.logprobs is None:
                    c.logprobs = list(d.logprobs)
                else:
                    c.logprobs.extend(d.logprobs)
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        self.finished, self.weight_version, self.error = delta.finished, delta.weight_version, delta.error
