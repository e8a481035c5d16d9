"""The client alone, without torch: the ``advantage-client`` distribution (``client/pyproject.toml``).

* ``client/pyproject.toml`` keeps the root's version and the client's four dependencies;
* every ``advantage_client`` module imports and encodes/decodes with torch unimportable (results are NumPy);
* (slow) a fresh virtual environment without torch gets grpcio, grpcio-status, protobuf and numpy (the
  versions this .venv has, so pip's cache or the local wheel indexes serve them) and then the client alone
  (``pip install --no-deps`` of the repository's ``client/``); a real ``advantage-server`` from this .venv
  answers its GRPO and GAE calls (sync client over each transport: auto, unary, stream, shared memory; and
  the asyncio client) with NumPy arrays equal to what the server's estimators give in-process.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from test_server_cli import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIENT_DEPENDENCIES = ("grpcio", "grpcio-status", "protobuf", "numpy")

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


def _project(path: pathlib.Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _name(requirement: str) -> str:
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].strip().lower()
    return requirement.strip().lower()


def test_client_distribution_matches_the_root():
    root, client = _project(ROOT / "pyproject.toml"), _project(ROOT / "client" / "pyproject.toml")
    assert root["name"] == "advantage-service" and client["name"] == "advantage-client"
    assert client["version"] == root["version"]
    deps = {_name(r): r for r in client["dependencies"]}
    assert sorted(deps) == sorted(CLIENT_DEPENDENCIES), "the client depends on these four only (no torch)"
    root_deps = {_name(r): r for r in root["dependencies"]}
    for name, requirement in deps.items():  # the same bounds as the whole service
        assert requirement == root_deps[name], (requirement, root_deps[name])
    assert (ROOT / "client" / "advantage_client" / "py.typed").exists()


NO_TORCH = r"""
import importlib, pkgutil, sys
sys.modules["torch"] = None          # `import torch` raises ImportError
sys.modules["advantage_server"] = None
import numpy as np
import advantage_client
from advantage_client import wire
assert wire.torch is None
names = [m.name for m in pkgutil.walk_packages(advantage_client.__path__, "advantage_client.")]
for name in names:
    importlib.import_module(name)
from advantage_client.client import build_request, decode_result
from advantage_client.proto import advantage_pb2 as pb
request = build_request("grpo", {"normalize_rewards": True}, prompt_ids=["a", "a", "b"],
                        rewards=np.array([1.0, 0.0, 1.0], np.float32), mask=np.ones((3, 2), np.float32))
assert list(request.inputs["prompt_ids"].shape) == [3]
msg = pb.AdvantageResult(advantages=wire.encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3)))
result = decode_result(msg)
assert type(result.advantages) is np.ndarray and result.advantages.shape == (2, 3)
print(len(names))
"""


def test_every_client_module_works_without_torch():
    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "client")})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 10


# run in the fresh environment: compute through the server, save the results (and what was imported)
FRESH_CLIENT = r"""
import asyncio, importlib.util, json, sys
import numpy as np
import advantage_client
from advantage_client import AdvantageClient, AsyncAdvantageClient, GAEConfig

target, out_path = sys.argv[1], sys.argv[2]
inputs = np.load(out_path + ".in.npz")
grpo_cfg = {"normalize_rewards": True, "use_leave_one_out_baseline": False}
gae_cfg = GAEConfig(gae_gamma=0.99, gae_lambda=0.95)
results = {}
with AdvantageClient(target, timeout=60) as client:
    for transport in ("auto", "unary", "stream", "shm"):
        r = client.compute("grpo", grpo_cfg, prompt_ids=inputs["prompt_ids"], rewards=inputs["rewards"],
                           mask=inputs["mask"], transport=transport)
        assert type(r.advantages) is np.ndarray and r.returns is None, (transport, type(r.advantages))
        results[f"grpo_{transport}"] = r.advantages
        if transport == "auto":
            used = client.last_transport  # unary for a batch this small
        r = client.compute("gae", gae_cfg, rewards=inputs["token_rewards"], mask=inputs["mask"],
                           values=inputs["values"], transport=transport)
        assert type(r.advantages) is np.ndarray and type(r.returns) is np.ndarray, transport
        results[f"gae_{transport}_advantages"], results[f"gae_{transport}_returns"] = r.advantages, r.returns

