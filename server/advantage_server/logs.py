"""Log setup for ``advantage-server``: plain text (default) or one JSON object per line (``--log-format json``).

Every record logged while a call is being served carries that call's context: ``request_id`` (the
caller's ``x-request-id`` metadata, or one the server made up; it is echoed back in the call's trailing
metadata either way), ``method`` and ``estimator``. The JSON format writes them as fields::

    {"time": "2026-01-02T03:04:05.678Z", "level": "DEBUG", "logger": "advantage_server",
     "message": "ComputeAdvantage gae rewards=[8] ... -> OK in 1.2 ms (peer ipv4:127.0.0.1:40000)",
     "request_id": "run7-step42", "method": "ComputeAdvantage", "estimator": "gae"}

As everywhere in the server, no record holds tensor values or credentials.
"""
from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
from typing import IO, Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: the call being served by this thread: {"request_id": ..., "method": ..., "estimator": ...}
CALL: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("advantage_call", default=None)

_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class CallContextFilter(logging.Filter):
    """Copies the current call's context (:data:`CALL`) onto each record, as attributes."""

    def filter(self, record: logging.LogRecord) -> bool:
        call = CALL.get()
        if call:
            for key, value in call.items():
                if not hasattr(record, key):
                    setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the call's context,
    any ``extra=`` fields, and ``exception`` with the formatted traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "text", stream: IO[str] | None = None) -> logging.Handler:
    """Send every log record of the process to ``stream`` (default stderr) as ``fmt`` ("text" or "json"),
    at ``level`` and above, through a root handler (replacing the one an earlier call installed; handlers
    others installed stay). Returns the new handler."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(CallContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler._advantage_server = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_advantage_server", False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
