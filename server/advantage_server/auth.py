"""Transport security and caller authentication.

* TLS: :func:`server_credentials` builds gRPC server credentials from a PEM certificate chain and key;
  with a client CA it is mutual TLS and a client certificate signed by that CA is required.
* Bearer token: :class:`TokenAuthInterceptor` checks ``authorization: Bearer <token>`` on every call
  except ``grpc.health.v1.Health`` (probes carry no credentials), comparing in constant time
  (:func:`hmac.compare_digest`). A call without the right token is refused with UNAUTHENTICATED
  before its request is decoded. Neither the expected nor the presented token is ever logged.
* Refusals are an entry of the caller's ledger (:class:`AnonymousRefusals`): each host gets a few a second at
  once, the rest are held, without a thread, and answered at a bounded rate, so a caller that sends each refused
  call again at once (issue #35 item 3) floods nobody.
"""
from __future__ import annotations

import collections
import hmac
import itertools
import math
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

import grpc

from advantage_server.identity import call_peer, peer_host

log = logging.getLogger("advantage_server")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
Pem = bytes | str | os.PathLike


def read_pem(value: Pem | None, what: str) -> bytes | None:
    """PEM bytes as given, or read from a path. ``None`` stays ``None``."""
    if value is None or isinstance(value, bytes):
        return value
    path = pathlib.Path(value)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None