async def aio():
    async with AsyncAdvantageClient(target, timeout=60) as client:
        return await client.compute("gae", gae_cfg, rewards=inputs["token_rewards"], mask=inputs["mask"],
                                    values=inputs["values"])

r = asyncio.run(aio())
assert type(r.advantages) is np.ndarray and type(r.returns) is np.ndarray
results["gae_aio_advantages"], results["gae_aio_returns"] = r.advantages, r.returns
np.savez(out_path, **results)
print(json.dumps({"client": advantage_client.__file__, "torch": importlib.util.find_spec("torch") is not None,
                  "server": importlib.util.find_spec("advantage_server") is not None, "auto": used}))
"""


def _pip(python: pathlib.Path, *args: str, timeout: float) -> None:
    out = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"pip install {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"


@pytest.mark.slow
def test_client_alone_in_a_fresh_venv_without_torch(tmp_path, capsys):
    started = time.monotonic()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # the client's dependencies (and theirs, and setuptools to build it) at the versions of this .venv
    pins = []
    for name in (*CLIENT_DEPENDENCIES, "googleapis-common-protos", "typing-extensions", "setuptools"):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:  # not needed by these versions: pip picks if at all
            assert name not in CLIENT_DEPENDENCIES
    _pip(python, *pins, timeout=300)
    # the client alone, from the repository's client/ (copied, so the build leaves nothing in the checkout)
    source = tmp_path / "client"
    shutil.copytree(ROOT / "client", source,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    _pip(python, "--no-deps", "--no-build-isolation", str(source), timeout=300)
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                               capture_output=True, text=True, check=True, timeout=120).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "torch" not in names and "advantage-service" not in names and "advantage-client" in names, names
    setup_s = time.monotonic() - started

    rng = np.random.default_rng(7)
    B, T = 12, 9
    mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, size=B)[:, None]).astype(np.float32)
    inputs = {"prompt_ids": np.repeat(np.arange(3), 4).astype(np.int64),
              "rewards": rng.integers(0, 2, size=B).astype(np.float32),
              "token_rewards": (rng.standard_normal((B, T)) * mask).astype(np.float32),
              "values": rng.standard_normal((B, T)).astype(np.float32), "mask": mask}
    out = tmp_path / "results"
    np.savez(str(out) + ".in.npz", **inputs)

    srv = ServerProcess(tmp_path, 0, name="server")
    try:
        address = srv.wait_listening().group(1)
        assert not address.endswith(":0"), address
        run = subprocess.run([str(python), "-c", FRESH_CLIENT, address, str(out)], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path, env={k: v for k, v in os.environ.items()
                                                             if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
        assert run.returncode == 0, f"stdout: {run.stdout}\nstderr: {run.stderr}\nserver: {srv.stderr}"
    finally:
        srv.close()
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["client"].startswith(str(venv)), seen  # the installed copy, not the checkout
    assert not seen["torch"] and not seen["server"], seen

    # what the server's estimators give in-process (this .venv, torch)
    import torch

    from advantage_server.core import AdvantageCore
    core = AdvantageCore("cpu")
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    grpo = core.run("grpo", {"normalize_rewards": True, "use_leave_one_out_baseline": False},
                    {"prompt_ids": t["prompt_ids"], "rewards": t["rewards"], "mask": t["mask"]})
    gae = core.run("gae", {"gae_gamma": 0.99, "gae_lambda": 0.95},
                   {"rewards": t["token_rewards"], "mask": t["mask"], "values": t["values"]})
    got = np.load(str(out) + ".npz")
    for transport in ("auto", "unary", "stream", "shm"):
        np.testing.assert_allclose(got[f"grpo_{transport}"], grpo.advantages.numpy(), rtol=1e-6, atol=1e-6)
    for kind in ("auto", "unary", "stream", "shm", "aio"):
        np.testing.assert_allclose(got[f"gae_{kind}_advantages"], gae.advantages.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[f"gae_{kind}_returns"], gae.returns.numpy(), rtol=1e-6, atol=1e-6)
    assert np.abs(grpo.advantages.numpy()).sum() > 0 and np.abs(gae.advantages.numpy()).sum() > 0
    with capsys.disabled():
        print(f"\n[client-only] fresh venv without torch: set up in {setup_s:.1f} s, "
              f"{sum(f.stat().st_size for f in venv.rglob('*') if f.is_file()) >> 20} MiB; "
              f"GRPO and GAE through a real server in {time.monotonic() - started - setup_s:.1f} s "
              f"(auto chose {seen['auto']})")
