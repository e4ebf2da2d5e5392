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

    def grow(self, token_ids: list[int], text: str | None, logprobs: list | None) -> None:
        """Append a delta's tokens, text and logprobs in place (the HTTP controller's whole output)."""
        self.token_ids.extend(token_ids)
        if text is not None:  # a str grown by + copied the whole text every delta
            if not isinstance(self.text, OutputText):
                self.text = OutputText(self.text or "")
            self.text.append(text)
        if logprobs is not None:  # in place: a new list every delta made a 32k-token rollout 1.8 s
            if self.logprobs is None:
                self.logprobs = list(logprobs)
            else:
                self.logprobs.extend(logprobs)

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
            c.grow(d.token_ids, d.text, d.logprobs)
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        self.finished, self.weight_version, self.error = delta.finished, delta.weight_version, delta.error

    def advance(self, token_ids: list[int], text: str | None, logprobs: list | None, weight_version: int) -> None:
        """`extend` by an unfinished one-sample delta given as its parts (an OutputBatch row)."""
        if self.outputs:
            self.outputs[0].grow(token_ids, text, logprobs)
        else:
            self.outputs.append(CompletionOutput(0, text, list(token_ids), None if logprobs is None else list(logprobs)))
        self.weight_version = weight_version


class OutputBatch:
    """A poll's outputs on their way from rank 0 to the HTTP controller, in order. Progress deltas
    of one-sample requests (every output of a stream but its first and its last) travel as
    columns, the rest as objects: at 256 streams, pickling a step's outputs as objects took 0.32 ms
    on rank 0 and unpickling them 0.32 ms of the HTTP process on this CPU, the columns 0.12 and
    0.08 (bench/host_step.py); the HTTP side then extends each whole output from a row's parts."""

    __slots__ = ("ids", "objects", "token_ids", "texts", "logprobs", "versions")

    def __init__(self, outputs: list[RequestOutput] = ()):
        self.ids, self.objects, self.token_ids, self.texts, self.logprobs, self.versions = [], [], [], [], [], []
        for out in outputs:
            self.ids.append(out.request_id)
            self.versions.append(out.weight_version)
            c = out.outputs[0] if len(out.outputs) == 1 else None
            if (c is not None and out.delta and not out.prompt_token_ids and not out.finished and out.error is None
                    and c.index == 0 and c.finish_reason is None and c.stop_reason is None):
                self.objects.append(None)
                self.token_ids.append(c.token_ids)
                self.texts.append(c.text)
                self.logprobs.append(c.logprobs)
            else:
                self.objects.append(out)
                self.token_ids.append(None)
                self.texts.append(None)
                self.logprobs.append(None)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        """(request_id, output, token_ids, text, logprobs, weight_version) per output, in order:
        `output` is the RequestOutput, or None for a row given by its parts (`RequestOutput.advance`)."""
        return zip(self.ids, self.objects, self.token_ids, self.texts, self.logprobs, self.versions)

    def outputs(self) -> list[RequestOutput]:
        """Every output as a RequestOutput (a row becomes the delta it came from)."""
        return [out if out is not None else
                RequestOutput(rid, None, [], [CompletionOutput(0, text, ids, lps)], False, version, None, True)
                for rid, out, ids, text, lps, version in self]

    def __reduce__(self):
        return _batch, (self.ids, self.objects, self.token_ids, self.texts, self.logprobs, self.versions)


def _batch(*columns) -> OutputBatch:
    batch = OutputBatch.__new__(OutputBatch)
    batch.ids, batch.objects, batch.token_ids, batch.texts, batch.logprobs, batch.versions = columns
    return batch
