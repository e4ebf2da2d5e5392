"""Token sampling from fp32 logits: greedy, temperature, top-k, top-p, seeds, logprobs.

Rows are independent: nothing a row gets depends on the other rows of the batch, so a seeded
request draws the same tokens whatever it is batched with. Sampling is the exponential race
(argmax of p / E with E ~ Exp(1) i.i.d., which picks token i with probability p_i): one noise
draw per vocabulary entry, so a seeded generator advances by the same amount every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} with the chosen token and the top-N, or None when not asked.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"logits {tuple(logits.shape)} for {len(params)} params, {len(generators)} generators")
        if not params:
            return SamplerOutput([], [])
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        greedy = [p.greedy for p in params]  # decided on the host: no copy to the device, no sync
        if not all(greedy):
            sampled = self._sample(logits, params, generators)
            chosen = torch.where(torch.tensor(greedy, device=logits.device), chosen, sampled)
        token_ids = chosen.tolist()
        return SamplerOutput(token_ids, self._logprobs(logits, params, chosen))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[-1]
        # Greedy rows ride along with temperature 1; their result is discarded.
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
        scaled = logits / temps.unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _truncate(scaled, torch.tensor(top_k, device=dev), torch.tensor(top_p, device=dev))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab, device=dev).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i] = torch.empty(vocab).exponential_(generator=g).to(dev)
        # An exact 0 draw would give p/0 = inf (or nan for a masked p): clamp it away.
        return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)

    def _logprobs(self, logits: torch.Tensor, params: list[SamplingParams],
                  chosen: torch.Tensor) -> list[dict[int, float] | None]:
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        # Raw model distribution, before temperature / top-k / top-p (vLLM's default).
        logp = torch.log_softmax(logits, dim=-1)
        chosen_lp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        top_n = max(n or 0 for n in wanted)
        top_vals, top_ids = (logp.topk(top_n, dim=-1) if top_n else (None, None))
        out: list[dict[int, float] | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            row: dict[int, float] = {}
            if n:
                row = dict(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            row[int(chosen[i])] = chosen_lp[i]
            out.append(row)
        return out


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then outside its top-p nucleus."""
    vals, idx = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vals.shape[-1], device=vals.device)
    vals = vals.masked_fill(rank.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    probs = vals.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
    mass_above = probs.cumsum(dim=-1) - probs
    # Rows with top_p = 1 drop nothing, even where rounding lets the cumulative sum reach 1 early.
    drop = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    vals = vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, idx, vals)
