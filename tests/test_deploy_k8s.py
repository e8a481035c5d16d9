"""deploy/k8s/: the manifests validate against the Kubernetes schemas (kubernetes-validate ships them, so this
runs offline), they agree with each other, with the Dockerfile and with the server's flags, and the Deployment's
own arguments start a real server that answers the kubelet's gRPC probes and authenticated TLS calls."""
from __future__ import annotations

import os
import pathlib
import subprocess

import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client import AdvantageClient
from advantage_server.cli import build_parser

from reliability_support import make_pki
from test_deploy_docker import STAGES, last, numba_cache_dir, tool
from test_server_cli import ServerProcess, free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# prometheusrule.yaml is a Prometheus Operator custom resource (monitoring.coreos.com/v1 PrometheusRule): the
# Kubernetes schemas kubernetes-validate ships do not describe CRD kinds, so --strict would reject it as unknown.
# tests/test_alerts.py checks it instead (its structure, and promtool on its rule groups).
CUSTOM_RESOURCES = {"prometheusrule.yaml"}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name not in CUSTOM_RESOURCES)
# The oldest Kubernetes minor still commonly run with native gRPC probes (GA in 1.27), and the newest schemas
# kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
SERVICE = "advantage.v1.AdvantageService"


def load() -> dict[str, dict]:
    docs = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


DOCS = load()
DEPLOYMENT = DOCS["Deployment"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]
def _parse_as_deployed(args: list[str]):
    """The Deployment's arguments as its container parses them: without the suite's ADVANTAGE_WARMUP=0."""
    saved = os.environ.pop("ADVANTAGE_WARMUP", None)
    try:
        return build_parser().parse_args(args)
    finally:
        if saved is not None:
            os.environ["ADVANTAGE_WARMUP"] = saved


ARGS = _parse_as_deployed(CONTAINER["args"])


