"""Does Inductor keep a custom op's writes to two mutated views of one storage? (kda_step's case:
conv and recurrent rows are views of one pool chunk.) Prints the error against eager per call."""
import sys

import torch


@torch.library.custom_op("probe::two", mutates_args=("a", "b"))
def two(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = x + a[rows].sum() + 10 * b[rows].sum()
    a[rows] += 1.0
    b[rows] += 2.0
    return out


@two.register_fake
def _(x, a, b, rows):
    return torch.empty_like(x)


def f(x, a, b, rows):
    return two(x * 2, a, b, rows) + 1


dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
base = torch.zeros(100000, device=dev)
a, b = base[1000:1200].view(10, 20), base[50000:50400].view(10, 40)
ra, rb = a.clone(), b.clone()
torch._dynamo.mark_static(a)
torch._dynamo.mark_static(b)
cf = torch.compile(f, dynamic=True)
rows = torch.tensor([1, 3], device=dev)
x = torch.ones(4, device=dev)
for i in range(3):
    want = x * 2 + ra[rows].sum() + 10 * rb[rows].sum() + 1
    out = cf(x, a, b, rows)
    ra[rows] += 1
    rb[rows] += 2
    print(f"alias_probe {torch.__version__} call {i}: out err {(out - want).abs().max().item():.3g}, "
          f"a err {(a - ra).abs().max().item():.3g}, b err {(b - rb).abs().max().item():.3g}")
