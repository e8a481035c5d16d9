"""A raw HTTP/2 gRPC caller for the adversarial benchmark and tests: it does what grpcio never lets a client do.

:class:`RawH2` opens one TCP connection, speaks just enough HTTP/2 (RFC 9113) to send gRPC calls, answers the
server's PINGs and SETTINGS (so keepalive finds it alive), and never sends ``WINDOW_UPDATE``: with
``window=0`` (``SETTINGS_INITIAL_WINDOW_SIZE`` 0) the server can send it no response bytes at all, so every result
it computes for this connection stays buffered in the server. Headers are HPACK literals without indexing or
Huffman coding (RFC 7541 section 6.2.2), which every decoder must accept. It is an attack tool: one thread
reads the socket (PINGs, SETTINGS), the caller's thread writes calls.

Used by ``advantage-bench --sections adversarial`` (``unread-results``) and tests/test_ledger.py.
"""
from __future__ import annotations

import socket
import struct
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 0x4


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out, value = [limit], value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """One header as a literal without indexing, new name, no Huffman coding (first byte 0x00)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n)) + n + _hpack_int(len(v)) + v


class RawH2:
    """One HTTP/2 connection to ``host:port`` (cleartext) that never reads its responses (see the module
    docstring). ``window``: the stream window it announces (0: no response bytes can come). Thread-safe for
    :meth:`call`; :meth:`close` ends it."""

    def __init__(self, host: str, port: int, window: int = 0, timeout: float = 10.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.authority = f"{host}:{port}"
        self._lock = threading.Lock()
        self._next = 1
        self.closed = threading.Event()
        self.goaway = False
        self.resets = 0
        self.frames: dict[int, int] = {}
        self._send(PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, window)))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _read(self) -> None:
        """Answers PING and SETTINGS; counts the frames it gets; never opens a window."""
        self.sock.settimeout(None)
        try:
            while True:
                head = self._recv(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                payload = self._recv(length) if length else b""
                self.frames[kind] = self.frames.get(kind, 0) + 1
                if kind == PING and not flags & ACK:
                    self._send(_frame(PING, ACK, 0, payload))
                elif kind == SETTINGS and not flags & ACK:
                    self._send(_frame(SETTINGS, ACK, 0, b""))
                elif kind == RST_STREAM:
                    self.resets += 1
                elif kind == GOAWAY:
                    self.goaway = True
        except (OSError, ConnectionError):
            pass
        finally:
            self.closed.set()

    def call(self, path: str, message: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """Send one gRPC call (``path`` ``/package.Service/Method``, one serialized request ``message``) on a
        new stream and return its stream id; its response is never read."""
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self.authority),
                   ("content-type", "application/grpc"), ("te", "trailers"), *metadata]
        block = b"".join(_literal(k, v) for k, v in headers)
        body = b"\x00" + struct.pack(">I", len(message)) + message
        with self._lock:
            stream, self._next = self._next, self._next + 2
            self.sock.sendall(_frame(HEADERS, END_HEADERS, stream, block) + _frame(DATA, END_STREAM, stream, body))
        return stream

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.closed.wait(2)


def big_result_request(tokens: int = 1 << 21) -> bytes:
    """A packed GRPO request of a few dozen bytes whose result is ``tokens`` float32 advantages (``cu_seqlens``
    ``[0, tokens]``, one sample, one reward): 8 MiB of result per 80-odd request bytes at the default."""
    import numpy as np

    from advantage_client.streaming import build_request_bytes
    return build_request_bytes("grpo", {"normalize_rewards": False, "use_leave_one_out_baseline": False},
                               cu_seqlens=np.array([0, tokens], np.int64), prompt_ids=np.zeros(1, np.int64),
                               rewards=np.ones(1, np.float32))
