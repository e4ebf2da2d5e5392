"""The stop rules, in vLLM's order: EOS, stop_token_ids, stop strings, then length.

Split in two so an engine that overlaps a step's output processing with the next step can retire
most sequences before scheduling that step: `token_stop` needs only the token (EOS, stop ids,
length), `text_stop` the detokenized text (stop strings, which win over a length stop).
"""

from __future__ import annotations

from .sequence import Sequence, SequenceStatus

_STOPPED, _LENGTH = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH


def token_stop(seq: Sequence, token: int, eos_token_id: int | None, max_model_len: int) -> SequenceStatus | None:
    """The stop that `token` (already appended) fires without looking at text, or None."""
    params = seq.params
    if token == eos_token_id and not params.ignore_eos:
        return _STOPPED
    if params.stop_token_ids and token in params.stop_token_ids:
        seq.stop_reason = token
        return _STOPPED
    return _LENGTH if length_reached(seq, len(seq.output_token_ids), max_model_len) else None


def length_reached(seq: Sequence, num_out: int, max_model_len: int) -> bool:
    """The length stop: the prompt and `num_out` output tokens fill max_model_len, or reach max_tokens."""
    # Sequence.num_tokens / num_output_tokens inline: the properties cost ~0.2 ms a 256-stream step.
    max_tokens = seq.params.max_tokens
    return len(seq.prompt_token_ids) + num_out >= max_model_len or (max_tokens is not None and num_out >= max_tokens)


def text_stop(seq: Sequence, token: int, status: SequenceStatus | None) -> SequenceStatus | None:
    """Detokenize `token`; return the sequence's final status given `token_stop`'s, or None.

    A stop string that the new text completes turns a length stop into a stop (vLLM checks it
    first); EOS and stop ids leave the text uncut."""
    delta = ""
    if seq.detokenizer is not None:
        delta = seq.detokenizer.add(token)
        seq.output_text.append(delta)
    if (status is None or status is _LENGTH) and seq.params.stop_list and _stop_string(seq, len(delta)):
        status = _STOPPED
    if status is not None and seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
        seq.output_text.append(seq.detokenizer.flush())
    return status


def _stop_string(seq: Sequence, delta_len: int) -> bool:
    """Find a stop string that the new text completes; cut the text there."""
    params, n = seq.params, len(seq.output_text)
    # Only a match overlapping the new text is new; older text was checked before.
    base = max(0, n - delta_len - max(len(s) for s in params.stop_list) + 1)
    tail = seq.output_text.slice(base)
    best: tuple[int, str] | None = None
    for stop in params.stop_list:
        idx = tail.find(stop, max(0, n - delta_len - len(stop) + 1 - base))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return False
    idx, stop = best
    seq.output_text.truncate(base + idx + (len(stop) if params.include_stop_str_in_output else 0))
    seq.stop_reason = stop
    return True
