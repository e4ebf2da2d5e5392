"""Zeroed int32 arrival counters for kernels whose programs split a tile's work: each program
counts itself in, and the last to arrive finishes the tile and zeroes its counter. So one buffer
a device serves every launch after it, CUDA graph replays included (kda_step)."""

from __future__ import annotations

import torch


class ArrivalCounters:
    def __init__(self) -> None:
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor | None:
        """n zeroed counters on device; None where a larger buffer would have to be made inside a
        CUDA graph capture (the caller then launches unsplit)."""
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            buf = self.buffers[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        return buf
