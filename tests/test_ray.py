"""The service on a real local Ray cluster (issue #14): ``advantage-ray`` / ``advantage_server.ray_deploy`` and
``AdvantageClient.from_ray`` / ``AsyncAdvantageClient.from_ray`` (``advantage_client.ray_discovery``).

One Ray cluster for the module (``ray start --head --num-cpus=2``, no dashboard, this process its driver) and one
deployment of two replicas (one CPU each) that the tests use in order: requests spread over both (each replica's
own count of the calls it answered), a replica's process killed (SIGKILL) in the middle of a run of requests from
two threads with no failed request, Ray restarting it on a new port and the client reaching the new one, the
asyncio twin, a replica's process stopped (SIGSTOP): its calls answered by the other replica once the keepalive
finds it, and dropped by a look-up, the token ``up`` generates (tokenless calls refused, ``from_ray`` finds it), and ``advantage-ray down``
leaving no replica process, port or actor name behind. Beside it (no CPU reserved): one-replica deployments
whose only replica is killed (the client waits for Ray's restart instead of failing), one with
``max_restarts=0`` that ``status`` must report DEAD, ``advantage-ray up`` from the command line with no flags
(a token) and with ``--insecure`` (a warning; its replica then stopped through its actor, which ``status``
must report STOPPED), and the flags refused before anything starts.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest


ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from advantage_client import (
    AdvantageClient,
    AdvantageServiceError,
    AsyncAdvantageClient,
    ray_discovery,
)
from advantage_server import ray_deploy
from test_server_cli import free_port

LIST_ESTIMATORS = "/advantage.v1.AdvantageService/ListEstimators"

NAMESPACE = "advantage-test"
CONFIG = {"normalize_rewards": False, "use_leave_one_out_baseline": False}
PROMPT_IDS = np.array([0, 0, 0, 0, 1, 1, 1, 1])
MASK = np.ones((8, 5), dtype=np.float32)
MASK[:, 3:] = 0


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rewards for two groups of four and the advantages GRPO must give them without std normalisation
    (NeMo RL: reward minus its group's mean, broadcast over every token: the mask is the loss's business)."""
    rewards = np.random.default_rng(seed).integers(0, 2, size=8).astype(np.float32)
    means = np.array([rewards[PROMPT_IDS == g].mean() for g in PROMPT_IDS], dtype=np.float32)
    return rewards, np.broadcast_to((rewards - means)[:, None], MASK.shape)


def compute(client, seed: int) -> None:
    rewards, expected = batch(seed)
    result = client.compute("grpo", CONFIG, prompt_ids=PROMPT_IDS, rewards=rewards, mask=MASK, as_numpy=True)
    np.testing.assert_allclose(result.advantages, expected, atol=1e-6)


def counts() -> dict[int, int]:
    return {info["index"]: info["requests"] for info in ray_deploy.status(namespace=NAMESPACE)
            if info["state"] == "ALIVE"}


