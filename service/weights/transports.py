"""The RLHF weight transports behind `POST /update_weights`, besides `{"path": DIR}`.

- `{"group": {...}}`: the trainer joins a process group with the ranks and broadcasts named
  tensors in buckets (gloo on CPU, NCCL on GPU); see `sync.py`.
- `{"refs": {"token": ...}}`: a trainer running as a Ray actor in the service's cluster puts its
  tensors in the object store and deposits the refs in the service's `WeightInbox` actor; the
  controller takes them from there and hands them to every rank. Refs travel in-band (actor
  calls), so Ray tracks who borrows them and frees the objects after the update.

Every source validates names, shapes and dtypes before any rank changes a weight.
"""

from __future__ import annotations

import uuid

from ..lifecycle import CoordinationError
from .sync import DEFAULT_BUCKET_BYTES, TensorMeta

INBOX_NAMESPACE = "latentserve"


class WeightInbox:
    """A mailbox of (name, ObjectRef) parcels, keyed by a token the trainer sends over HTTP."""

    def __init__(self):
        self._parcels: dict[str, list] = {}

    def deposit(self, named_refs: list) -> str:
        token = uuid.uuid4().hex
        self._parcels[token] = list(named_refs)
        return token

    def take(self, token: str) -> list:
        if token not in self._parcels:
            raise KeyError(f"no weights deposited under token {token!r} (already taken, or wrong inbox)")
        return self._parcels.pop(token)

    def pending(self) -> int:
        return len(self._parcels)


def start_inbox() -> tuple[object, str]:
    import ray  # only the Ray backend has an object store (the mp backend serves without Ray)

    name = f"latentserve-inbox-{uuid.uuid4().hex[:8]}"
    actor = ray.remote(num_cpus=0)(WeightInbox).options(name=name, namespace=INBOX_NAMESPACE).remote()
    return actor, name


def sources(model_config, inbox) -> dict:
    """Weight sources for `Coordinator.weight_sources`: (executor, spec, version, timeout) -> outcomes.
    Without an inbox (no Ray: the mp backend) there is no `refs` source."""

    def group(executor, spec, version: int, timeout: float) -> list[dict]:
        if not isinstance(spec, dict) or "port" not in spec or "tensors" not in spec:
            raise CoordinationError(422, 'group needs {"host", "port", "tensors": [{name, shape, dtype}], ...}')
        tensors = spec["tensors"]
        if not isinstance(tensors, list) or not all(isinstance(m, dict) for m in tensors):
            raise CoordinationError(422, "group: tensors must be a list of {name, shape, dtype} objects")
        try:
            metas = [TensorMeta.from_json(m) for m in tensors]
        except (KeyError, TypeError, ValueError) as e:
            raise CoordinationError(422, f"bad tensor list: {e}") from None
        _check(model_config, {m.name: (m.shape, m.dtype) for m in metas})
        host, port, bucket, backend, join_s = _group_options(spec, timeout)
        if not metas:
            raise CoordinationError(422, "group: tensors must name at least one tensor")
        args = (host, port, [m.to_json() for m in metas], version, bucket, backend, join_s)
        return executor.call_ranks("update_weights_from_group", [args] * executor.world_size, timeout)[0]

    def refs(executor, spec, version: int, timeout: float) -> list[dict]:
        if not isinstance(spec, dict) or "token" not in spec:
            raise CoordinationError(422, 'refs needs {"token": ...} from WeightInbox.deposit')
        import ray

        try:
            named_refs = ray.get(inbox.take.remote(spec["token"]), timeout=timeout)
        except Exception as e:
            raise CoordinationError(400, f"refs: {getattr(e, 'cause', None) or e}") from None
        n = executor.world_size
        return executor.call_ranks("update_weights_from_refs", [(named_refs, version)] * n, timeout)[0]

    return {"group": group, "refs": refs} if inbox is not None else {"group": group}


def _group_options(spec: dict, timeout: float) -> tuple[str, int, int, str, float]:
    """host, port, bucket bytes, backend and join timeout of a group spec, checked before any rank
    joins (a bad one would hold every rank in a group that never forms)."""
    host, port = spec.get("host", "127.0.0.1"), spec["port"]
    bucket, backend = spec.get("bucket_bytes", DEFAULT_BUCKET_BYTES), spec.get("backend", "gloo")
    join_s = spec.get("timeout_s", timeout)
    if not isinstance(host, str) or not host:
        raise CoordinationError(422, f"group: host must be a host name or address, got {host!r}")
    if type(port) is not int or not 1 <= port <= 65535:
        raise CoordinationError(422, f"group: port must be an integer in [1, 65535], got {port!r}")
    if type(bucket) is not int or bucket < 1:
        raise CoordinationError(422, f"group: bucket_bytes must be a positive integer, got {bucket!r}")
    if backend not in ("gloo", "nccl"):
        raise CoordinationError(422, f"group: backend must be 'gloo' or 'nccl', got {backend!r}")
    if isinstance(join_s, bool) or not isinstance(join_s, int | float) or not 0 < join_s <= timeout:
        raise CoordinationError(422, f"group: timeout_s must be in (0, {timeout:g}] seconds, got {join_s!r}")
    return host, port, bucket, backend, float(join_s)


def _check(model_config, shapes: dict) -> None:
    from .specs import check_weights

    problems = check_weights(model_config, {n: (tuple(s), _torch_dtype(d)) for n, (s, d) in shapes.items()})
    if problems:
        raise CoordinationError(422, "weight update rejected, nothing changed: " + "; ".join(problems[:20]))


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)
