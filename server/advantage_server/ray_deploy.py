"""``advantage-ray``: the advantage service as replicas on a Ray cluster (``pip install 'advantage-service[ray]'``).

    advantage-ray up --replicas 2 --num-gpus 1 --namespace advantage --device cuda --auth-token-file /etc/tok
    advantage-ray status --namespace advantage
    advantage-ray down --namespace advantage

and the same from Python: :func:`up`, :func:`status`, :func:`down`. A trainer reaches the replicas with
``AdvantageClient.from_ray(namespace="advantage")`` (:mod:`advantage_client.ray_discovery`).

Each replica is a detached Ray actor named ``<name>-replica-<i>`` in the Ray namespace ``namespace``, placed
by Ray resources (``num_cpus``, ``num_gpus``, custom ``resources``; optionally on one node, ``node_id``, or in
a bundle of a placement group, so that it sits beside a trainer's workers), and restarted by Ray when its
process dies (``max_restarts``, default -1: always). Its process runs the server ``advantage-server`` runs
(:func:`advantage_server.server.create_server`) with the server's own flags (``advantage-server --help``:
device, limits, TLS, bearer token, metrics, ...), parsed by the server's own parser, so a flag means here
what it means there; a replica binds ``--host`` (default 0.0.0.0) on ``--port`` (default here 0, any free
port; a port P gives replica ``i`` the port ``P + i``, and so do ``--metrics-port`` and ``--health-port``) and
reports ``<node IP>:<port>`` (``info()``). A replica that Ray restarts starts its server again and reports its
new address; the client re-reads the addresses (see :mod:`advantage_client.ray_discovery`).

Plain actors, not Ray Serve: the client talks gRPC straight to each replica's server, so the chunked stream
and shared-memory transports keep working (a Serve proxy hop would carry neither), the replicas' own health
service drives the client's round_robin, and the server's limits, TLS and token apply as with any other
deployment. The files a flag names (TLS, token) must exist on every node a replica may run on.

Token by default: without ``--auth-token-file``, ``up`` generates a token (256 random bits), hands it to each
replica actor (an argument of its constructor, so a replica Ray restarts keeps it) and the replicas require it
(``authorization: Bearer``; health checks exempt); ``AdvantageClient.from_ray`` reads it from a replica
(``auth_token()``) when given no token. Any Ray driver of the cluster can read it: that is the trust boundary.
``--insecure`` (``up(insecure=True)``) serves without a token, as before, and the CLI prints a warning.
``status`` health-checks each replica's address (``grpc.health.v1``: SERVING, NOT_SERVING, no answer) and lists
a replica whose server was stopped through its actor's ``stop()`` as STOPPED.

Errors: ``ValueError`` for a bad option or server flag (before anything is started: a fixed port whose last
replica's port ``P + replicas - 1`` passes 65535, a TLS/CA/token file this process cannot read, TLS files
that are not PEM or a key that is not the certificate's, ``--insecure``
with ``--auth-token-file``), ``RuntimeError`` when
the deployment already exists (``up``) or a replica failed to start (its error, e.g. a ``--host`` that is not an
address of its node or a port in use there, named as ``advantage-server`` names it; the replicas started by that
``up`` are removed), ``ImportError`` without Ray.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

# The client package imports torch: this module reaches advantage_client only inside its functions, so that
# `advantage-ray`'s flag errors and --help are answered at once (tests/test_cli_fast.py).
#: the deployment name and the Ray namespace by default: advantage_client.ray_discovery's DEFAULT_NAME and
#: DEFAULT_NAMESPACE, spelled here for that reason (tests/test_cli_fast.py checks that they agree)
DEFAULT_NAME = "advantage"
DEFAULT_NAMESPACE = "advantage"


def _discovery(name: str) -> Callable[..., Any]:
    """``advantage_client.ray_discovery.<name>``, imported when first called."""
    def call(*args: Any, **kwargs: Any) -> Any:
        from advantage_client import ray_discovery
        return getattr(ray_discovery, name)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    return call


connect, import_ray, replica_actor_name, replica_handles, replica_infos = (
    _discovery(name) for name in ("connect", "import_ray", "replica_actor_name", "replica_handles", "replica_infos"))

#: server flags the replica reads itself instead of passing them to ``create_server``
_REPLICA_FLAGS = {"host", "port", "device", "auth_token_file", "grace", "log_level", "log_format", "ipv6_host_prefix"}
#: port flags offset by the replica's index when not 0 (several replicas may share a node)
_PORT_FLAGS = ("port", "metrics_port", "health_port")
#: server flags naming a file the replicas read (checked readable here before anything starts)
_FILE_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")
#: key (in Ray's internal key-value store) of the number of replicas ``up`` started, so that ``status`` can
#: report a replica whose actor Ray has forgotten (restarts spent) as DEAD
_KV_KEY = "advantage-ray/{namespace}/{name}/replicas"


def _check_local(args: argparse.Namespace, replicas: int) -> None:
    """``ValueError`` naming the flag when a fixed port ``P`` leaves no room for ``P + replicas - 1`` (the last
    replica's port), a file flag names a file this process cannot read (TLS, CA, token: checked here so that
    nothing starts; the replicas read them again on their nodes), or the TLS files are not PEM or the key is
    not the certificate's (:func:`advantage_server.preflight.check_tls`)."""
    from advantage_server.preflight import check_tls

    for flag in _PORT_FLAGS:
        port = getattr(args, flag, None)
        if port and port + replicas - 1 > 65535:
            raise ValueError(f"--{flag.replace('_', '-')} {port} with {replicas} replicas: replica i binds "
                             f"{port} + i, up to {port + replicas - 1} > 65535; give a port <= {65536 - replicas}")
    for flag in _FILE_FLAGS:
        path = getattr(args, flag, None)
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"--{flag.replace('_', '-')} {path}: cannot read it here "
                                 f"({exc.strerror or exc})") from None
    # PEM that parses, a key that is the certificate's (advantage-server's own check; the bind is checked by
    # each replica on its node)
    check_tls(args.tls_cert, args.tls_key, args.tls_client_ca)


