"""What every multi-rank executor derives from its `call_all` (one outcome dict per rank)."""

from __future__ import annotations


class AllRankCalls:
    def call_all(self, method: str, *args, timeout: float = 60.0, **kwargs) -> list[dict]:
        raise NotImplementedError

    def collective_rpc(self, method: str, *args, timeout: float = 60.0, **kwargs) -> list:
        """Every rank's result, or one error naming every rank that failed."""
        outcomes = self.call_all("collective_rpc", method, *args, timeout=timeout, **kwargs)
        bad = [o for o in outcomes if not o["ok"]]
        if bad:
            raise RuntimeError("; ".join(o["error"] for o in bad))
        return [o["result"] for o in outcomes]

    def alive(self, timeout: float = 2.0) -> list[bool]:
        return [o["ok"] for o in self.call_all("collective_rpc", "ping", timeout=timeout)]
