"""What the engine accepts: a request's id, prompt and sampling parameters, checked before it is
queued, so a bad request is refused with a reason and never reaches a step."""

from __future__ import annotations

from ..sampling_params import InvalidRequest, SamplingParams
from ..tokenizer import Tokenizer

NO_TOKENIZER_NOTE = "no tokenizer for this model: outputs carry token ids only (text is None)"


def validate_request(request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams, *, tokenizer: Tokenizer | None, vocab_size: int | None,
                     max_model_len: int, max_num_seqs: int) -> list[int]:
    """A request's prompt token ids, or InvalidRequest saying what is wrong with it."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest("request_id must be a non-empty string")
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    if params.n > max_num_seqs:
        raise InvalidRequest(f"n={params.n} is larger than max_num_seqs={max_num_seqs}")
    if params.stop_list and tokenizer is None:
        raise InvalidRequest(f"stop strings need a tokenizer; {NO_TOKENIZER_NOTE} - use stop_token_ids")
    if prompt_token_ids is None:
        if prompt is None:
            raise InvalidRequest("either prompt or prompt_token_ids is required")
        if not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}")
        if tokenizer is None:
            raise InvalidRequest(f"a text prompt needs a tokenizer; {NO_TOKENIZER_NOTE} - send prompt_token_ids")
        if not prompt:
            raise InvalidRequest("prompt is empty")
        ids = tokenizer.encode(prompt)
    else:
        ids = prompt_token_ids
        if not isinstance(ids, list | tuple) or any(type(t) is not int for t in ids):
            raise InvalidRequest("prompt_token_ids must be a list of integers")
    if not ids:
        raise InvalidRequest("prompt is empty")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; max_model_len={max_model_len} leaves no "
                             f"room to generate (the prompt must be shorter than max_model_len)")
    return list(ids)
