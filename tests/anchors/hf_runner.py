"""transformers as a reference voice: greedy tokens for token-id prompts, fp32, no KV cache.

Every step recomputes the whole sequence, so the reference does not depend on a cache
implementation; EOS does not stop generation (the other voices run with ignore_eos).
"""

from __future__ import annotations

import torch


def load_hf_model(checkpoint_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_greedy(checkpoint_dir: str, prompts: list[list[int]], max_tokens: int, model=None) -> list[list[int]]:
    model = model if model is not None else load_hf_model(checkpoint_dir)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        new: list[int] = []
        for _ in range(max_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            nxt = int(torch.argmax(logits))
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        outputs.append(new)
    return outputs


@torch.no_grad()
def hf_top2_margin(model, prompts: list[list[int]]) -> float:
    """Smallest gap between the top two next-token logits over the prompts: a small gap
    means float rounding could legitimately flip greedy choices between engines."""
    gaps = []
    for prompt in prompts:
        logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1]
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
    return min(gaps)