def _kv(ray: Any) -> Any:
    """Ray's internal key-value store module, or None where this Ray has none."""
    try:
        from ray.experimental import internal_kv
        return internal_kv if internal_kv._internal_kv_initialized() else None
    except Exception:  # noqa: BLE001 - an older/newer Ray without it: status then sees live actors only
        return None


def _recorded_replicas(ray: Any, name: str, namespace: str) -> int:
    kv = _kv(ray)
    try:
        value = kv._internal_kv_get(_KV_KEY.format(namespace=namespace, name=name)) if kv else None
        return int(value) if value else 0
    except Exception:  # noqa: BLE001
        return 0


def _record_replicas(ray: Any, name: str, namespace: str, replicas: int | None) -> None:
    kv = _kv(ray)
    if kv is None:
        return
    key = _KV_KEY.format(namespace=namespace, name=name)
    try:
        if replicas is None:
            kv._internal_kv_del(key)
        else:
            kv._internal_kv_put(key, str(int(replicas)), overwrite=True)
    except Exception:  # noqa: BLE001 - the record only helps status name dead replicas
        return


def server_args(argv: Sequence[str] = ()) -> argparse.Namespace:
    """``argv`` (``advantage-server`` flags) parsed by the server's parser, with ``--port`` 0 unless given.
    Raises ``ValueError`` with argparse's message for a bad flag."""
    from advantage_server.cli import build_parser

    parser = build_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(["--port", "0", *argv])
    except argparse.ArgumentError as exc:
        raise ValueError(f"advantage-server flag {exc}") from None
    if unknown:
        raise ValueError(f"unknown flag(s) {unknown}: neither advantage-ray's nor advantage-server's "
                         "(advantage-server --help)")
    return args


