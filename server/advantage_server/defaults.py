"""The server's default limits: the defaults of ``advantage-server``'s flags and of :class:`~advantage_server.limits.Limits`.

A module of constants with no imports, so that ``advantage-server``'s argument parser (``advantage_server.cli``)
builds without importing torch, numba or the client (an out-of-range flag is answered at once);
:mod:`advantage_server.limits` re-exports them.
"""
from __future__ import annotations

DEFAULT_MAX_MESSAGE_MB = 1024
DEFAULT_MAX_STREAM_MB = 8192  # largest request through the streaming RPC
DEFAULT_MAX_BATCH_ELEMENTS = 1 << 27
DEFAULT_MAX_CONCURRENT_REQUESTS = 32
DEFAULT_WORKERS = 8
DEFAULT_STREAM_IDLE_TIMEOUT = 30.0  # seconds an admitted upload may go without receiving request bytes
DEFAULT_MIN_UPLOAD_RATE_KIB = 1024  # KiB/s a streamed upload must keep up (over the window below); 0: no check
DEFAULT_UPLOAD_RATE_WINDOW = 5.0  # seconds the upload rate is measured over (also the grace before the first check)
#: MiB of HTTP/2 stream window the server announces, fixed (0: gRPC's BDP auto-tuning, unbounded): the most of a
#: body gRPC receives for a call that waits for its place (server.py, STREAM_WINDOW)
DEFAULT_STREAM_WINDOW_MB = 4
DEFAULT_MAX_SHM_REGIONS_PER_CLIENT = 64  # shared-memory regions one client (connection) may hold registered
