"""The KV-cache write as an opaque op under torch.compile: it writes the cache in place (no copy
of the cache, which is what Inductor made of a traced index_copy_ that a later op reads), and
matches the eager write."""

from __future__ import annotations

import torch

from service.model.attention import write_kv


def test_write_kv_op_schema_and_fake():
    cache = torch.zeros(4, 2, 8)
    args = (cache, torch.tensor([1, 6]), torch.randn(2, 8))
    torch.library.opcheck(torch.ops.latentserve.write_kv.default, args)


def test_compiled_write_kv_mutates_the_cache_in_place_and_a_later_read_sees_it():
    cache = torch.zeros(8, 4, 16)
    ptr = cache.data_ptr()

    def layer(x: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        write_kv(kv, slots, x * 2)
        return kv.view(-1, 16).index_select(0, slots).sum(-1)  # reads what was just written

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, slots = torch.randn(3, 16), torch.tensor([0, 9, 31])
    out = compiled(x, cache, slots)
    assert cache.data_ptr() == ptr
    torch.testing.assert_close(cache.view(-1, 16)[slots], x * 2)
    torch.testing.assert_close(out, (x * 2).sum(-1))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.view(-1, 16)[untouched].any()