def server_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`advantage_server.server.create_server` a parsed flag set gives: every
    flag whose name is one of its parameters, plus ``auth_token`` read from ``--auth-token-file``. A flag that
    is neither that nor one the replica reads itself (``_REPLICA_FLAGS``) raises ``ValueError`` (a new server
    flag this module would silently drop)."""
    from advantage_server.auth import load_token
    from advantage_server.server import create_server

    params = set(inspect.signature(create_server).parameters)
    values = vars(args)
    unknown = sorted(set(values) - params - _REPLICA_FLAGS)
    if unknown:
        raise ValueError(f"server flag(s) {unknown} have no create_server parameter: advantage_server.ray_deploy "
                         "needs to learn them")
    kwargs = {key: value for key, value in values.items() if key in params and key not in _REPLICA_FLAGS}
    if args.auth_token_file:
        kwargs["auth_token"] = load_token(args.auth_token_file)
    return kwargs


class Replica:
    """One replica: an ``advantage-server`` in this (Ray actor) process. Wrapped with ``ray.remote`` by
    :func:`up`; its constructor runs again each time Ray restarts the actor."""

    def __init__(self, name: str, index: int, argv: Sequence[str], port_offset: bool = True,
                 auth_token: str | None = None):
        import ray

        from advantage_server import logs
        from advantage_server.preflight import check_server_flags
        from advantage_server.server import create_server

        args = server_args(argv)
        if port_offset:  # several replicas may share a node: a fixed port P becomes P + index
            for flag in _PORT_FLAGS:
                if getattr(args, flag):
                    setattr(args, flag, getattr(args, flag) + index)
        logs.configure(args.log_level, args.log_format)
        check_server_flags(args)  # host of this node, ports free, TLS pair: the cause named, not "cannot bind"
        from advantage_server.identity import set_ipv6_host_prefix
        set_ipv6_host_prefix(args.ipv6_host_prefix)
        kwargs = server_kwargs(args)
        self._token = auth_token if auth_token and not args.auth_token_file else None  # a file's token wins
        if self._token:
            kwargs["auth_token"] = self._token
        self.server = create_server(args.host, args.port, args.device, **kwargs)
        self.server.start()
        self.grace = args.grace
        self.serving = True
        context = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        host = node_ip if args.host in ("0.0.0.0", "::", "[::]", "") else args.host.strip("[]")
        self._info = {
            "name": name, "index": index,
            "address": f"[{host}]:{self.server.port}" if ":" in host else f"{host}:{self.server.port}",
            "pid": os.getpid(), "node_id": context.get_node_id(), "node_ip": node_ip,
            "device": str(self.server.core.device), "restarted": bool(context.was_current_actor_reconstructed),
            "tls": self.server.tls, "auth": self.server.auth, "token_from_ray": self._token is not None,
            "started_at": time.time(),
            "metrics_port": self.server.metrics.port if self.server.metrics is not None else None,
        }

    def info(self) -> dict[str, Any]:
        """``name``, ``index``, ``address`` (``host:port`` clients dial), ``pid``, ``node_id``, ``node_ip``,
        ``device``, ``restarted`` (this process is a restart by Ray), ``tls``, ``auth`` (a token is required),
        ``token_from_ray`` (the token is the one ``up`` generated: :meth:`auth_token`), ``started_at``,
        ``metrics_port``, ``serving`` (False once :meth:`stop` ran) and ``requests``: ComputeAdvantage and
        ComputeAdvantageStream calls this process answered OK (the server's ``advantage_requests_total``)."""
        requests = 0.0
        if self.server.metrics is not None:
            for metric in self.server.metrics.registry.collect():
                for sample in metric.samples:
                    if (sample.name == "advantage_requests_total" and sample.labels.get("code") == "OK"
                            and sample.labels.get("method", "").startswith("ComputeAdvantage")):
                        requests += sample.value
        return {**self._info, "serving": self.serving, "requests": int(requests)}

    def auth_token(self) -> str | None:
        """The bearer token ``up`` generated for the replicas (what ``AdvantageClient.from_ray`` uses when given
        none), or None (``--insecure``; or ``--auth-token-file``, whose token is not handed out through Ray)."""
        return self._token

    def stop(self, grace: float | None = None) -> bool:
        """Drain the server (``BoundServer.stop``: NOT_SERVING, new calls UNAVAILABLE, calls in progress finish
        within ``grace`` seconds, default ``--grace``)."""
        if self.serving:
            self.serving = False
            self.server.stop(self.grace if grace is None else grace)
        return True


def _strategy(ray: Any, index: int, node_id: str | None, soft: bool, placement_group: Any,
              bundle_index: int | Sequence[int] | None) -> Any:
    if node_id is not None and placement_group is not None:
        raise ValueError("give node_id or placement_group, not both")
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        group = ray.util.get_placement_group(placement_group) if isinstance(placement_group, str) else placement_group
        bundle = (bundle_index if isinstance(bundle_index, int) else -1 if bundle_index is None
                  else list(bundle_index)[index])
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
    return None


def up(replicas: int = 2, server_argv: Sequence[str] = (), *, name: str = DEFAULT_NAME,
       namespace: str = DEFAULT_NAMESPACE, address: str | None = None, num_cpus: float = 1, num_gpus: float = 0,
       resources: dict[str, float] | None = None, node_id: str | None = None, soft: bool = False,
       placement_group: Any = None, bundle_index: int | Sequence[int] | None = None, max_restarts: int = -1,
       runtime_env: dict[str, Any] | None = None, timeout: float = 300.0,
       insecure: bool = False) -> list[dict[str, Any]]:
    """Start ``replicas`` replicas of deployment ``name`` in Ray namespace ``namespace`` and wait until each
    serves; returns their :meth:`Replica.info` by index.

    Token: with ``--auth-token-file`` in ``server_argv`` the replicas require that file's token; else, unless
    ``insecure``, a token generated here, which each replica actor hands to any Ray driver of the cluster
    (:meth:`Replica.auth_token`; ``AdvantageClient.from_ray`` reads it). ``insecure=True``: no token at all.

    server_argv: ``advantage-server`` flags, as on its command line (``["--device", "cuda", "--workers", "4"]``).
    address: the Ray cluster when this process is not connected yet (None: ``$RAY_ADDRESS`` or ``"auto"``).
    num_cpus, num_gpus, resources: what Ray reserves for each replica (``num_gpus=1``: one GPU, which the
    replica's ``--device auto``/``cuda`` then uses). node_id (+ ``soft``): pin every replica to that node
    (``ray.get_runtime_context().get_node_id()`` of a trainer worker). placement_group (a ``PlacementGroup``
    or the name of a named one) and bundle_index (one bundle for all, one per replica, or None: any bundle):
    place the replicas in a trainer's placement group. max_restarts: Ray restarts a dead replica this many
    times (-1: always). timeout: seconds to wait for all replicas to serve.
    Raises ``ValueError`` (bad option or server flag, ``insecure`` with ``--auth-token-file``), ``RuntimeError`` (``name`` already up in
    ``namespace``; a replica did not start within ``timeout``, with its error: the replicas are removed).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r}: give an integer >= 1")
    if bundle_index is not None and not isinstance(bundle_index, int) and len(list(bundle_index)) != replicas:
        raise ValueError(f"bundle_index: give one index for all replicas or {replicas} (one per replica)")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(f"max_restarts={max_restarts!r}: give -1 (always) or an integer >= 0")
    parsed = server_args(server_argv)
    if insecure and parsed.auth_token_file:
        raise ValueError(f"--insecure serves without a token, --auth-token-file {parsed.auth_token_file} with one: "
                         "give one of them")
    _check_local(parsed, replicas)  # ports in range, files readable: before anything starts
    server_kwargs(parsed)  # every flag checked (and the token read) here, before anything starts
    token = None if insecure or parsed.auth_token_file else secrets.token_urlsafe(32)
    ray = connect(address, namespace)
    if replica_handles(name, namespace):
        raise RuntimeError(f"deployment {name!r} is already up in Ray namespace {namespace!r} (some replicas may "
                           f"be dead: `advantage-ray status`): `advantage-ray down --name {name} --namespace "
                           f"{namespace}` first, then `up` again")
    _record_replicas(ray, name, namespace, replicas)
    actor_class = ray.remote(Replica)
    handles = []
    for index in range(replicas):
        options: dict[str, Any] = dict(
            name=replica_actor_name(name, index), namespace=namespace, lifetime="detached",
            max_restarts=max_restarts, num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4)
        if resources:
            options["resources"] = dict(resources)
        if runtime_env:
            options["runtime_env"] = runtime_env
        strategy = _strategy(ray, index, node_id, soft, placement_group, bundle_index)
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        handles.append(actor_class.options(**options).remote(name, index, list(server_argv), True, token))
    refs = [handle.info.remote() for handle in handles]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    try:
        if pending:
            raise RuntimeError(f"{len(pending)} of {replicas} replica(s) of {name!r} did not start within {timeout:g}s "
                               "(not enough CPUs/GPUs/resources free on the cluster for them? see `ray status`)")
        return [ray.get(ref) for ref in refs]
    except Exception as exc:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        _record_replicas(ray, name, namespace, None)
        if isinstance(exc, ray.exceptions.RayError):
            raise RuntimeError(f"a replica of {name!r} failed to start: {exc}") from None
        raise


#: what ``status`` reports in ``health`` besides a ``grpc.health.v1`` status name (SERVING, NOT_SERVING, ...)
NO_ANSWER, STOPPED, UNCHECKED = "no answer", "stopped", "unchecked"


def health_check(address: str, timeout: float = 2.0, credentials: Any = None,
                 server_name: str | None = None) -> str:
    """``grpc.health.v1.Health/Check`` of the advantage service at ``address`` (``host:port``): the status name
    it answers (``SERVING``, ``NOT_SERVING``, ...), or ``"no answer"`` when the call fails (nothing listens,
    a hung process: no reply within ``timeout`` seconds, a TLS handshake refused). ``credentials``: gRPC
    channel credentials for a TLS replica (``server_name``: the name its certificate was issued for)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from advantage_client.channel import SERVICE_NAME

    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                              timeout=timeout)
        except grpc.RpcError:
            return NO_ANSWER
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _health(info: dict[str, Any], timeout: float, credentials: Any, server_name: str | None) -> str:
    if info["state"] == "STOPPED":
        return STOPPED
    if info["state"] != "ALIVE":
        return "-"
    if info.get("tls") and credentials is None:
        return UNCHECKED  # a TLS replica and no CA to check it with (status --tls-ca)
    return health_check(info["address"], timeout, credentials if info.get("tls") else None, server_name)


