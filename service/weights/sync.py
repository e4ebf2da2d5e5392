"""Weight sync over a process group: a trainer broadcasts named tensors to every TP rank.

The group is made outside torch.distributed's global state (its own TCPStore and a bare
ProcessGroupGloo/NCCL), so it coexists with the ranks' TP group and can be torn down after
each sync. Rank 0 of the sync group is the trainer; TP rank r is sync rank r + 1.

Tensors travel in buckets: each bucket is the byte concatenation of several tensors, so a
model of many small tensors costs few broadcasts.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..net import free_port

DEFAULT_BUCKET_BYTES = 64 << 20

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPES[self.dtype].itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> TensorMeta:
        if d.get("dtype") not in _DTYPES:
            raise ValueError(f"tensor {d.get('name')!r}: dtype {d.get('dtype')!r} not one of {sorted(_DTYPES)}")
        return cls(str(d["name"]), tuple(int(x) for x in d["shape"]), d["dtype"])


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"unsupported dtype {dtype}")


def buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    out, cur, size = [], [], 0
    for m in metas:
        if cur and size + m.nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(m)
        size += m.nbytes
    if cur:
        out.append(cur)
    return out


class SyncGroup:
    """One side of a weight-sync group (the trainer is rank 0)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 120.0, device: str = "cpu"):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        prefix = dist.PrefixStore("latentserve-weight-sync", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.device = torch.device(device)

    def _broadcast(self, buf: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()

    def send(self, named: dict[str, torch.Tensor], metas: list[TensorMeta], bucket_bytes: int) -> int:
        """Trainer side: broadcast every tensor, bucket by bucket. Returns bytes sent."""
        sent = 0
        for bucket in buckets(metas, bucket_bytes):
            flat = torch.cat([named[m.name].detach().to(self.device).contiguous().view(-1).view(torch.uint8)
                              for m in bucket])
            self._broadcast(flat)
            sent += flat.numel()
        self._leave()
        return sent

    def receive(self, metas: list[TensorMeta], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank side: yields (name, tensor) as buckets arrive."""
        for bucket in buckets(metas, bucket_bytes):
            flat = torch.empty(sum(m.nbytes for m in bucket), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            off = 0
            for m in bucket:
                t = flat[off:off + m.nbytes].view(_DTYPES[m.dtype]).view(m.shape)
                off += m.nbytes
                yield m.name, t
        self._leave()

    def _leave(self) -> None:
        """Every member's collectives are complete before any member closes its group: gloo fails an op
        still pending on a pair whose peer has closed ("Connection closed by peer"), so a rank that
        closes as soon as its last bucket arrives can fail the trainer's broadcast of that bucket."""
        everyone = range(self.world_size)
        self.store.set(f"done/{self.rank}", "1")
        self._await([f"done/{r}" for r in everyone])
        if self.rank:  # the trainer hosts the store: it closes last
            self.store.set(f"left/{self.rank}", "1")
        else:
            self._await([f"left/{r}" for r in everyone if r])

    def _await(self, keys: list[str]) -> None:
        """Until every key is set; a member that gave up (abandon) ends the wait at once with its reason."""
        others = [f"failed/{r}" for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(keys):  # polled: a timed-out store.wait logs a warning each time
            for key in others:
                if self.store.check([key]):
                    raise RuntimeError(f"weight sync: {self.store.get(key).decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight sync: {keys} not all set within {self.timeout}")
            time.sleep(0.005)

    def abandon(self, reason: str) -> None:
        """Tell the other members this one gave up (their wait to leave ends with `reason`), then close."""
        try:
            self.store.set(f"failed/{self.rank}", reason[:2000])
        except Exception:  # the store's host may be gone already; closing is all that is left
            pass
        self.close()

    def close(self) -> None:
        self.pg = None
        self.store = None


def describe(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in named]


# ---- trainer side: push through a running service --------------------------------------------
def push_via_group(client, named_tensors, *, host: str = "127.0.0.1", port: int | None = None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, backend: str = "gloo",
                   timeout_s: float = 120.0) -> dict:
    """Broadcast `named_tensors` (full HF-named tensors) to every rank of the service behind `client`.

    The HTTP call (which makes the ranks join) and the group set-up run side by side; if the
    service rejects the update (bad names/shapes), that error is raised without waiting for a
    group that will never form.
    """
    import threading

    named = dict(named_tensors)
    metas = describe(named.items())
    tp = client.status()["tp"]
    port = port or free_port(host)
    spec = {"host": host, "port": port, "tensors": [m.to_json() for m in metas], "bucket_bytes": bucket_bytes,
            "backend": backend, "timeout_s": timeout_s}
    box: dict = {}

    def call() -> None:
        try:
            box["response"] = client.update_weights(group=spec)
        except Exception as e:  # surfaced in the caller's thread
            box["error"] = e

    def join() -> None:
        try:
            box["group"] = SyncGroup(host, port, 0, tp + 1, backend=backend, timeout_s=timeout_s)
        except Exception as e:
            box["group_error"] = e

    http = threading.Thread(target=call, name="weight-sync-http", daemon=True)
    grp = threading.Thread(target=join, name="weight-sync-join", daemon=True)
    http.start()
    grp.start()
    while grp.is_alive():
        grp.join(0.05)
        if "error" in box:
            raise box["error"]
    if "group_error" in box:
        raise box["group_error"]
    t0 = time.perf_counter()
    try:
        sent = box["group"].send(named, metas, bucket_bytes)
    except Exception as e:  # the service's own account of the failure says more than gloo's
        box["group"].abandon(f"the trainer's broadcast failed: {e}")
        http.join(min(timeout_s, 30.0))
        raise RuntimeError(f"weight sync broadcast failed: {e}; the service answered: "
                           f"{box.get('error') or box.get('response') or 'nothing yet'}") from e
    seconds = time.perf_counter() - t0
    http.join(timeout_s)
    box["group"].close()
    if "error" in box:
        raise box["error"]
    response = box["response"]
    response["trainer"] = {"bytes": sent, "seconds": seconds, "gbps": sent / max(seconds, 1e-9) / 1e9}
    return response


def push_via_refs(client, named_tensors) -> dict:
    """From a process connected to the service's Ray cluster (e.g. a trainer actor): put the tensors
    in the object store, deposit the refs in the service's inbox, then ask for the update."""
    import ray

    info = client.status()["ray"]
    inbox = ray.get_actor(info["weight_inbox"], namespace=info["namespace"])
    pairs = [(name, ray.put(t.detach().cpu().contiguous())) for name, t in dict(named_tensors).items()]
    token = ray.get(inbox.deposit.remote(pairs))
    return client.update_weights(refs={"token": token})