def raw_call(address: str, token: str | None = None) -> grpc.StatusCode:
    """A ListEstimators call with grpcio alone (no advantage client, so no token unless given): its status."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(LIST_ESTIMATORS)(b"", timeout=20, metadata=metadata)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def _ray_logs(temp_dir: str, lines: int = 15) -> str:
    """The last lines of the head's own logs, for a start that failed."""
    logs = os.path.join(temp_dir, "session_latest", "logs")
    out = []
    for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err"):
        try:
            with open(os.path.join(logs, name), errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError as err:
            tail = [f"({err})\n"]
        out.append(f"--- {name}\n" + "".join(line[:300] for line in tail))
    return "\n".join(out)


def _stop_head(proc: subprocess.Popen) -> None:
    """``ray start --block`` stops the head's processes when it gets SIGTERM; whatever is left in its process
    group is killed (never ``ray stop``, which stops every Ray cluster of this machine)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_head(tmp: str, attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """A one-node Ray cluster in processes of its own, as a trainer's node runs one (``ray start --head``),
    two CPUs, no dashboard, no token (``RAY_AUTH_MODE=disabled``, so the CLI runs below reach it as they are).

    Not ``ray.init()`` in the pytest process: on a loaded 2-core machine Ray's start-up (which gives its raylet a
    fixed 30 s to register) timed out once in CI at the end of the suite and once here; a start that fails is
    retried, its processes killed, and the head's log tails end up in the error of the last try."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    errors = []
    for attempt in range(attempts):
        port = free_port()
        temp_dir = os.path.join(tmp, f"ray{attempt}")
        log_path = os.path.join(tmp, f"ray-start-{attempt}.log")
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [ray_bin, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                 "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temp_dir}",
                 "--disable-usage-stats"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            with open(log_path, "rb") as f:
                if b"Ray runtime started" in f.read():
                    return proc, f"127.0.0.1:{port}"
            time.sleep(0.25)
        _stop_head(proc)
        with open(log_path, errors="replace") as f:
            said = f.read()[-3000:]
        errors.append(f"try {attempt + 1}: ray start exited {proc.returncode}\n{said}\n{_ray_logs(temp_dir)}")
        print(f"[ray] head start failed, try {attempt + 1} of {attempts}", file=sys.stderr)
    raise RuntimeError("a local Ray head did not start:\n" + "\n\n".join(errors))


#: the module's ``ray start --head --block`` process (the cluster fixture's), for the loopback check
HEAD: list[subprocess.Popen] = []


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it (108-byte limit)
    try:
        proc, address = start_head(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    HEAD[:] = [proc]
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this process's ray.init(address=...) and from_ray's, as the head
    try:
        ray.init(address=address, log_to_driver=False, namespace="advantage-test-driver")
        yield address
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before
        _stop_head(proc)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def deployment(cluster):
    infos = ray_deploy.up(2, ["--host", "127.0.0.1", "--device", "cpu", "--workers", "2", "--grace", "1"], namespace=NAMESPACE,
                          num_cpus=1, timeout=120)
    yield infos
    ray_deploy.down(namespace=NAMESPACE, grace=0.5)


def test_client_imports_ray_only_in_from_ray():
    code = ("import sys, advantage_client, advantage_client.ray_discovery, advantage_client.verl, "
            "advantage_client.nemo; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bad_options_refused_before_anything_starts(cluster):
    with pytest.raises(ValueError, match="--workers"):
        ray_deploy.up(1, ["--workers", "0"], namespace="advantage-bad")
    with pytest.raises(ValueError, match="unknown flag"):
        ray_deploy.up(1, ["--no-such-flag"], namespace="advantage-bad")
    with pytest.raises(ValueError, match="replicas"):
        ray_deploy.up(0, namespace="advantage-bad")
    with pytest.raises(ValueError, match="bundle_index"):
        ray_deploy.up(2, bundle_index=[0], namespace="advantage-bad")
    assert ray_discovery.replica_handles("advantage", "advantage-bad") == []


def test_cli_bad_flags_exit_2(capsys):
    assert ray_deploy.main(["up", "--namespace", "advantage-bad", "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert ray_deploy.main(["up", "--namespace", "advantage-bad", "--no-such-flag"]) == 2
    assert "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ray_deploy.main(["status", "--no-such-flag"])
    assert exc.value.code == 2


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port"])
def test_cli_port_range_exit_2(flag, capsys):
    """A fixed port P gives replica i the port P + i: past 65535 it would silently become an ephemeral one."""
    assert ray_deploy.main(["up", "--namespace", "advantage-bad", "--replicas", "2", flag, "65535"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "65536 > 65535" in err and "<= 65534" in err
    ray_deploy._check_local(ray_deploy.server_args([flag, "65534"]), 2)  # 65534, 65535: fits
    ray_deploy._check_local(ray_deploy.server_args([flag, "65535"]), 1)


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file"])
def test_cli_unreadable_file_exit_2_before_anything_starts(flag, tmp_path, capsys):
    missing, present = str(tmp_path / "nonexistent.pem"), tmp_path / "present.pem"
    present.write_text("readable\n")  # the partner flag's file is there: the error names the missing one
    argv = {"--tls-cert": ["--tls-key", str(present)], "--tls-key": ["--tls-cert", str(present)]}.get(flag, [])
    assert ray_deploy.main(["up", "--namespace", "advantage-bad", flag, missing, *argv]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {missing}: cannot read it here" in err and "Traceback" not in err


def test_cli_insecure_with_a_token_file_exit_2(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert ray_deploy.main(["up", "--namespace", "advantage-bad", "--insecure", "--auth-token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert "--insecure" in err and "--auth-token-file" in err and "Traceback" not in err


@pytest.mark.parametrize("grace", ["-5", "nan", "inf", "x"])
def test_down_bad_grace_exit_2(grace, capsys):
    with pytest.raises(SystemExit) as exc:
        ray_deploy.main(["down", "--namespace", "advantage-bad", "--grace", grace])
    assert exc.value.code == 2 and "--grace" in capsys.readouterr().err
    with pytest.raises(ValueError, match="grace"):
        ray_deploy.down(namespace="advantage-bad", grace=float(grace) if grace != "x" else grace)


def test_every_server_flag_reaches_the_server():
    """Each ``advantage-server`` flag is a ``create_server`` argument or read by the replica (a new flag that
    neither knows fails here rather than being dropped on Ray)."""
    args = ray_deploy.server_args(["--workers", "3", "--max-batch-elements", "1000", "--device", "cpu"])
    kwargs = ray_deploy.server_kwargs(args)
    assert kwargs["workers"] == 3 and kwargs["max_batch_elements"] == 1000
    assert args.port == 0 and args.device == "cpu"  # a replica takes any free port unless told
    assert "port" not in kwargs and "grace" not in kwargs


def test_from_ray_without_replicas_says_how_to_start_them(cluster):
    with pytest.raises(AdvantageServiceError, match="advantage-ray up") as err:
        AdvantageClient.from_ray(namespace="advantage-none", wait_s=0, lookup_timeout=1)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_up_twice_is_refused(deployment):
    with pytest.raises(RuntimeError, match="already up"):
        ray_deploy.up(1, namespace=NAMESPACE)


def _off_loopback(ip: str) -> bool:
    """Whether a socket address is outside loopback (an IPv4-mapped ``::ffff:127.0.0.1`` is loopback)."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_loopback


def test_the_cluster_stays_on_loopback(deployment):
    """Issue #37 item 1: the suite's Ray cluster, its replicas included, uses 127.0.0.1 alone. Ray on Linux swaps a
    ``--node-ip-address=127.0.0.1`` for the host's own address (``resolve_ip_for_localhost``) unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (tests/conftest.py). Checked on 2026-12-06 with that line removed: the
    node became 192.0.2.2 and this test failed on the node's address and on the sockets of the head's processes.
    The sockets checked are every inet socket of the head's process tree (GCS, raylet, workers, the replicas):
    none may listen on or talk to an address outside loopback, the wildcard address included."""
    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]

    @ray.remote(num_cpus=0)
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(node_ip.remote(), timeout=60) == "127.0.0.1"
    assert all(info["address"].startswith("127.0.0.1:") for info in deployment), deployment
    head = psutil.Process(HEAD[0].pid)
    seen, outside = 0, []
    for proc in [head, *head.children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="inet")
            name = " ".join(proc.cmdline())[:80]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for sock in sockets:
            seen += 1
            ends = [a for a in (sock.laddr, sock.raddr) if a]
            if any(_off_loopback(a.ip) for a in ends):
                outside.append((proc.pid, name, sock.laddr, sock.raddr, sock.status))
    assert seen >= 10, f"only {seen} sockets seen in the head's process tree: the check saw no cluster"
    assert not outside, f"{len(outside)} of {seen} Ray sockets outside loopback: {outside[:5]}"


def test_status_cli_and_requests_spread_over_both(deployment, cluster):
    assert [info["index"] for info in deployment] == [0, 1]
    assert len({info["address"] for info in deployment}) == 2 and len({info["pid"] for info in deployment}) == 2
    out = subprocess.run([sys.executable, "-m", "advantage_server.ray_deploy", "status", "--namespace", NAMESPACE,
                          "--address", cluster], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for info in deployment:
        assert info["address"] in out.stdout and "ALIVE" in out.stdout
    before = counts()
    with AdvantageClient.from_ray(namespace=NAMESPACE, timeout=20) as client:
        assert sorted(client.addresses) == sorted(info["address"] for info in deployment)
        for seed in range(40):
            compute(client, seed)
    after = counts()
    served = {index: after[index] - before[index] for index in after}
    assert sum(served.values()) == 40
    assert min(served.values()) >= 10, served  # round_robin: both replicas take a share


def test_nemo_rl_estimator_reaches_the_replicas_through_from_ray(deployment):
    """The README's NeMo RL line: RemoteAdvantageEstimator with ``client=AdvantageClient.from_ray(...)``."""
    torch = pytest.importorskip("torch")
    from advantage_client import RemoteAdvantageEstimator

    rewards, expected = batch(7)
    with AdvantageClient.from_ray(namespace=NAMESPACE, timeout=20) as client:
        estimator = RemoteAdvantageEstimator(None, "grpo", CONFIG, client=client, result_format="legacy")
        got = estimator.compute_advantage(torch.as_tensor(PROMPT_IDS), torch.as_tensor(rewards), torch.as_tensor(MASK))
    torch.testing.assert_close(got, torch.tensor(np.array(expected)), atol=1e-6, rtol=0)


def test_verl_estimator_reaches_the_replicas_through_from_ray(deployment):
    """verl's drop-in takes a ``from_ray`` client as its target: ``get_adv_estimator_fn(name, client)``."""
    torch = pytest.importorskip("torch")
    from advantage_client.verl import get_adv_estimator_fn

    rewards, _ = batch(11)
    token_rewards = np.zeros_like(MASK)
    token_rewards[:, 2] = rewards  # verl sums token-level rewards over the row: the outcome at the last token
    with AdvantageClient.from_ray(namespace=NAMESPACE, timeout=20) as client:
        fn = get_adv_estimator_fn("grpo", client)
        advantages, _ = fn(token_level_rewards=torch.as_tensor(token_rewards), response_mask=torch.as_tensor(MASK),
                           index=np.array(PROMPT_IDS), norm_adv_by_std_in_grpo=False)
    groups = rewards.reshape(2, 4)
    expected = (groups - groups.mean(axis=1, keepdims=True)).reshape(8, 1) * MASK  # verl: zero past the mask
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_skyrl_registry_carries_a_remote_estimator_to_a_ray_worker(cluster, server):
    """SkyRL's ``AdvantageEstimatorRegistry`` backed by its named Ray actor on this cluster: ``remote_grpo`` and
    ``remote_maxrl`` registered on the driver (advantage_client.skyrl.register) are found by a Ray task through
    SkyRL's registry and compute on the server (tests/test_skyrl_plugin.py, ``check_in_ray_worker``)."""
    pytest.importorskip("skyrl")
    from test_skyrl_plugin import check_in_ray_worker

    check_in_ray_worker(server.address)


def test_replica_killed_mid_run_no_failed_request(deployment):
    victim = deployment[0]
    failures: list[BaseException] = []
    done = [0]
    stop = threading.Event()
    client = AdvantageClient.from_ray(namespace=NAMESPACE, timeout=20, refresh_s=0.5)

    def run(offset: int) -> None:
        seed = offset
        while not stop.is_set():
            try:
                compute(client, seed)
                done[0] += 1
            except BaseException as exc:
                failures.append(exc)
            seed += 2

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: done[0] >= 20, 30, "20 requests before the kill")
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = done[0]
        back = wait_for(lambda: [i for i in ray_deploy.status(namespace=NAMESPACE)
                                 if i["index"] == 0 and i["state"] == "ALIVE" and i["pid"] != victim["pid"]],
                        60, "Ray restarts the killed replica")[0]
        assert back["restarted"] is True and back["address"] != victim["address"]
        wait_for(lambda: back["address"] in client.addresses, 20, "the client looks up the new address")
        wait_for(lambda: counts().get(0, 0) >= 5, 30, "requests reach the restarted replica")
        assert done[0] > killed_at
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        client.close()
    assert not failures, failures[:3]
    assert not psutil.pid_exists(victim["pid"])


def run_while(client, stop: threading.Event, done: list, failures: list, offset: int) -> None:
    seed = offset
    while not stop.is_set():
        try:
            compute(client, seed)
            done[0] += 1
        except BaseException as exc:
            failures.append(exc)
        seed += 2


@pytest.mark.parametrize("fixed_port", [False, True], ids=["ephemeral-port", "fixed-port"])
def test_only_replica_killed_calls_wait_for_its_restart(cluster, fixed_port):
    """``up --replicas 1``: the only replica killed (SIGKILL) during calls from two threads. gRPC's retries
    (about 1.5 s) end before Ray has restarted it, the look-up then finds no live replica: the client looks
    again until the restarted one answers (within the call's timeout) and sends the call there. No failed call.

    ``--port P`` (fixed-port): Ray restarts it on the same port, so its address does not change. The client
    tells the restarted process from the old one (its pid in ``info()``), builds a fresh client (connections of
    its own) on the same address and sends the calls that failed meanwhile once more, whether the look-up after
    the failure finds the replica still restarting or already back (gRPC's retries on here)."""
    name = "fixed" if fixed_port else "solo"
    flags = ["--host", "127.0.0.1", "--device", "cpu", "--workers", "1", "--grace", "0.5"]
    if fixed_port:
        port = free_port()
        flags += ["--port", str(port)]
    infos = ray_deploy.up(1, flags, name=name, namespace=NAMESPACE, num_cpus=0, timeout=120)
    if fixed_port:
        assert infos[0]["address"].endswith(f":{port}")
    failures: list[BaseException] = []
    done = [0]
    stop = threading.Event()
    client = AdvantageClient.from_ray(name=name, namespace=NAMESPACE, timeout=20, refresh_s=None,
                                      retry=fixed_port, lookup_timeout=0.3)
    threads = [threading.Thread(target=run_while, args=(client, stop, done, failures, i)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: done[0] >= 10, 30, "10 requests before the kill")
        os.kill(infos[0]["pid"], signal.SIGKILL)
        killed_at = done[0]
        if fixed_port:
            wait_for(lambda: f"/{infos[0]['pid']}/" not in next(iter(client._slot.found.values())), 30,
                     "the client follows the replica restarted on the same port")
        else:
            wait_for(lambda: client.addresses != [infos[0]["address"]], 30, "the client follows the restarted replica")
        wait_for(lambda: done[0] >= killed_at + 10, 30, "requests after the restart")
        if fixed_port:
            assert client.addresses == [infos[0]["address"]]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        client.close()
        ray_deploy.down(name=name, namespace=NAMESPACE, grace=0.5)
    assert not failures, failures[:3]


def test_only_replica_killed_asyncio_twin_waits_too(cluster):
    """The same as the asyncio twin: two tasks calling while the only replica is killed; no failed call."""
    name = "solo-aio"
    infos = ray_deploy.up(1, ["--host", "127.0.0.1", "--device", "cpu", "--workers", "1", "--grace", "0.5"], name=name,
                          namespace=NAMESPACE, num_cpus=0, timeout=120)
    failures: list[BaseException] = []
    done = [0]

    async def main() -> None:
        client = await AsyncAdvantageClient.from_ray(name=name, namespace=NAMESPACE, timeout=20, refresh_s=None,
                                                     retry=False, lookup_timeout=0.3)
        stop = asyncio.Event()

        async def run(seed: int) -> None:
            while not stop.is_set():
                rewards, expected = batch(seed)
                try:
                    result = await client.compute("grpo", CONFIG, prompt_ids=PROMPT_IDS, rewards=rewards, mask=MASK,
                                                  as_numpy=True)
                    np.testing.assert_allclose(result.advantages, expected, atol=1e-6)
                    done[0] += 1
                except BaseException as exc:
                    failures.append(exc)
                seed += 2

        async def until(predicate, timeout: float, what: str) -> None:
            deadline = time.monotonic() + timeout
            while not predicate():
                assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(run(i)) for i in range(2)]
        try:
            await until(lambda: done[0] >= 10, 30, "10 requests before the kill")
            os.kill(infos[0]["pid"], signal.SIGKILL)
            killed_at = done[0]
            await until(lambda: client.addresses != [infos[0]["address"]], 30, "the client follows the restart")
            await until(lambda: done[0] >= killed_at + 10, 30, "requests after the restart")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await client.close()

    try:
        asyncio.run(main())
    finally:
        ray_deploy.down(name=name, namespace=NAMESPACE, grace=0.5)
    assert not failures, failures[:3]


def test_status_shows_a_replica_whose_restarts_are_spent(cluster, capsys):
    """``--max-restarts 0``: a killed replica is gone from Ray's named actors; status lists it as DEAD and
    exits 1 saying ``down`` then ``up``; ``down`` clears it."""
    name = "mortal"
    infos = ray_deploy.up(1, ["--host", "127.0.0.1", "--device", "cpu", "--workers", "1"], name=name, namespace=NAMESPACE, num_cpus=0,
                          max_restarts=0, timeout=120)
    try:
        assert ray_deploy.main(["status", "--name", name, "--namespace", NAMESPACE]) == 0
        os.kill(infos[0]["pid"], signal.SIGKILL)
        wait_for(lambda: not ray_discovery.replica_handles(name, NAMESPACE), 30, "Ray forgets the dead replica")
        assert ray_deploy.status(name, NAMESPACE) == [{"index": 0, "state": "DEAD", "health": "-"}]
        capsys.readouterr()
        assert ray_deploy.main(["status", "--name", name, "--namespace", NAMESPACE]) == 1
        out = capsys.readouterr()
        assert "DEAD" in out.out and "replica(s) 0" in out.err and "down" in out.err and "up" in out.err
    finally:
        ray_deploy.down(name=name, namespace=NAMESPACE, grace=0.5)
    assert ray_deploy.status(name, NAMESPACE) == []
    assert ray_deploy.main(["status", "--name", name, "--namespace", NAMESPACE]) == 1  # nothing up


def test_asyncio_twin_spreads_over_both(deployment):
    async def main() -> None:
        async with await AsyncAdvantageClient.from_ray(namespace=NAMESPACE, timeout=20) as client:
            assert len(client.addresses) == 2
            assert await client.refresh() is False  # the same two replicas: the client is kept
            for start in range(100, 124, 6):  # rounds: a first burst goes to the replica connected first
                seeds = list(range(start, start + 6))
                results = await asyncio.gather(*(
                    client.compute("grpo", CONFIG, prompt_ids=PROMPT_IDS, rewards=batch(s)[0], mask=MASK,
                                   as_numpy=True) for s in seeds))
                for seed, result in zip(seeds, results):
                    np.testing.assert_allclose(result.advantages, batch(seed)[1], atol=1e-6)

    before = counts()
    asyncio.run(main())
    after = counts()
    assert sum(after.values()) - sum(before.values()) == 24
    assert all(after[i] > before[i] for i in after), (before, after)


def test_replicas_require_the_token_up_generated(deployment):
    """``up`` without ``--auth-token-file`` or ``insecure``: every replica requires the token it generated
    (tokenless and wrong-token calls UNAUTHENTICATED, health exempt), which any Ray driver reads from a replica
    (what ``from_ray`` does: the other tests' clients are given no token)."""
    token = ray_discovery.replica_token(namespace=NAMESPACE)
    assert isinstance(token, str) and len(token) >= 43
    infos = ray_deploy.status(namespace=NAMESPACE)  # replica 0 was restarted by Ray above: its address now
    assert [i["state"] for i in infos] == ["ALIVE", "ALIVE"]
    for info in infos:
        assert info["auth"] is True and info["token_from_ray"] is True
        assert raw_call(info["address"]) == grpc.StatusCode.UNAUTHENTICATED
        assert raw_call(info["address"], "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert raw_call(info["address"], token) == grpc.StatusCode.OK
        assert ray_deploy.health_check(info["address"]) == "SERVING"


def test_sigstopped_replica_is_failed_over_and_dropped(deployment):
    """One replica's process stopped (SIGSTOP): gRPC still sends it a share of the calls until the client's
    HTTP/2 keepalive PING on that connection goes unanswered (``advantage_client.channel.KEEPALIVE_OPTIONS``:
    about 4 s); then the calls on it end UNAVAILABLE and are sent to the other replica (gRPC's retry, or the
    client's failover, which also starts a look-up), so every caller gets its answer within its deadline, from
    the other replica (issue #27 item 7: no attempt is cut at half the deadline). A look-up (no periodic one
    here: refresh_s=None; the failover's, else the test's own) finds the stopped replica's ``info()`` not
    answering within ``STALL_S`` of the other's: it is dropped, and every later call goes to the other replica.
    Asserted within 10 s, with ``lookup_timeout=30``: a look-up that waited for every replica's answer could not
    drop it in time. SIGCONT at the end: the next look-up takes it back."""
    alive = [i for i in ray_deploy.status(namespace=NAMESPACE) if i["state"] == "ALIVE"]
    assert len(alive) == 2
    victim, other = alive[1], alive[0]
    client = AdvantageClient.from_ray(namespace=NAMESPACE, timeout=20, refresh_s=None, lookup_timeout=30)
    for seed in range(8):  # connected to both (a replica stopped before the client connects is never used)
        compute(client, seed)
    before = counts()
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        assert sorted(client.addresses) == sorted([victim["address"], other["address"]])
        ok = 0
        for seed in range(6):  # round_robin over 2: one of the first calls goes to the stopped replica
            rewards, expected = batch(seed)
            result = client.compute("grpo", CONFIG, prompt_ids=PROMPT_IDS, rewards=rewards, mask=MASK,
                                    as_numpy=True, timeout=15)
            np.testing.assert_allclose(result.advantages, expected, atol=1e-6)
            ok += 1
        stalled_at = time.monotonic()
        wait_for(lambda: (client.refresh(), client.addresses)[1] == [other["address"]], 10,
                 "the stopped replica dropped")
        dropped_after = time.monotonic() - stalled_at
        print(f"[ray] SIGSTOPped replica dropped {dropped_after:.2f} s after the look-up started")
        for seed in range(20):
            compute(client, 100 + seed)
            ok += 1
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    try:
        after = counts()
        assert after[other["index"]] - before[other["index"]] == ok  # every answered call: the other replica
        wait_for(lambda: client.refresh() or len(client.addresses) == 2, 20, "the resumed replica taken back")
        assert sorted(client.addresses) == sorted([victim["address"], other["address"]])
        compute(client, 999)
    finally:
        client.close()


def test_down_leaves_no_process_port_or_name(deployment, cluster):
    infos = [i for i in ray_deploy.status(namespace=NAMESPACE) if i["state"] == "ALIVE"]
    assert len(infos) == 2
    out = subprocess.run([sys.executable, "-m", "advantage_server.ray_deploy", "down", "--namespace", NAMESPACE,
                          "--address", cluster, "--grace", "0.5"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert "stopped 2 replica(s)" in out.stdout
    assert ray_deploy.status(namespace=NAMESPACE) == []
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    wait_for(lambda: not any(psutil.pid_exists(i["pid"]) for i in infos), 30, "replica processes exit")
    for info in infos:
        port = int(info["address"].rpartition(":")[2])
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", port))  # nothing listens there any more
    assert ray_deploy.down(namespace=NAMESPACE) == []  # idempotent


def up_cli(name: str, *flags: str) -> list[dict]:
    """``advantage-ray up`` (in this process, which is a driver of the test cluster) of one replica, no CPU
    reserved, plus ``flags``; its infos."""
    assert ray_deploy.main(["up", "--replicas", "1", "--name", name, "--namespace", NAMESPACE, "--num-cpus", "0",
                            "--timeout", "120", "--device", "cpu", "--workers", "1", *flags]) == 0
    return ray_deploy.status(name, NAMESPACE)


def test_cli_up_without_flags_serves_with_a_token_from_ray_finds(cluster, capsys):
    """``advantage-ray up`` with no security flag: no warning, a token required (a tokenless raw gRPC call is
    UNAUTHENTICATED), which ``from_ray`` reads through Ray without being told; ``status`` shows it."""
    name = "tokened"
    try:
        infos = up_cli(name)
        out = capsys.readouterr()
        assert "warning" not in out.err and "generated token" in out.out
        assert infos[0]["state"] == "ALIVE" and infos[0]["health"] == "SERVING"
        assert raw_call(infos[0]["address"]) == grpc.StatusCode.UNAUTHENTICATED
        with AdvantageClient.from_ray(name=name, namespace=NAMESPACE, timeout=20) as client:
            compute(client, 5)
        assert ray_deploy.main(["status", "--name", name, "--namespace", NAMESPACE]) == 0
        assert "token(ray)" in capsys.readouterr().out
    finally:
        ray_deploy.down(name=name, namespace=NAMESPACE, grace=0.5)


def test_cli_up_insecure_warns_and_status_names_a_replica_stopped_through_its_actor(cluster, capsys):
    """``--insecure``: one warning line, no token (a tokenless raw call is served). Then the replica's server is
    stopped through its actor's ``stop()`` (as any Ray driver can): ``status`` lists it STOPPED, health
    ``stopped``, exits 1 naming it, and the client's look-up skips it (before: ALIVE, exit 0)."""
    name = "open"
    try:
        infos = up_cli(name, "--insecure")
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if "warning" in line] == [
            "advantage-ray: warning: --insecure: the replicas serve without a token (and without TLS unless "
            "--tls-cert): anyone who reaches their ports can call them"]
        assert infos[0]["auth"] is False and ray_discovery.replica_token(name, NAMESPACE) is None
        assert raw_call(infos[0]["address"]) == grpc.StatusCode.OK
        ray.get(ray.get_actor(ray_discovery.replica_actor_name(name, 0), namespace=NAMESPACE).stop.remote(0.5))
        assert [(i["state"], i["health"]) for i in ray_deploy.status(name, NAMESPACE)] == [("STOPPED", "stopped")]
        assert ray_deploy.main(["status", "--name", name, "--namespace", NAMESPACE]) == 1
        out = capsys.readouterr()
        assert "STOPPED" in out.out and "replica(s) 0 of 'open' STOPPED" in out.err and "down" in out.err
        assert ray_discovery.replica_addresses(name, NAMESPACE) == []
    finally:
        ray_deploy.down(name=name, namespace=NAMESPACE, grace=0.5)