def validate(*paths: pathlib.Path, version: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version):
    assert {p.name for p in MANIFESTS} >= {"deployment.yaml", "service.yaml", "hpa.yaml"}
    proc = validate(*MANIFESTS, version=version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(MANIFESTS), proc.stdout


def test_validation_rejects_a_broken_manifest(tmp_path):
    bad = tmp_path / "deployment.yaml"
    bad.write_text((K8S / "deployment.yaml").read_text().replace("readinessProbe:", "readinesProbe:"))
    proc = validate(bad, version=KUBERNETES_VERSIONS[-1])
    assert proc.returncode != 0 and "readinesProbe" in proc.stdout + proc.stderr


def test_deployment_requests_a_gpu_and_resources():
    resources = CONTAINER["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    assert ARGS.device in ("auto", "cuda") or ARGS.device.startswith("cuda:")


def test_entrypoint_flags_ports_and_probes_agree():
    assert "command" not in CONTAINER, "the image's ENTRYPOINT (advantage-server) must run"
    ports = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    assert ports == {"grpc": ARGS.port, "health": ARGS.health_port, "metrics": ARGS.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert CONTAINER[probe]["grpc"]["port"] == ARGS.health_port, f"{probe}: the kubelet speaks no TLS"
    assert CONTAINER["readinessProbe"]["grpc"]["service"] == SERVICE
    assert CONTAINER["livenessProbe"]["grpc"].get("service", "") == ""
    annotations = DEPLOYMENT["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ARGS.metrics_port)
    pre_stop = int(CONTAINER["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert POD["terminationGracePeriodSeconds"] > ARGS.grace + pre_stop
    assert ARGS.log_format == "json" and ARGS.host == "0.0.0.0"


def test_secrets_are_mounted_where_the_flags_expect_them():
    volumes = {v["name"]: v for v in POD["volumes"]}
    mounts = {m["mountPath"]: m for m in CONTAINER["volumeMounts"]}
    assert ARGS.tls_cert and ARGS.tls_key and ARGS.auth_token_file
    for flag, path in (("--tls-cert", ARGS.tls_cert), ("--tls-key", ARGS.tls_key),
                       ("--tls-client-ca", ARGS.tls_client_ca), ("--auth-token-file", ARGS.auth_token_file)):
        if path is None:
            continue
        directory, name = path.rsplit("/", 1)
        assert directory in mounts, f"{flag} {path}: no volume mounted at {directory}"
        mount = mounts[directory]
        assert mount.get("readOnly") is True
        secret = volumes[mount["name"]]["secret"]
        keys = {item["path"]: item["key"] for item in secret.get("items", [])} or {name: name}
        assert name in keys, f"{flag} {path}: the secret {secret['secretName']} projects no {name}"
    tls = volumes[mounts[ARGS.tls_cert.rsplit("/", 1)[0]]["name"]]["secret"]
    assert {ARGS.tls_cert.rsplit("/", 1)[1], ARGS.tls_key.rsplit("/", 1)[1]} == {"tls.crt", "tls.key"}, \
        "kubernetes.io/tls secrets hold tls.crt and tls.key"
    assert tls["secretName"] == "advantage-tls"


def test_pod_runs_as_the_images_user():
    uid, gid = (int(x) for x in last(STAGES["gpu"], "USER").split(":"))
    ctx = POD["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid and ctx["runAsGroup"] == gid
    assert CONTAINER["securityContext"]["allowPrivilegeEscalation"] is False
    assert CONTAINER["image"].startswith("advantage-service:gpu")


def test_headless_service_hpa_and_pdb_select_the_deployment():
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = DOCS["Service"]["spec"]
    assert service["clusterIP"] == "None", "headless: clients see every pod and balance with round_robin"
    assert service["selector"].items() <= labels.items()
    container_ports = {p["name"] for p in CONTAINER["ports"]}
    assert {p["targetPort"] for p in service["ports"]} <= container_ports
    assert {p["port"] for p in service["ports"] if p["name"] == "grpc"} == {ARGS.port}
    target = DOCS["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", DEPLOYMENT["metadata"]["name"])
    hpa = DOCS["HorizontalPodAutoscaler"]["spec"]
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pods_metrics = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert pods_metrics == ["advantage_requests_in_flight"]  # a series the server exports
    assert DOCS["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_deployment_args_start_a_server_the_kubelet_can_probe(tmp_path):
    """The container's arguments, with the secrets written to files, ports made free and the host loopback:
    the kubelet's probes (plaintext grpc.health.v1 on the health port) see SERVING, and a client with the CA and
    the token computes over TLS on the main port."""
    pki = make_pki(tmp_path)
    token = tmp_path / "token"
    token.write_text("k8s-example-token\n")
    files = {ARGS.tls_cert: pki["server_cert"], ARGS.tls_key: pki["server_key"], ARGS.auth_token_file: token}
    ports = {ARGS.port: free_port(), ARGS.health_port: free_port(), ARGS.metrics_port: free_port()}
    args = []
    for arg in CONTAINER["args"]:
        flag, value = arg.split("=", 1)
        if flag in ("--host", "--port", "--device", "--metrics-host"):  # loopback only in tests
            continue
        value = str(files.get(value, ports.get(int(value), value) if value.isdigit() else value))
        args.append(f"{flag}={value}")
    srv = ServerProcess(tmp_path, ports[ARGS.port], *args, name="k8s")
    try:
        srv.wait_listening()
        with grpc.insecure_channel(f"127.0.0.1:{ports[ARGS.health_port]}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE):  # liveness, readiness
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with AdvantageClient(f"localhost:{ports[ARGS.port]}", timeout=30.0, tls_ca=str(pki["ca"]),
                             token_file=str(token)) as client:
            res = client.compute("raw_reward", rewards=np.array([1.0, 3.0], np.float32),
                                 mask=np.ones((2, 2), np.float32))
        assert res.advantages.shape == (2, 2)
    finally:
        srv.proc.terminate()
        assert srv.wait(timeout=30) == 0, srv.stderr
        srv.close()


def test_the_images_numba_cache_stays_visible_and_the_startup_probe_waits_for_the_warm_up():
    """The image's filled numba cache (Dockerfile NUMBA_CACHE_DIR) is neither overridden by the container's env
    nor hidden by a volume mounted at or above it; read-only there, the server copies it into /tmp, which must be
    a writable volume under the read-only root filesystem. The startup probe (health NOT_SERVING while the
    server warms) allows a cold compile (~20 s of CPU; at least 120 s) before liveness applies."""
    cache = numba_cache_dir(STAGES["gpu"])
    assert "NUMBA_CACHE_DIR" not in {e["name"] for e in CONTAINER.get("env", [])}
    for mount in CONTAINER["volumeMounts"]:
        path = mount["mountPath"].rstrip("/") + "/"
        assert not (cache + "/").startswith(path), f"{mount['mountPath']} hides the image's numba cache {cache}"
    assert CONTAINER["securityContext"]["readOnlyRootFilesystem"] is True
    tmp = next(m for m in CONTAINER["volumeMounts"] if m["mountPath"] == "/tmp")
    assert not tmp.get("readOnly") and "emptyDir" in {v["name"]: v for v in POD["volumes"]}[tmp["name"]]
    startup = CONTAINER["startupProbe"]
    assert startup["grpc"].get("service", "") == "" and startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert ARGS.warmup is True, "the Deployment's server warms before SERVING"