def status(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *, address: str | None = None,
           timeout: float = 5.0, health: bool = True, health_timeout: float = 2.0, credentials: Any = None,
           server_name: str | None = None) -> list[dict[str, Any]]:
    """Each replica's :meth:`Replica.info` plus ``state`` (``ALIVE``; ``STOPPED``: answered, but its server was
    stopped through its actor's ``stop()`` and Ray will not restart it; ``PENDING``: being (re)started, or
    hung: no answer within ``timeout`` seconds; or ``DEAD``), by index
    (:func:`advantage_client.ray_discovery.replica_infos`); a replica that ``up`` started but whose actor Ray
    no longer knows (its restarts, ``max_restarts``, are spent) is ``{"index": i, "state": "DEAD"}`` (``up``
    records how many it started in Ray's internal key-value store; ``down`` removes the record). Empty when
    none is up.

    health (default on) adds ``health``: a health check of each ALIVE replica's address from this process
    (:func:`health_check`, ``health_timeout`` seconds, all at once): ``SERVING``, ``NOT_SERVING``, ``"no
    answer"``; ``"stopped"`` for a STOPPED replica, ``"-"`` for PENDING and DEAD ones, ``"unchecked"`` for a
    TLS replica without ``credentials`` (``grpc.ssl_channel_credentials(...)``; ``server_name``: the name its
    certificate was issued for)."""
    ray = connect(address, namespace)
    infos = replica_infos(name, namespace, address=address, timeout=timeout)
    seen = {info["index"] for info in infos}
    dead = [{"index": i, "state": "DEAD"} for i in range(_recorded_replicas(ray, name, namespace)) if i not in seen]
    infos = sorted(infos + dead, key=lambda info: info["index"])
    if health and infos:
        with ThreadPoolExecutor(max_workers=min(16, len(infos))) as pool:
            found = list(pool.map(lambda info: _health(info, health_timeout, credentials, server_name), infos))
        infos = [{**info, "health": state} for info, state in zip(infos, found)]
    return infos


