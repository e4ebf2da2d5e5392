"""Does Inductor keep a custom op's writes to two mutated views of one storage? kda_step's case:
a KDA layer's conv and recurrent rows are views of one pool chunk, and its step op mutates both.

Run 57 (2026-12-05, H200, torch 2.11.0+cu130): `one_op` loses b's writes and reads b wrong (out
err 1.4e3, b err 2 a call); the compiled code copies the views' common base starting at b's own
address, without b's offset in it. torch 2.13's CPU Inductor copies it from the right place
(0 errors). `two_ops` is the defaults' pattern (the conv kernel mutates one view, FLA's step the
other): printed for the next run.

    python bench/alias_probe.py [cuda|cpu]
"""
import sys

import torch


@torch.library.custom_op("probe::both", mutates_args=("a", "b"))
def both(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = x + a[rows].sum() + 10 * b[rows].sum()
    a[rows] += 1.0
    b[rows] += 2.0
    return out


@torch.library.custom_op("probe::one", mutates_args=("t",))
def one(x: torch.Tensor, t: torch.Tensor, rows: torch.Tensor, by: float) -> torch.Tensor:
    out = x + t[rows].sum() * (10.0 if by == 2.0 else 1.0)
    t[rows] += by
    return out


@both.register_fake
def _(x, a, b, rows):
    return torch.empty_like(x)


@one.register_fake
def _(x, t, rows, by):
    return torch.empty_like(x)


def one_op(x, a, b, rows):
    return both(x * 2, a, b, rows) + 1


def two_ops(x, a, b, rows):
    return one(x * 2, a, rows, 1.0) + one(x * 0, b, rows, 2.0) + 1


def probe(name, fn, dev):
    torch._dynamo.reset()
    base = torch.zeros(100000, device=dev)
    a, b = base[1000:1200].view(10, 20), base[50000:50400].view(10, 40)
    ra, rb = a.clone(), b.clone()
    torch._dynamo.mark_static(a)
    torch._dynamo.mark_static(b)
    cf = torch.compile(fn, dynamic=True)
    rows = torch.tensor([1, 3], device=dev)
    x = torch.ones(4, device=dev)
    for i in range(3):
        want = x * 2 + ra[rows].sum() + 10 * rb[rows].sum() + 1
        out = cf(x, a, b, rows)
        ra[rows] += 1
        rb[rows] += 2
        print(f"alias_probe {name} {torch.__version__} call {i}: out err {(out - want).abs().max().item():.3g}, "
              f"a err {(a - ra).abs().max().item():.3g}, b err {(b - rb).abs().max().item():.3g}")


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    probe("one_op", one_op, device)
    probe("two_ops", two_ops, device)