def load_token(path: str | os.PathLike) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed). Raises ``ValueError`` when the file
    cannot be read or holds no token; the message never contains the token."""
    try:
        token = pathlib.Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--auth-token-file {path}: cannot read it ({type(exc).__name__})") from None
    if not token:
        raise ValueError(f"--auth-token-file {path}: the file is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"--auth-token-file {path}: the token must be one line of printable characters without spaces")
    return token


def server_credentials(cert: Pem | None, key: Pem | None, client_ca: Pem | None = None
                       ) -> grpc.ServerCredentials | None:
    """TLS server credentials, or ``None`` for a plaintext server (no cert, no key, no client CA)."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    chain, private_key = read_pem(cert, "--tls-cert"), read_pem(key, "--tls-key")
    ca = read_pem(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


class AnonymousRefusals:
    """The ledger's entry for refused calls: what answering calls without the right token may cost (issue #35
    item 3). A refusal is sent at once while the caller's host has budget left (``PER_HOST_PER_S`` a second,
    bursts of as many: a misconfigured client reads why at once, whatever another host sends; and at most
    ``IMMEDIATE_PER_S`` a second over all hosts); past it the call is
    *held*: it stays open in gRPC's core, with no thread, and gets its UNAUTHENTICATED no earlier than ``HOLD_S``
    after it came, at most ``RELEASE_PER_S`` a second over all hosts, the hosts holding calls that are due taking turns
    (each host's own calls first come first answered): a misconfigured client whose refusal is held behind a flood
    from other hosts hears why about ``HOLD_S`` after it asked, not after the flood's held calls (up to ``MAX_HELD /
    RELEASE_PER_S``, 82 s, when they were answered first come first). A caller that
    sends each refused call again at once then sends at most that many a second, however many it keeps
    outstanding; before, about 1,000 outstanding tokenless calls, each sent again as soon as it was refused, left
    token holders 5% (refused in the pool) and then 23-29% (answered UNIMPLEMENTED in gRPC's serve thread) of
    their goodput, pinned. At most ``MAX_HELD`` are held (about 25 KiB each in gRPC's core and Python, measured:
    about 100 MiB in all); past that :meth:`full` is True and :class:`TokenAuthInterceptor` gives the call no
    handler (gRPC answers UNIMPLEMENTED in its serve thread, no pool thread). :meth:`close` answers every held
    call at once (the server's drain; later calls are answered at once).

    A held call's body is never read, but gRPC's core takes in up to its HTTP/2 stream window of it
    (``--stream-window-mb``, 4 MiB: measured +339 MiB for 100 held calls with 8 MiB bodies), and nothing tells
    the server how much. So the process's resident memory is read as each call comes to be held and at each tick
    of the releasing thread; while it is more than ``HELD_MEMORY_BYTES`` above what it was when the first of the
    held calls came, the new call and every held one are answered at once (``valve_opened`` counts it; reading it
    as calls come keeps the valve from waiting for a starved releasing thread on a loaded machine): a flood of large bodies is then answered as it comes (it costs
    the attacker its bandwidth), and the memory it pins stays near the budget. Where ``/proc`` is missing the
    valve is off and ``MAX_HELD`` is ``MAX_HELD_WITHOUT_VALVE``.

    ``clock``: seconds, monotonic (tests pass their own). Counters: ``immediate``, ``held_total``, ``held`` (now)
    and ``valve_opened``."""

    #: refusals answered at once per host a second (a token bucket of as many)
    PER_HOST_PER_S = 10.0
    #: refusals answered at once a second over all hosts (a token bucket of as many): many hosts (a /48 of /64s)
    #: do not add up to a flood either
    IMMEDIATE_PER_S = 100.0
    #: a held call is answered no earlier than this after it came
    HOLD_S = 1.0
    #: held calls answered a second at most, over all hosts: a flood that sends each refused call again sends this
    #: many a second (each still costs gRPC's serve thread, both interceptors and this class's releasing thread a few
    #: hundred microseconds: at 200 a second token holders kept 83-88% of their goodput, pinned)
    RELEASE_PER_S = 50.0
    #: held calls at most; past it the interceptor gives no handler (UNIMPLEMENTED from gRPC's serve thread)
    MAX_HELD = 4096
    #: resident memory the held calls may add (see the class docstring), bytes
    HELD_MEMORY_BYTES = 256 << 20
    #: ``MAX_HELD`` where the valve cannot read the process's memory: at most that many stream windows
    MAX_HELD_WITHOUT_VALVE = 64
    #: hosts whose budget is remembered (hosts with a full bucket are forgotten first)
    MAX_HOSTS = 4096
    #: how often the releasing thread looks at the queue, seconds
    TICK_S = 0.02
    #: the releases a late tick may catch up on, in seconds of ``RELEASE_PER_S``
    BURST_S = 0.1
    #: the resident memory is read as calls come to be held at most once per this many seconds
    CHECK_S = 0.005

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._held: dict[int, tuple[float, Callable[[Any], None]]] = {}  # in arrival order (first = oldest)
        #: host -> its held calls' keys, oldest first (keys of calls forgotten are skipped); the order is the hosts'
        #: turns for the next release (a host that had one goes last)
        self._turns: collections.OrderedDict[str, collections.deque[int]] = collections.OrderedDict()
        self._keys = itertools.count()
        self._budgets: dict[str, tuple[float, float]] = {}  # host -> (tokens, when last filled)
        self._all = (self.IMMEDIATE_PER_S, clock())  # the budget over all hosts: (tokens, when last filled)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.immediate = self.held_total = self.valve_opened = 0
        # imported here: the CLI checks its flags (and imports this module) before torch, which limits pulls in
        from advantage_server.limits import _resident_bytes
        self._resident: Callable[[], int | None] = _resident_bytes
        self._memory_base: int | None = None  # resident bytes when the first of the held calls came
        self._valve = False  # set by refuse() when a new call found the memory past the budget
        self._checked_at = -math.inf  # when refuse() last read the resident memory
        if self._resident() is None:
            self.MAX_HELD = min(self.MAX_HELD, self.MAX_HELD_WITHOUT_VALVE)

    @property
    def held(self) -> int:
        """Calls held now."""
        return len(self._held)

    def full(self) -> bool:
        """True when ``MAX_HELD`` calls are held (read without the lock: the interceptor asks it per call)."""
        return len(self._held) >= self.MAX_HELD

    def _spend(self, host: str, now: float) -> bool:
        """One refusal from ``host``'s budget and the budget over all hosts (under the lock); False when either is
        spent."""
        tokens, filled = self._budgets.pop(host, (self.PER_HOST_PER_S, now))
        tokens = min(self.PER_HOST_PER_S, tokens + (now - filled) * self.PER_HOST_PER_S)
        if len(self._budgets) >= self.MAX_HOSTS:
            # forget the least recent hosts: those whose budget has refilled (nothing to remember), at least one
            del self._budgets[next(iter(self._budgets))]
            while self._budgets:
                other = next(iter(self._budgets))
                t, f = self._budgets[other]
                if t + (now - f) * self.PER_HOST_PER_S < self.PER_HOST_PER_S:
                    break
                del self._budgets[other]
        every = min(self.IMMEDIATE_PER_S, self._all[0] + (now - self._all[1]) * self.IMMEDIATE_PER_S)
        spent = tokens >= 1 and every >= 1
        self._budgets[host] = (tokens - 1 if spent else tokens, now)  # re-inserted: the dict's order is recency
        self._all = (every - 1 if spent else every, now)
        return spent

    def refuse(self, host: str, send: Callable[[Any], None]) -> int | None:
        """Answer a refused call of ``host`` now or later: ``send(None)`` sends its status (gRPC's
        ``send_response_callback`` of a non-blocking handler, whose context already holds the code and details).
        The held call's key (give it to :meth:`forget` when the call ends first), or None when answered now."""
        key = None
        with self._cond:
            now = self._clock()
            hold = not self._closed and not self._spend(host, now) and len(self._held) < self.MAX_HELD
            if hold and self._held and now - self._checked_at >= self.CHECK_S:
                self._checked_at = now
                if self._over_memory():
                    hold, self._valve = False, True  # answered at once, and the releasing thread answers the rest
                    self._cond.notify()
            if hold:
                if not self._held:
                    self._memory_base = self._resident()
                key = next(self._keys)
                self._held[key] = (now + self.HOLD_S, send)
                keys = self._turns.get(host)
                if keys is None:
                    keys = self._turns[host] = collections.deque()
                elif len(keys) > 64 and len(keys) > 2 * len(self._held):  # mostly calls forgotten: compact it
                    keys = self._turns[host] = collections.deque(k for k in keys if k in self._held)
                keys.append(key)
                self.held_total += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._release, name="advantage-refusals", daemon=True)
                    self._thread.start()
                self._cond.notify()
            else:
                self.immediate += 1
        if not hold:
            _send_quietly(send)
        return key

    def forget(self, key: int) -> None:
        """The held call ``key`` ended (its client cancelled it, its deadline passed, its connection closed): it no
        longer counts against ``MAX_HELD``. Nothing when it was answered already."""
        with self._cond:
            self._held.pop(key, None)

    def _over_memory(self) -> bool:
        """Whether the held calls have added more than ``HELD_MEMORY_BYTES`` of resident memory (under the lock)."""
        if self._memory_base is None:
            return False
        resident = self._resident()
        return resident is not None and resident - self._memory_base > self.HELD_MEMORY_BYTES

    def _due(self) -> list[Callable[[Any], None]]:
        """The held calls to answer now (under the lock), within the release budget ``self._allowance``."""
        now = self._clock()
        valve, self._valve = self._valve or (bool(self._held) and self._over_memory()), False
        if valve:
            self.valve_opened += 1
        self._allowance = min(self.RELEASE_PER_S * self.BURST_S,
                              self._allowance + (now - self._last) * self.RELEASE_PER_S)
        self._last = now
        if self._closed or valve:  # every held call, now
            due = [send for _, send in self._held.values()]
            self._held.clear()
            self._turns.clear()
            return due
        due = []
        while self._held and self._allowance >= 1:
            key = self._next_turn(now)
            if key is None:
                break
            due.append(self._held.pop(key)[1])
            self._allowance -= 1
        return due

    def _next_turn(self, now: float) -> int | None:
        """The key of the held call to answer next (under the lock): the oldest call of the first host, in turn
        order, whose oldest held call is due; that host goes last. None when no host's call is due."""
        if not self._held or self._held[next(iter(self._held))][0] > now:  # not even the oldest call is due
            return None
        for host in list(self._turns):
            keys = self._turns[host]
            while keys and keys[0] not in self._held:  # answered or forgotten
                keys.popleft()
            if not keys:
                del self._turns[host]
                continue
            if self._held[keys[0]][0] <= now:
                self._turns.move_to_end(host)
                return keys.popleft()
        return None

    def _release(self) -> None:
        """The releasing thread: every ``TICK_S`` the held calls that are due, within the rate."""
        self._allowance, self._last = 0.0, self._clock()
        while True:
            with self._cond:
                while not self._held and not self._closed:
                    self._cond.wait()
                    self._last = max(self._last, self._clock() - self.TICK_S)
                due, done = self._due(), self._closed
            for send in due:
                _send_quietly(send)
            if done and not due:
                return
            with self._cond:
                if not self._closed:
                    self._cond.wait(self.TICK_S)

    def close(self) -> None:
        """Answer every held call now, and every later one at once; the releasing thread ends."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=5.0)


def _send_quietly(send: Callable[[Any], None]) -> None:
    """``send(None)``: the held call's status; nothing when the call has ended or the server has stopped."""
    try:
        send(None)
    except Exception:  # noqa: BLE001 - a call cancelled or a server stopped under it
        pass


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health checks unless it carries ``authorization: Bearer <token>``.

    A refused call gets UNAUTHENTICATED and its message from a non-blocking handler: it runs on the server's pool
    only to read the call's peer, and holds no thread while it waits. :class:`AnonymousRefusals` decides when it
    is answered (at once within the host's budget, else held). When ``MAX_HELD`` calls are held, a tokenless call
    gets no handler and gRPC answers UNIMPLEMENTED in its serve thread (gRPC Python gives an interceptor no peer
    and no way to close a connection; only the handler learns the host)."""

    #: at most one WARNING per this many seconds for refused calls (the next one says how many were not logged)
    WARN_INTERVAL = 10.0
    MESSAGE = ("missing or wrong bearer token: send metadata 'authorization: Bearer <token>' "
               "(AdvantageClient(token=...) or token_file=...)")

    def __init__(self, token: str, clock: Callable[[], float] | None = None):
        if not token:
            raise ValueError("empty bearer token")
        self._expected = f"Bearer {token}".encode()
        self._warn_lock = threading.Lock()
        self._next_warning = 0.0
        self._unlogged = 0
        self.refused = 0
        self.dropped = 0  # tokenless calls while AnonymousRefusals.MAX_HELD are held, answered UNIMPLEMENTED by gRPC
        self.refusals = AnonymousRefusals(clock or time.monotonic)
        refusals, message = self.refusals, self.MESSAGE

        def refuse(_requests: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> None:
            context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            context.set_details(message)
            key = refusals.refuse(peer_host(call_peer(context)), send)
            if key is not None and not context.add_callback(lambda: refusals.forget(key)):
                refusals.forget(key)  # it ended already
        # the service's own methods never read a request before this (it is request-streaming: gRPC Python would
        # read a unary handler's whole request message into Python bytes first), and the call holds no thread
        # while it is held (grpc._server calls a non-blocking handler with the send_response_callback and returns)
        refuse.experimental_non_blocking = True  # type: ignore[attr-defined]
        self._refusal = grpc.stream_stream_rpc_method_handler(refuse)

    def _warn(self, method: str) -> None:
        """A WARNING for a refused call, rate-limited: a flood of tokenless calls is not a flood of log lines."""
        now = time.monotonic()
        with self._warn_lock:
            self.refused += 1
            if now < self._next_warning:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._next_warning = self._unlogged, 0, now + self.WARN_INTERVAL
        more = f" ({unlogged} more refused since the last such warning)" if unlogged else ""
        log.warning("refused %s: missing or wrong bearer token%s", method, more)

    def _authorized(self, metadata: Any) -> bool:
        presented = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(presented) != 1:
            return False
        value = presented[0]
        value = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        return hmac.compare_digest(value, self._expected)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        if self.refusals.full():  # gRPC answers UNIMPLEMENTED in its serve thread, no pool thread
            self.dropped += 1
            return None
        self._warn(handler_call_details.method)
        return self._refusal

    def close(self) -> None:
        """Answer the held refusals now (the server's drain)."""
        self.refusals.close()
