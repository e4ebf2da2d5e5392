"""A stream's output text, grown a token at a time and read mostly by its tail: a sequence's
on rank 0, and a streamed request's whole output in the HTTP controller (`RequestOutput.extend`).

`str +=` on an attribute copies the whole text every token: at 256 streams of 32k-token outputs
(~128 kB of text each) that was 2.5 ms of rank 0's engine thread a step on this CPU, for a step
that reports a few characters a stream. Here the text is a list of parts whose lengths halve
from the first to the last: an append merges the last parts while the newer is at least half the
older, so a character is copied O(log n) times and reading the tail touches the small parts only.
"""

from __future__ import annotations


class OutputText:
    __slots__ = ("_parts", "_len")

    def __init__(self, text: str = ""):
        self._parts: list[str] = [text] if text else []
        self._len = len(text)

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return self.slice(0)

    def __eq__(self, other) -> bool:  # as the str it stands for: a whole output equals the engine's
        if isinstance(other, OutputText | str):
            return len(other) == self._len and str(other) == str(self)
        return NotImplemented

    __hash__ = None  # mutable

    def __getitem__(self, key: slice) -> str:
        """text[a:b] for the non-negative, step-less slices a stream's reader takes."""
        start, stop, step = key.indices(self._len)
        if step != 1 or (key.start or 0) < 0 or (key.stop or 0) < 0:
            raise ValueError("OutputText takes forward slices of non-negative bounds only")
        return self.slice(start, stop)

    def append(self, s: str) -> None:
        if not s:
            return
        parts = self._parts
        parts.append(s)
        self._len += len(s)
        while len(parts) > 1 and 2 * len(parts[-1]) >= len(parts[-2]):
            last = parts.pop()
            parts[-1] += last

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end] for 0 <= start, end <= len; joins only the parts it overlaps."""
        end = self._len if end is None else end
        if start >= end:
            return ""
        if self._parts:  # the common read: this step's characters, inside the last part
            last = self._parts[-1]
            begin = self._len - len(last)
            if start >= begin:
                return last[start - begin:end - begin]
        picked, pos = [], self._len  # pos: where the part being looked at ends
        for part in reversed(self._parts):
            begin = pos - len(part)
            if begin < end:
                picked.append(part[max(0, start - begin):end - begin])
            if begin <= start:
                break
            pos = begin
        whole = "".join(reversed(picked))
        if start == 0 and end == self._len:
            self._parts = [whole]  # a whole read (a finished output) keeps one part
        return whole

    def truncate(self, n: int) -> None:
        """Keep the first n characters (a stop string cuts the text there)."""
        if n < self._len:
            kept = self.slice(0, n)
            self._parts, self._len = ([kept] if kept else []), n