def down(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *, address: str | None = None,
         grace: float = 10.0, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Drain every replica of ``name`` (calls in progress get ``grace`` seconds), then end its actor for good
    (``ray.kill(no_restart=True)``: its process exits and its port is freed) and wait until Ray has forgotten
    its name (at most ``timeout`` seconds). Returns what :func:`status` reported before; ``[]`` when none
    was up. Raises ``ValueError`` for a ``grace`` that is not a finite number >= 0 (as the server's
    ``--grace``), ``RuntimeError`` when a replica is still registered after ``timeout``."""
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace < 0:
        raise ValueError(f"grace={grace!r}: give a finite number of seconds >= 0")
    ray = connect(address, namespace)
    before = status(name, namespace, timeout=min(5.0, timeout), health=False)
    handles = replica_handles(name, namespace)
    if handles:
        ray.wait([handle.stop.remote(grace) for _, handle in handles], num_returns=len(handles),
                 timeout=grace + 5.0)
    for _, handle in handles:
        ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout
    while replica_handles(name, namespace):
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas of {name!r} still registered in {namespace!r} after {timeout:g}s")
        time.sleep(0.1)
    _record_replicas(ray, name, namespace, None)
    return before


def build_parser() -> argparse.ArgumentParser:
    """``advantage-ray``'s flags; ``up`` passes every flag it does not know to the servers."""
    from advantage_server.cli import seconds

    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--name", default=DEFAULT_NAME, help=f"deployment name (default {DEFAULT_NAME})")
    common.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                        help=f"Ray namespace of the replicas (default {DEFAULT_NAMESPACE})")
    common.add_argument("--address", default=None,
                        help="Ray cluster to connect to (default: $RAY_ADDRESS, else auto: this node's cluster)")
    p = argparse.ArgumentParser(prog="advantage-ray", allow_abbrev=False,
                                description="Run the advantage service as replicas on a Ray cluster.")
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", parents=[common], allow_abbrev=False,
                       help="start replicas; every other flag is an advantage-server flag (advantage-server --help)")
    u.add_argument("--replicas", type=int, default=2, help="how many (default 2)")
    u.add_argument("--num-cpus", type=float, default=1, help="CPUs Ray reserves per replica (default 1)")
    u.add_argument("--num-gpus", type=float, default=0, help="GPUs Ray reserves per replica (default 0)")
    u.add_argument("--resources", type=json.loads, default=None,
                   help='custom Ray resources per replica, JSON (e.g. \'{"trainer_node": 0.01}\')')
    u.add_argument("--node-id", help="place every replica on this Ray node (hex node id)")
    u.add_argument("--soft", action="store_true", help="with --node-id: another node when that one is full")
    u.add_argument("--placement-group", help="name of a placement group to place the replicas in")
    u.add_argument("--bundle-index", type=lambda t: [int(x) for x in t.split(",")],
                   help="with --placement-group: one bundle index for all, or one per replica (0,1,...)")
    u.add_argument("--max-restarts", type=int, default=-1, help="restarts per replica (default -1: always)")
    u.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the replicas (default 300)")
    u.add_argument("--insecure", action="store_true",
                   help="serve without a token (default: a generated token, which from_ray reads through Ray, "
                        "unless --auth-token-file)")
    s = sub.add_parser("status", parents=[common], allow_abbrev=False,
                       help="each replica's address, state and health (exit 1 when one is not serving)")
    s.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    s.add_argument("--tls-ca", help="PEM CA bundle that signed TLS replicas' certificate (to health-check them)")
    s.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    s.add_argument("--tls-key", help="PEM key of --tls-cert")
    s.add_argument("--tls-server-name", help="name the replicas' certificate was issued for (they are dialled by IP)")
    d = sub.add_parser("down", parents=[common], allow_abbrev=False, help="drain and remove every replica")
    d.add_argument("--grace", type=seconds(allow_zero=True), default=10.0,
                   help="seconds calls in progress get (default 10)")
    return p


