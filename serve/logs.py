"""Structured logging: one line per event, `ts=... level=... logger=... event=... key=value ...`."""

from __future__ import annotations

import ctypes
import logging
import sys
import time


def _quote(value: object) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"ts={ts}", f"level={record.levelname.lower()}", f"logger={record.name}",
                 f"event={_quote(record.getMessage())}"]
        for key, value in getattr(record, "fields", {}).items():
            parts.append(f"{key}={_quote(value)}")
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger("serve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def name_thread(name: str) -> None:
    """Gives the calling thread an OS-visible name (`top -H`, /proc/PID/task/TID/comm; Linux keeps 15
    bytes), so a thread's CPU can be told apart from ONNX Runtime's pool (bench/front_end.py)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: names are a convenience only
        pass


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: object) -> None:
    logger.log(level, name, extra={"fields": fields})
