"""Finding the service's replicas on a Ray cluster, and a client that follows them as Ray replaces them.

    from advantage_client import AdvantageClient, AsyncAdvantageClient
    client = AdvantageClient.from_ray(namespace="advantage")            # in a Ray driver or actor
    client = await AsyncAdvantageClient.from_ray(namespace="advantage")  # asyncio twin

``advantage-ray up`` (``advantage_server.ray_deploy``) starts each replica as a detached Ray actor named
``<name>-replica-<i>`` in a Ray namespace; each runs ``advantage-server`` in its own process and answers
``info()`` with its ``host:port`` (the node's IP and the port it bound). When a replica's process dies, Ray
restarts the actor (``max_restarts``), the server starts again, and ``info()`` answers the new address
(another node, or another port when the replica was started on ``--port 0``).

The client side of that contract lives here, apart from :mod:`advantage_client.client` (which imports this
module only inside :meth:`~advantage_client.AdvantageClient.from_ray`): ``ray`` is imported only when one of
these functions runs, so ``advantage-client`` stays installable without Ray, and this module imports no
client module (the client classes are handed in), so nothing here imports anything that imports it back.

:class:`RayClient` / :class:`AsyncRayClient`: what ``from_ray`` returns. They hold an ordinary client built on
the replicas' addresses (round_robin over the replicas that report SERVING, UNAVAILABLE retried with backoff
on another one: :mod:`advantage_client.channel`), re-read the addresses every ``refresh_s`` seconds (a
background thread, or task for asyncio) and at once when a call fails with UNAVAILABLE after those retries;
when the set of addresses changed, or a replica answers from a new process at its old address (Ray restarted
it on a fixed ``--port``; told apart by the pid and start time in its ``info()``), they build a new client on
the new set (calls in progress finish on the old one, closed when its last call ends) and the call that failed
is sent once more on it. When that look-up
finds no live replica (the only one died and Ray is still restarting it: gRPC's retries, about 1.5 s of
backoff, run out before a restart, 1-2 s), they look again every ``POLL_S`` seconds until one answers or the
call's own deadline (the client's ``timeout``, else ``wait_s``) is spent, then send the call once more.

A replica whose process hangs (SIGSTOPped, or wedged) keeps its TCP connection and its last health status, so
gRPC sends it a share of the calls until the client's HTTP/2 keepalive PINGs go unanswered (about 4 s,
:func:`advantage_client.channel.make_channel`): then its connection fails, the calls on it end UNAVAILABLE and
the client's failover sends each once more to another replica (``advantage_client.client.Failover``), and gRPC
cannot connect to it again (its handshake is never answered). A look-up also drops it: once one replica
answered ``info()``, the others get ``STALL_S`` (1 s) more, and one that has not answered by then is left out of
the new set (it comes back at a later look-up once it answers). An attempt the client's failover sends again
after its connection failed starts such a look-up at once (in the background), as does a call that fails
DEADLINE_EXCEEDED, so a hung replica is dropped within about ``STALL_S`` + 1 s of the first call to it that
failed, and at the latest at the next periodic look-up (``refresh_s`` + ``STALL_S``).

Token: ``advantage-ray up`` without ``--auth-token-file`` (and without ``--insecure``) has the replicas require a
token it generated, which each replica actor hands out through Ray (``auth_token()``): when neither ``token`` nor
``token_file`` is given, the client asks a replica for it (:func:`replica_token`). Whoever can run a Ray driver
on that cluster can read it; that is the trust boundary (such a driver can run any code on the nodes anyway).
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any, Callable

import grpc

from advantage_client.errors import AdvantageServiceError

#: ``advantage-ray``'s defaults: the deployment's name and its Ray namespace
DEFAULT_NAME = "advantage"
DEFAULT_NAMESPACE = "advantage"
#: replica ``i`` of deployment ``name`` is the named actor ``f"{name}{REPLICA_INFIX}{i}"``
REPLICA_INFIX = "-replica-"
#: seconds between two look-ups of the replicas' addresses (also done at once on UNAVAILABLE)
DEFAULT_REFRESH_S = 10.0
#: seconds a look-up waits for the replicas' answers (a replica Ray is restarting answers later)
DEFAULT_LOOKUP_TIMEOUT_S = 5.0
#: seconds a client's look-up waits for the other replicas once one has answered: one still silent then (a hung
#: or SIGSTOPped process, or one Ray is restarting) is left out of the new set until it answers again
STALL_S = 1.0
#: seconds between two look-ups while no replica is alive after a call failed UNAVAILABLE
POLL_S = 0.2
#: the channel argument giving each client built here connections of its own (see ``_Slot``)
LOCAL_SUBCHANNEL_POOL = ("grpc.use_local_subchannel_pool", 1)


def replica_actor_name(name: str, index: int) -> str:
    """The Ray actor name of replica ``index`` of deployment ``name`` (``advantage-replica-0``)."""
    return f"{name}{REPLICA_INFIX}{int(index)}"


def replica_index(actor_name: str, name: str) -> int | None:
    """The index of a replica of ``name`` from its actor name, or None for any other actor."""
    prefix = f"{name}{REPLICA_INFIX}"
    rest = actor_name[len(prefix):] if actor_name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def import_ray() -> Any:
    """``import ray``, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError("from_ray and advantage-ray need Ray: pip install 'advantage-service[ray]' (the server) "
                          "or pip install ray (a client)") from None
    return ray