def _auth(info: dict[str, Any]) -> str:
    if "auth" not in info:
        return "-"
    token = ("token(ray)" if info.get("token_from_ray") else "token") if info["auth"] else "none"
    return f"{token}+tls" if info.get("tls") else token


def _table(infos: list[dict[str, Any]]) -> str:
    rows = [f"{'replica':<8}{'state':<9}{'health':<12}{'address':<24}{'auth':<12}{'device':<9}{'pid':<9}"
            f"{'requests':<10}node"]
    for info in infos:
        rows.append(f"{info['index']:<8}{info['state']:<9}{info.get('health', '-'):<12}{info.get('address', '-'):<24}"
                    f"{_auth(info):<12}{info.get('device', '-'):<9}{info.get('pid', '-')!s:<9}"
                    f"{info.get('requests', '-')!s:<10}{info.get('node_ip', '-')}")
    return "\n".join(rows)


def _credentials(args: argparse.Namespace) -> Any:
    """gRPC channel credentials from ``status --tls-*`` (None without them); ``ValueError`` naming the flag."""
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    import grpc

    from advantage_server.auth import read_pem
    return grpc.ssl_channel_credentials(read_pem(args.tls_ca, "--tls-ca"), read_pem(args.tls_key, "--tls-key"),
                                        read_pem(args.tls_cert, "--tls-cert"))


