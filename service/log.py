"""Structured logs: one line per event, `ts level component event key=value ...`."""

from __future__ import annotations

import logging
import os
import sys
import time


class _KVFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        fields = getattr(record, "kv", {})
        kv = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        line = f"{ts} {record.levelname.lower()} {record.name} {record.getMessage()}"
        if kv:
            line += " " + kv
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _fmt(v) -> str:
    s = str(v)
    return f'"{s}"' if (" " in s or not s) else s


class KVLogger:
    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, kv: dict, exc_info=False) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, extra={"kv": kv}, exc_info=exc_info)

    def info(self, event: str, **kv) -> None:
        self._emit(logging.INFO, event, kv)

    def warning(self, event: str, **kv) -> None:
        self._emit(logging.WARNING, event, kv)

    def error(self, event: str, exc_info=False, **kv) -> None:
        self._emit(logging.ERROR, event, kv, exc_info=exc_info)

    def debug(self, event: str, **kv) -> None:
        self._emit(logging.DEBUG, event, kv)


_configured = False


def get_logger(component: str) -> KVLogger:
    global _configured
    if not _configured:
        root = logging.getLogger("latentserve")
        if not root.handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(_KVFormatter())
            root.addHandler(h)
            root.setLevel(os.environ.get("LATENTSERVE_LOG_LEVEL", "INFO").upper())
            root.propagate = False
        _configured = True
    return KVLogger(f"latentserve.{component}")