def connect(address: str | None = None, namespace: str | None = None) -> Any:
    """The ``ray`` module, connected: the process's connection when it has one (a trainer's driver or actor;
    ``address`` is then ignored), else ``ray.init(address=address)`` with ``address`` None meaning
    ``$RAY_ADDRESS`` or ``"auto"`` (the cluster this node belongs to), never a new local cluster.
    Raises ``ConnectionError`` (Ray's) when no cluster is found there."""
    ray = import_ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "auto"
        _reachable(address)
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    return ray


def _reachable(address: str, timeout: float = 5.0) -> None:
    """A ``host:port`` Ray address that does not accept a TCP connection is a ``ConnectionError`` now (Ray
    itself retries it for minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster at {address} ({exc.strerror or exc}): give the head node's GCS "
                              "address (`ray status` there shows it; default port 6379)") from None


def replica_handles(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE,
                    address: str | None = None) -> list[tuple[int, Any]]:
    """``[(index, actor handle), ...]`` of the replicas of ``name`` in ``namespace`` registered with Ray now
    (alive, or being restarted), by index. A replica whose restarts are spent is no longer registered."""
    ray = connect(address, namespace)
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        index = replica_index(entry["name"], name) if entry["namespace"] == namespace else None
        if index is None:
            continue
        try:
            out.append((index, ray.get_actor(entry["name"], namespace=namespace)))
        except ValueError:  # gone between the listing and the look-up
            continue
    return sorted(out, key=lambda item: item[0])


def _answered(ray: Any, refs: list, timeout: float, stall: float | None) -> set:
    """The refs of ``refs`` ready within ``timeout`` seconds; with ``stall``, those ready within ``stall`` seconds
    of the first one (and within ``timeout``)."""
    if not refs:
        return set()
    if stall is None:
        return set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
    deadline = time.monotonic() + timeout
    done, pending = ray.wait(refs, num_returns=1, timeout=timeout)
    if done and pending:
        more, _ = ray.wait(pending, num_returns=len(pending),
                           timeout=max(0.0, min(stall, deadline - time.monotonic())))
        done = [*done, *more]
    return set(done)


def replica_infos(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *, address: str | None = None,
                  timeout: float = DEFAULT_LOOKUP_TIMEOUT_S, stall: float | None = None) -> list[dict[str, Any]]:
    """What each replica of ``name`` reports (its ``info()``: ``index``, ``address`` ``"host:port"``, ``pid``,
    ``node_id``, ``node_ip``, ``device``, ``restarted``, ``serving``, ``requests``), plus ``state``:
    ``"ALIVE"`` (answered, serving), ``"STOPPED"`` (answered, but its server was stopped through the actor's
    ``stop()``: Ray does not restart it, it serves nothing), ``"PENDING"`` (no answer in time: being started
    or restarted by Ray, busy stopping, or hung) or ``"DEAD"`` (its actor died for good); the last two carry
    ``index`` only. The answers are awaited together: the whole look-up takes ``timeout`` seconds at most;
    with ``stall`` (seconds), a replica that has not answered ``stall`` seconds after the first one did is
    PENDING (a client's look-up: a hung replica must not hold it for ``timeout``)."""
    ray = connect(address, namespace)
    handles = replica_handles(name, namespace, address)
    refs = [handle.info.remote() for _, handle in handles]
    ready = _answered(ray, refs, timeout, stall)
    out = []
    for (index, _), ref in zip(handles, refs):
        if ref not in ready:
            out.append({"index": index, "state": "PENDING"})
            continue
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError:
            out.append({"index": index, "state": "DEAD"})
            continue
        out.append({**info, "state": "ALIVE" if info.get("serving", True) else "STOPPED"})
    return out


def replica_token(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *, address: str | None = None,
                  timeout: float = DEFAULT_LOOKUP_TIMEOUT_S) -> str | None:
    """The bearer token ``advantage-ray up`` generated for the replicas of ``name`` (each replica actor's
    ``auth_token()``), from the first replica that answers within ``timeout`` seconds; None when the
    replicas hold none (``--insecure``, or ``--auth-token-file``: give that file's token yourself) or none
    answered. Readable by any Ray driver of the cluster (the trust boundary of a generated token)."""
    ray = connect(address, namespace)
    refs = []
    for _, handle in replica_handles(name, namespace, address):
        try:
            refs.append(handle.auth_token.remote())
        except AttributeError:  # a replica started by an older advantage-ray: it has no generated token
            continue
    deadline = time.monotonic() + timeout
    while refs:
        done, refs = ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            return None
        try:
            token = ray.get(done[0])
        except ray.exceptions.RayError:
            continue
        if token:
            return str(token)
    return None



def replica_addresses(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *, address: str | None = None,
                      timeout: float = DEFAULT_LOOKUP_TIMEOUT_S) -> list[str]:
    """The ``host:port`` of every replica of ``name`` that answered within ``timeout`` seconds and serves
    (not stopping), sorted; empty when none did."""
    return sorted(replica_incarnations(name, namespace, address=address, timeout=timeout))


def replica_incarnations(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *,
                         address: str | None = None, timeout: float = DEFAULT_LOOKUP_TIMEOUT_S,
                         stall: float | None = None) -> dict[str, str]:
    """``{"host:port": incarnation}`` of every replica of ``name`` that answered within ``timeout`` seconds (and,
    with ``stall``, within ``stall`` seconds of the first answer: see :func:`replica_infos`) and serves (not
    stopped); the incarnation, ``"<node_id>/<pid>/<started_at>"``, tells a replica restarted on the same address
    (a fixed ``--port``) from the process that was there before."""
    return {info["address"]: f"{info.get('node_id')}/{info.get('pid')}/{info.get('started_at')}"
            for info in replica_infos(name, namespace, address=address, timeout=timeout, stall=stall)
            if info["state"] == "ALIVE"}


def _none_found(name: str, namespace: str, waited: float) -> AdvantageServiceError:
    return AdvantageServiceError(
        grpc.StatusCode.UNAVAILABLE,
        f"no replica of {name!r} in Ray namespace {namespace!r} answered within {waited:g}s: start them with "
        f"`advantage-ray up --name {name} --namespace {namespace}`, or check `advantage-ray status --name {name} "
        f"--namespace {namespace}` (and that this process is connected to the same Ray cluster)")


def _check(refresh_s: float | None, lookup_timeout: float, wait_s: float) -> None:
    if refresh_s is not None and not refresh_s > 0:
        raise ValueError(f"refresh_s={refresh_s!r}: give seconds > 0, or None for no periodic look-up")
    if not lookup_timeout > 0:
        raise ValueError(f"lookup_timeout={lookup_timeout!r}: give seconds > 0")
    if not wait_s >= 0:
        raise ValueError(f"wait_s={wait_s!r}: give seconds >= 0")


class _Slot:
    """One inner client and the calls using it, built on ``found`` (:func:`replica_incarnations`);
    ``retired`` once a newer look-up replaced it."""

    __slots__ = ("client", "found", "addresses", "users", "retired")

    def __init__(self, factory: Callable[..., Any], found: dict[str, str], client_kwargs: dict[str, Any],
                 on_timeout: Callable[[], None] | None = None):
        self.found = dict(found)
        self.addresses = sorted(found)
        # connections of its own: gRPC shares a process-wide pool of connections between channels with the same
        # address and arguments, so a client rebuilt on the address of a replica restarted there would take
        # over the old client's connection, still waiting out its reconnect backoff (calls failed "Connection
        # refused" for ~1.5 s while the restarted server listened)
        options = (*client_kwargs.get("channel_options", ()), LOCAL_SUBCHANNEL_POOL)
        self.client = factory(self.addresses, **{**client_kwargs, "channel_options": options})
        # an attempt whose connection failed (a hung replica found by the keepalive) and that the client's
        # failover sends again to another replica starts the look-up that drops it, as DEADLINE_EXCEEDED does
        self.client._on_timeout = on_timeout
        self.users, self.retired = 0, False

    def current(self, found: dict[str, str]) -> bool:
        """Whether a look-up's answer is what this client was built on: the same replica processes at the same
        addresses. A replica Ray restarted on the same address (a fixed ``--port``) is a new process: the
        client is rebuilt (a fresh channel) and a call that failed while it was down is sent once more."""
        return found == self.found


class _Lookup:
    """The look-up that :class:`RayClient` and :class:`AsyncRayClient` share (blocking; Ray calls)."""

    def __init__(self, name: str, namespace: str, address: str | None, lookup_timeout: float):
        self.name, self.namespace, self.address, self.lookup_timeout = name, namespace, address, lookup_timeout

    def __call__(self, timeout: float | None = None) -> dict[str, str]:
        """:func:`replica_incarnations`, waiting ``timeout`` seconds at most (``lookup_timeout`` when None) and
        ``STALL_S`` for the others once one replica answered (a hung one is left out)."""
        wait = self.lookup_timeout if timeout is None else max(0.05, min(timeout, self.lookup_timeout))
        return replica_incarnations(self.name, self.namespace, address=self.address, timeout=wait, stall=STALL_S)

    def client_kwargs(self, client_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``client_kwargs`` with ``token`` set to the replicas' generated token (:func:`replica_token`) when
        neither ``token`` nor ``token_file`` is given and the replicas hold one."""
        if client_kwargs.get("token") is not None or client_kwargs.get("token_file") is not None:
            return client_kwargs
        token = replica_token(self.name, self.namespace, address=self.address, timeout=self.lookup_timeout)
        return {**client_kwargs, "token": token} if token else client_kwargs

    def first(self, wait_s: float) -> dict[str, str]:
        """The addresses, looking again until at least one replica answers or ``wait_s`` seconds passed."""
        start = time.monotonic()
        while True:
            found = self()
            if found or time.monotonic() - start >= wait_s:
                if not found:
                    raise _none_found(self.name, self.namespace, time.monotonic() - start)
                return found
            time.sleep(0.25)


def _call_deadline(client: Any, method: str, args: tuple, wait_s: float) -> float:
    """``time.monotonic()`` by which a call that failed UNAVAILABLE must have found a live replica again: its
    own timeout (``wait_ready``'s argument, else the client's ``timeout``; ``wait_s`` when that is None),
    counted from now (the failed call's gRPC retries used part of it; the resent call gets its own)."""
    timeout = args[0] if method == "wait_ready" and args else getattr(client, "timeout", None)
    return time.monotonic() + (wait_s if timeout is None else float(timeout))


class RayClient:
    """What :meth:`AdvantageClient.from_ray <advantage_client.AdvantageClient.from_ray>` returns: an
    :class:`~advantage_client.AdvantageClient` on the replicas' current addresses, replaced when they change
    (see the module docstring). ``compute``, ``list_estimators`` and ``wait_ready`` are the client's, with the
    look-up and one more try on UNAVAILABLE, and a look-up started in the background on DEADLINE_EXCEEDED (also
    on an attempt whose connection failed, sent again by the client's failover; a hung replica is dropped within about
    ``STALL_S`` + 1 s); every other attribute is the
    current client's. Without ``token``/``token_file`` the client uses the token ``advantage-ray up``
    generated, read from a replica (:func:`replica_token`). Thread-safe; use as a context manager or call
    :meth:`close`.

    factory: the client class (``AdvantageClient``), called as ``factory(addresses, **client_kwargs)``.
    name, namespace: the deployment (``advantage-ray up --name --namespace``). address: the Ray cluster, for a
    process not yet connected (see :func:`connect`). refresh_s: seconds between look-ups (None: only on
    UNAVAILABLE). lookup_timeout: seconds one look-up waits for the replicas' answers. wait_s: at creation,
    seconds to wait for a first replica. Raises :class:`AdvantageServiceError` (UNAVAILABLE) when no replica
    answered within ``wait_s``, ``ImportError`` without Ray, ``ValueError`` for bad options.
    """

    def __init__(self, factory: Callable[..., Any], *, name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE,
                 address: str | None = None, refresh_s: float | None = DEFAULT_REFRESH_S,
                 lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT_S, wait_s: float = 30.0, **client_kwargs: Any):
        _check(refresh_s, lookup_timeout, wait_s)
        self._lookup = _Lookup(name, namespace, address, lookup_timeout)
        self.wait_s = wait_s
        found = self._lookup.first(wait_s)
        self._factory, self._kwargs = factory, self._lookup.client_kwargs(client_kwargs)
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._stall_lookup: threading.Thread | None = None
        self._slot = _Slot(factory, found, self._kwargs, self._look_soon)
        self._closed = threading.Event()
        self.refresh_s = refresh_s
        self._thread: threading.Thread | None = None
        if refresh_s is not None:
            self._thread = threading.Thread(target=self._refresh_loop, name="advantage-ray-refresh", daemon=True)
            self._thread.start()

    @property
    def addresses(self) -> list[str]:
        """The replica addresses the current client was built on."""
        return list(self._slot.addresses)

    def refresh(self) -> bool:
        """Look the addresses up now; when they changed (and some replica answered), or a replica was restarted
        on its old address, switch to a client on the new set. Returns whether it switched. A look-up that
        fails (Ray unreachable) keeps the current set."""
        return self._refresh()[0]

    def _refresh(self, timeout: float | None = None) -> tuple[bool, bool]:
        """:meth:`refresh` (look-up waiting ``timeout`` seconds at most); returns (switched, some replica
        alive)."""
        with self._refresh_lock:
            if self._closed.is_set():
                return False, False
            try:
                found = self._lookup(timeout)
            except Exception:  # noqa: BLE001 - Ray down or restarting: keep what works
                return False, False
            if not found or self._slot.current(found):
                return False, bool(found)
            new = _Slot(self._factory, found, self._kwargs, self._look_soon)
            with self._lock:
                old, self._slot = self._slot, new
                old.retired = True
                close_old = old.users == 0
            if close_old:
                old.client.close()
            return True, True

    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.refresh_s):
            self.refresh()

    def _acquire(self) -> _Slot:
        with self._lock:
            if self._closed.is_set():
                raise ValueError("the client is closed")
            slot = self._slot
            slot.users += 1
            return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.users -= 1
            close = slot.retired and slot.users == 0
        if close:
            slot.client.close()

    def _look_soon(self) -> None:
        """After a call failed DEADLINE_EXCEEDED: a look-up in a thread of its own, now (one at a time), which
        drops a replica that stopped answering (see the module docstring); the caller gets its error at once."""
        with self._lock:
            if self._closed.is_set() or (self._stall_lookup is not None and self._stall_lookup.is_alive()):
                return
            self._stall_lookup = threading.Thread(target=self.refresh, name="advantage-ray-stall", daemon=True)
            self._stall_lookup.start()

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        slot = self._acquire()
        try:
            return getattr(slot.client, method)(*args, **kwargs)
        except AdvantageServiceError as err:
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._look_soon()
            if err.code != grpc.StatusCode.UNAVAILABLE or not self._recover(slot, method, args):
                raise
        finally:
            self._release(slot)
        slot = self._acquire()  # the replicas moved: once more on the client built on their new addresses
        try:
            return getattr(slot.client, method)(*args, **kwargs)
        finally:
            self._release(slot)

    def _recover(self, slot: _Slot, method: str, args: tuple) -> bool:
        """After a call on ``slot`` failed UNAVAILABLE: whether to send it once more. Yes when the look-up
        switched to new addresses or to a replica restarted on its old one (or another call did); no when the
        same replica processes are alive (they answered UNAVAILABLE themselves); when no replica is alive,
        look again every ``POLL_S`` seconds until one is (yes) or the call's deadline is spent (no: the
        UNAVAILABLE stands)."""
        deadline = _call_deadline(slot.client, method, args, self.wait_s)
        switched, alive = self._refresh(deadline - time.monotonic())
        if switched or self._slot is not slot:
            return True
        if alive:
            return False
        while not self._closed.is_set() and time.monotonic() + POLL_S < deadline:
            time.sleep(POLL_S)
            switched, alive = self._refresh(deadline - time.monotonic())
            if switched or alive or self._slot is not slot:
                return True
        return False

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`advantage_client.AdvantageClient.compute` on the current replicas."""
        return self._run("compute", *args, **kwargs)

    def list_estimators(self) -> Any:
        """:meth:`advantage_client.AdvantageClient.list_estimators` on the current replicas."""
        return self._run("list_estimators")

    def wait_ready(self, timeout: float = 10.0) -> None:
        """:meth:`advantage_client.AdvantageClient.wait_ready` on the current replicas."""
        return self._run("wait_ready", timeout)

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self._slot.client, item)

    def close(self) -> None:
        """Stop the look-ups and close the client (a call still running keeps it until it ends)."""
        self._closed.set()
        for thread in (self._thread, self._stall_lookup):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self._lookup.lookup_timeout + 5)
        with self._refresh_lock, self._lock:
            self._slot.retired = True
            close = self._slot.users == 0
        if close:
            self._slot.client.close()

    def __enter__(self) -> "RayClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncRayClient:
    """What ``await AsyncAdvantageClient.from_ray(...)`` returns: the asyncio twin of :class:`RayClient` (same
    options; ``factory`` is ``AsyncAdvantageClient``). Look-ups run in a thread (``asyncio.to_thread``), the
    periodic one as a task of the loop that created it; create and use it inside one event loop. ``compute``
    and ``list_estimators`` are coroutines; :meth:`close` too (or ``async with``)."""

    def __init__(self, factory: Callable[..., Any], lookup: _Lookup, found: dict[str, str],
                 refresh_s: float | None, client_kwargs: dict[str, Any], wait_s: float = 30.0):
        self._factory, self._kwargs, self._lookup = factory, client_kwargs, lookup
        self.wait_s = wait_s
        self._slot = _Slot(factory, found, client_kwargs, self._look_soon)
        self._refresh_lock = asyncio.Lock()
        self._stall_lookup: asyncio.Task | None = None
        self._closed = False
        self.refresh_s = refresh_s
        self._task = asyncio.get_running_loop().create_task(self._refresh_loop()) if refresh_s is not None else None

    @classmethod
    async def create(cls, factory: Callable[..., Any], *, name: str = DEFAULT_NAME,
                     namespace: str = DEFAULT_NAMESPACE, address: str | None = None,
                     refresh_s: float | None = DEFAULT_REFRESH_S, lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT_S,
                     wait_s: float = 30.0, **client_kwargs: Any) -> "AsyncRayClient":
        """Look the replicas up (waiting up to ``wait_s`` for one, in a thread) and build the client; errors
        as :class:`RayClient`."""
        _check(refresh_s, lookup_timeout, wait_s)
        lookup = _Lookup(name, namespace, address, lookup_timeout)
        found = await asyncio.to_thread(lookup.first, wait_s)
        client_kwargs = await asyncio.to_thread(lookup.client_kwargs, client_kwargs)
        return cls(factory, lookup, found, refresh_s, client_kwargs, wait_s)

    @property
    def addresses(self) -> list[str]:
        """The replica addresses the current client was built on."""
        return list(self._slot.addresses)

    async def refresh(self) -> bool:
        """As :meth:`RayClient.refresh`."""
        return (await self._refresh())[0]

    async def _refresh(self, timeout: float | None = None) -> tuple[bool, bool]:
        """As :meth:`RayClient._refresh`."""
        async with self._refresh_lock:
            if self._closed:
                return False, False
            try:
                found = await asyncio.to_thread(self._lookup, timeout)
            except Exception:  # noqa: BLE001 - Ray down or restarting: keep what works
                return False, False
            if not found or self._slot.current(found):
                return False, bool(found)
            old, self._slot = self._slot, _Slot(self._factory, found, self._kwargs, self._look_soon)
            old.retired = True
            if old.users == 0:
                await old.client.close()
            return True, True

    async def _recover(self, slot: _Slot, method: str, args: tuple) -> bool:
        """As :meth:`RayClient._recover`."""
        deadline = _call_deadline(slot.client, method, args, self.wait_s)
        switched, alive = await self._refresh(deadline - time.monotonic())
        if switched or self._slot is not slot:
            return True
        if alive:
            return False
        while not self._closed and time.monotonic() + POLL_S < deadline:
            await asyncio.sleep(POLL_S)
            switched, alive = await self._refresh(deadline - time.monotonic())
            if switched or alive or self._slot is not slot:
                return True
        return False

    def _look_soon(self) -> None:
        """As :meth:`RayClient._look_soon`: a look-up task of its own, now (one at a time)."""
        if not self._closed and (self._stall_lookup is None or self._stall_lookup.done()):
            self._stall_lookup = asyncio.get_running_loop().create_task(self.refresh())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def _release(self, slot: _Slot) -> None:
        slot.users -= 1
        if slot.retired and slot.users == 0:
            await slot.client.close()

    async def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ValueError("the client is closed")
        slot = self._slot
        slot.users += 1
        try:
            return await getattr(slot.client, method)(*args, **kwargs)
        except AdvantageServiceError as err:
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._look_soon()
            if err.code != grpc.StatusCode.UNAVAILABLE or not await self._recover(slot, method, args):
                raise
        finally:
            await self._release(slot)
        slot = self._slot
        slot.users += 1
        try:
            return await getattr(slot.client, method)(*args, **kwargs)
        finally:
            await self._release(slot)

    def compute(self, estimator: str, config: Any = None, **kwargs: Any) -> Any:
        """:meth:`advantage_client.AsyncAdvantageClient.compute` on the current replicas: a coroutine; the
        call's tensors and config are captured now (``advantage_client.aio.capture``), so the caller may reuse
        its buffers at once, and a resend on a new set of replicas sends the same values."""
        names = ("output_dtype", "as_numpy", "transport", "per_sample", "timeout")
        options = {k: kwargs.pop(k) for k in names if k in kwargs}
        slot = getattr(self, "_slot", None)
        capture = getattr(getattr(slot, "client", None), "capture", None)  # the client class's (no import here)
        cu_seqlens = kwargs.pop("cu_seqlens", None)
        if capture is not None:
            config, cu_seqlens, kwargs = capture(estimator, config, cu_seqlens, kwargs)
        tensors = kwargs
        return self._run("compute", estimator, config, cu_seqlens=cu_seqlens, **options, **tensors)

    async def list_estimators(self) -> Any:
        """:meth:`advantage_client.AsyncAdvantageClient.list_estimators` on the current replicas."""
        return await self._run("list_estimators")

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self._slot.client, item)

    async def close(self) -> None:
        """Stop the look-ups and close the client (a call still running keeps it until it ends)."""
        self._closed = True
        for task in (self._task, self._stall_lookup):
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._slot.retired = True
        if self._slot.users == 0:
            await self._slot.client.close()

    async def __aenter__(self) -> "AsyncRayClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