def _status_main(args: argparse.Namespace) -> int:
    infos = status(args.name, args.namespace, address=args.address, credentials=_credentials(args),
                   server_name=args.tls_server_name)
    print(json.dumps(infos, indent=1) if args.json else _table(infos) if infos
          else f"no replica of {args.name!r} in namespace {args.namespace!r}")
    where = f"--name {args.name} --namespace {args.namespace}"

    def which(predicate: Any) -> str:
        return ", ".join(str(i["index"]) for i in infos if predicate(i))

    problems = {
        "DEAD (Ray's restarts spent): `advantage-ray down {where}` then `advantage-ray up` again":
            which(lambda i: i["state"] == "DEAD"),
        "STOPPED (its server was stopped through the actor's stop(); Ray does not restart it, clients skip it): "
        "`advantage-ray down {where}` then `advantage-ray up` again":
            which(lambda i: i["state"] == "STOPPED"),
        "PENDING (being restarted by Ray, or its process hangs: no answer to info() within 5 s): run status "
        "again; one that stays PENDING hangs (kill its pid: Ray restarts it)":
            which(lambda i: i["state"] == "PENDING"),
        "ALIVE but not serving (health check of its address: NOT_SERVING or no answer; is its port reachable "
        "from here?)": which(lambda i: i["state"] == "ALIVE" and i.get("health") not in ("SERVING", UNCHECKED)),
    }
    for what, indices in problems.items():
        if indices:
            print(f"advantage-ray: replica(s) {indices} of {args.name!r} {what.format(where=where)}", file=sys.stderr)
    unchecked = which(lambda i: i.get("health") == UNCHECKED)
    if unchecked:
        print(f"advantage-ray: replica(s) {unchecked} serve TLS: give --tls-ca (and --tls-server-name) to "
              "health-check them", file=sys.stderr)
    return 0 if infos and not any(problems.values()) else 1


def main(argv: list[str] | None = None) -> int:
    """``advantage-ray up|status|down``: exit 0 on success, 1 when nothing is up or some replica is not ALIVE
    and SERVING (status; DEAD and STOPPED ones need ``down`` then ``up``) or an operation failed, 2 for bad
    flags. ``up --insecure`` prints a one-line warning (no token)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "up":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "up":  # the server flags first: a bad one is answered before Ray or torch is imported
            _check_local(server_args(rest), args.replicas)
        import_ray()
        if args.command == "up":
            bundle = args.bundle_index[0] if args.bundle_index and len(args.bundle_index) == 1 else args.bundle_index
            infos = up(args.replicas, rest, name=args.name, namespace=args.namespace, address=args.address,
                       num_cpus=args.num_cpus, num_gpus=args.num_gpus, resources=args.resources, node_id=args.node_id,
                       soft=args.soft, placement_group=args.placement_group, bundle_index=bundle,
                       max_restarts=args.max_restarts, timeout=args.timeout, insecure=args.insecure)
            if args.insecure:
                print("advantage-ray: warning: --insecure: the replicas serve without a token (and without TLS "
                      "unless --tls-cert): anyone who reaches their ports can call them", file=sys.stderr)
            print(_table([{**info, "state": "ALIVE"} for info in infos]))
            print(f"client: AdvantageClient.from_ray(name={args.name!r}, namespace={args.namespace!r})"
                  + (" (reads the generated token through Ray)" if infos[0].get("token_from_ray") else ""))
            return 0
        if args.command == "status":
            return _status_main(args)
        infos = down(args.name, args.namespace, address=args.address, grace=args.grace)
        print(f"stopped {len(infos)} replica(s) of {args.name!r} in namespace {args.namespace!r}")
        return 0
    except ValueError as exc:
        print(f"advantage-ray: error: {exc}", file=sys.stderr)
        return 2
    except (ImportError, RuntimeError, ConnectionError) as exc:
        print(f"advantage-ray: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
