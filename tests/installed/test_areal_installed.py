"""AReaL as its users install it (issue #28): run in a venv holding ``areal==1.0.4`` installed with its declared
dependencies (tests/installed/requirements-areal.txt, built by ``make test-frameworks``; what differs from AReaL's
declaration is listed there and in the README), never in the project's venv (it skips where ``areal`` cannot be
imported as a package with its engine stack). Nothing of AReaL is stubbed or loaded by a project loader: AReaL is
imported as a user imports it.

The README's literal adoption on a real engine actor: AReaL's ``FSDPPPOActor`` is built on the CPU from a
``PPOActorConfig`` whose ``path`` is a local directory holding only a tiny model ``config.json`` (written by the
test: nothing is downloaded, no weights exist), and left uninitialised (no process group, no model; AReaL's
``compute_advantages`` needs neither). One engine keeps AReaL's own ``PPOActor``; on a second engine from the same
config the README's two lines run as written::

    from advantage_client.areal import RemotePPOActor
    engine.actor = RemotePPOActor(engine.config, engine)   # the server: $ADVANTAGE_SERVICE_TARGET

Both engines' own ``compute_advantages`` (``FSDPPPOActor``'s, which delegates to ``self.actor``; AReaL's
``batched_call`` concatenates the trajectories and splits the result back) run on copies of the same rollout
trajectories, for six configurations (PPO with a critic and a reference model, GRPO group normalisation,
``adv_norm`` batch, KL k3 with ``mask_no_eos_with_zero``, recomputed log-probs with k2, the decoupled loss).
Every key AReaL returns in every trajectory is compared: the computed ones (``advantages``, ``returns``,
``kl_rewards``, ``tot_rewards``) per position by the differential tests' rule (tests/test_diff_areal.py:
``|remote - AReaL| <= rtol |AReaL| + atol max(1, max |AReaL|)``, float32 2e-4 / 2e-5, float64 1e-9 / 1e-9),
every other key (``loss_mask``, ``logprobs``, ``prox_logp``, ``ref_logp``, ``rewards``, ...) bitwise; dtypes,
shapes and devices equal. Four cases carry float64 critic values and log-probs, so their ``advantages`` and
``returns`` are float64 and held to 1e-9: an answer scaled by 1.0001 fails there (the float32 rule's rtol 2e-4
alone would let it pass). ``kl_rewards`` and ``tot_rewards`` are float32 in AReaL whatever the input dtype
(its KL estimator casts to float32), so they are also held to 4 float32 units in the last place
(``|d| <= 4.8e-7 |AReaL|``, within the rule): the service reproduces AReaL's float32 KL steps, and a scale of
1.0001 fails them too.

Counting at the server: the service runs from the project's main venv (``$ADVANTAGE_SERVER_BIN``, default
``.venv/bin/advantage-server``) in its own process, and ``advantage_requests_total`` is read at its metrics port:
AReaL's own engine adds +0, the swapped one +2 per ``compute_advantages`` (the advantages, then the token rewards;
module ``advantage_client.areal``), +12 over the six cases.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _missing_areal_dependencies() -> list[str]:
    """AReaL's base requirements (its metadata) that are not installed here; ['areal'] without AReaL."""
    try:
        requires = importlib.metadata.requires("areal") or []
    except importlib.metadata.PackageNotFoundError:
        return ["areal"]
    missing = []
    for req in requires:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0]
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


# The project's venv holds areal --no-deps for the differential tests: skip there, and only there. Where AReaL's
# dependencies are installed, a failing import below fails the run.
if _missing_areal_dependencies():
    pytest.skip(f"AReaL 1.0.4 with its dependencies is not installed here (missing: "
                f"{', '.join(_missing_areal_dependencies()[:5])}, ...): run by `make test-frameworks`",
                allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from areal.api.cli_args import NormConfig, PPOActorConfig  # noqa: E402
from areal.engine.fsdp_engine import FSDPPPOActor  # noqa: E402
from areal.trainer.ppo.actor import PPOActor  # noqa: E402

# PPOActor logs its whole configuration at INFO on every construction (12 here): WARNING keeps the run's output short
logging.getLogger("PPOActor").setLevel(logging.WARNING)

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPUTED = ("advantages", "returns", "kl_rewards", "tot_rewards")
TOL = {torch.float32: (2e-4, 2e-5), torch.float64: (1e-9, 1e-9)}  # tests/test_diff_areal.py's rule
ULP4 = 4 * torch.finfo(torch.float32).eps  # 4 float32 units in the last place, relative (4.8e-7)

#: A tiny causal LM's configuration (Qwen2 layout): all AReaL's engine reads at construction
#: (``AutoConfig.from_pretrained(config.path)``); no weights, no tokenizer, nothing fetched.
TINY_MODEL = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 64, "torch_dtype": "float32"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(metrics: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^advantage_requests_total\{[^}]*\} (\S+)$", text, re.M))


@contextlib.contextmanager
def serving(binary: str):
    """``binary`` (an ``advantage-server``) on free loopback ports, until the block ends: (address, metrics)."""
    port, mport = _free_port(), _free_port()
    proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--metrics-port", str(mport), "--no-warmup", "--log-level", "WARNING"])
    metrics = f"127.0.0.1:{mport}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _requests(metrics)
            break
        except OSError:
            assert proc.poll() is None, f"{binary} exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            time.sleep(0.5)
    try:
        yield f"127.0.0.1:{port}", metrics
    finally:
        proc.terminate()
        proc.wait(30)


#: the server the tests call: the project's own (.venv), or $ADVANTAGE_SERVER_BIN
SERVER_BIN = os.environ.get("ADVANTAGE_SERVER_BIN", str(ROOT / ".venv" / "bin" / "advantage-server"))


@pytest.fixture(scope="module")
def service():
    with serving(SERVER_BIN) as s:
        yield s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    (path / "config.json").write_text(json.dumps(TINY_MODEL))
    return path


def trajectories(seed: int, groups: int, n: int, *, values: bool = False, ref: bool = False, prox: bool = False,
                 dtype=torch.float32, full: float = 0.3, first: bool = False) -> list[dict]:
    """AReaL rollout trajectories: one dict per prompt with its ``n`` samples ``[n, L]`` (L: the group's longest
    sequence), prompt then response then padding; a share ``full`` of the rows fill the batch's widest
    trajectory, so after AReaL's concatenation they have no end token. ``first``: some rows train their first
    column (AReaL's circular roll brings it to the last column)."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(6, 11))
    out = []
    for g in range(groups):
        prompt = int(rng.integers(1, 4))
        seqlen = rng.integers(prompt + 1, width + 1, n)
        seqlen[rng.random(n) < full] = width if g == 0 else seqlen.max()
        if g == 0:
            seqlen[0] = width  # the batch's width: row 0 of group 0 has no end token
        L = int(seqlen.max())
        cols = np.arange(L)[None, :]
        attention = (cols < seqlen[:, None]).astype(np.int64)
        loss = ((cols >= prompt) & (cols < seqlen[:, None])).astype(np.int64)
        loss[rng.random(n) < 0.2, prompt] = 0  # a hole
        if first:
            loss[rng.random(n) < 0.6, 0] = 1
        d = {
            "input_ids": torch.from_numpy(rng.integers(3, 100, (n, L)) * attention),
            "attention_mask": torch.from_numpy(attention),
            "loss_mask": torch.from_numpy(loss),
            "logprobs": torch.from_numpy(-rng.uniform(0.01, 3.0, (n, L)) * loss).to(dtype),
            "rewards": torch.from_numpy(rng.choice([0.0, 1.0, 0.5, -1.0], n)).to(dtype),
        }
        if ref:
            d["ref_logp"] = torch.from_numpy(-rng.uniform(0.01, 3.0, (n, L))).to(dtype)
        if values:
            d["values"] = torch.from_numpy(rng.normal(0, 1, (n, L))).to(dtype)
        if prox:
            d["prox_logp"] = torch.from_numpy(-rng.uniform(0.01, 3.0, (n, L))).to(dtype)
        out.append(d)
    return out


F64 = torch.float64
CASES = {
    # PPO: a critic, discount and lambda < 1, the KL reward against a reference model, reward bias and scaling
    "ppo_values": (dict(discount=0.99, gae_lambda=0.95, kl_ctl=0.1, reward_bias=-0.5, reward_scaling=2.0),
                   dict(values=True, ref=True, first=True, dtype=F64)),
    # AReaL's GRPO examples: no values, group reward normalisation, no KL (float32, as AReaL's rollouts are)
    "grpo_group_norm": (dict(kl_ctl=0.0, reward_norm=dict(mean_level="group", std_level="group", group_size=4)),
                        dict()),
    # GRPO with leave-one-out group means and a batch-normalised advantage
    "grpo_adv_norm_batch": (dict(kl_ctl=0.0, reward_norm=dict(mean_level="group", mean_leave1out=True,
                                                              std_level=None, group_size=4),
                                 adv_norm=dict(mean_level="batch", std_level="batch")), dict()),
    # the KL reward (k3, no reference model); rows without an end token lose their reward; a critic
    "kl_k3_mask_no_eos": (dict(kl_ctl=0.3, kl_estimator="k3", mask_no_eos_with_zero=True, reward_clip=0.75,
                               discount=0.95), dict(full=0.5, first=True, values=True, dtype=F64)),
    # recomputed log-probs (prox_logp, not rolled) with a k2 KL against a reference, a critic
    "recompute_prox_k2": (dict(kl_ctl=0.2, kl_estimator="k2", recompute_logprob=True, discount=0.9),
                          dict(ref=True, prox=True, values=True, dtype=F64)),
    # the decoupled loss: logprobs rolled, prox_logp left as given; a critic
    "decoupled": (dict(kl_ctl=0.1, use_decoupled_loss=True, recompute_logprob=True, discount=0.97, gae_lambda=0.9),
                  dict(ref=True, prox=True, values=True, dtype=F64)),
}


def _config(model_dir: pathlib.Path, kw: dict) -> PPOActorConfig:
    kw = dict(kw)
    for key in ("reward_norm", "adv_norm"):
        if key in kw:
            kw[key] = NormConfig(**kw[key])
    return PPOActorConfig(experiment_name="advantage-service", trial_name="areal-installed", path=str(model_dir),
                          dtype="float32", attn_impl="sdpa", **kw)


def _rule(key: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when ``got`` meets the differential tests' rule against ``want`` (``kl_rewards`` and ``tot_rewards``
    also within 4 float32 ulp: module docstring)."""
    rtol, atol = TOL[want.dtype]
    w, g = want.double(), got.double()
    bound = rtol * w.abs() + atol * max(1.0, float(w.abs().max()) if w.numel() else 0.0)
    if key in ("kl_rewards", "tot_rewards"):
        assert want.dtype == torch.float32, (key, want.dtype)
        bound = torch.minimum(bound, ULP4 * w.abs() + torch.finfo(torch.float32).tiny)
    bad = (g - w).abs() > bound
    if not bad.any():
        return ""
    i = tuple(int(x) for x in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {g.numel()} positions differ, e.g. at {i}: service {float(g[i])!r}, "
            f"AReaL {float(w[i])!r}")


def compare(got: list[dict], want: list[dict]) -> float:
    """Every key of every trajectory (module docstring); returns the largest |remote - AReaL| of a computed key."""
    assert len(got) == len(want)
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), (i, sorted(g), sorted(w))
        for key, wv in w.items():
            gv = g[key]
            if not isinstance(wv, torch.Tensor):
                assert gv == wv, (i, key)
                continue
            assert gv.dtype == wv.dtype and gv.shape == wv.shape and gv.device == wv.device, \
                (i, key, gv.dtype, wv.dtype, gv.shape, wv.shape)
            if key in COMPUTED:
                assert torch.isfinite(wv).all(), (i, key)
                why = _rule(key, gv, wv)
                assert not why, f"trajectory {i} {key}: {why}"
                worst = max(worst, float((gv.double() - wv.double()).abs().max()))
            else:
                assert torch.equal(gv, wv), f"trajectory {i} {key}: {gv.tolist()} != {wv.tolist()}"
    return worst


def test_areal_is_the_installed_release():
    """AReaL, torch and the engine's imports are the installed packages (no stand-in module anywhere)."""
    import areal
    import transformers

    assert importlib.metadata.version("areal") == "1.0.4"
    site = pathlib.Path(importlib.metadata.distribution("areal").locate_file("areal")).resolve()
    assert pathlib.Path(areal.__file__).resolve().parent == site, (areal.__file__, site)
    assert transformers.__file__ and torch.__file__
    for name in ("areal.engine.fsdp_engine", "areal.trainer.ppo.actor", "areal.utils.data", "peft", "torchdata"):
        mod = sys.modules[name]
        assert getattr(mod, "__file__", None) and pathlib.Path(mod.__file__).exists(), name


def test_readme_engine_swap_on_fsdp_ppo_actor(service, model_dir, monkeypatch):
    address, metrics = service
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", address)
    from advantage_client.areal import RemotePPOActor  # the README's import

    total = 0.0
    for name, (config_kw, data_kw) in CASES.items():
        stock = FSDPPPOActor(_config(model_dir, config_kw))
        engine = FSDPPPOActor(_config(model_dir, config_kw))
        engine.actor = RemotePPOActor(engine.config, engine)  # the README's swap
        assert type(stock.actor) is PPOActor and isinstance(engine.actor, PPOActor)
        assert type(engine.actor).__mro__[2] is PPOActor, type(engine.actor).__mro__
        assert engine.actor.engine is engine and not engine.initialized and not torch.distributed.is_initialized()
        assert engine.model_config.model_type == "qwen2"

        data = trajectories(sum(map(ord, name)), groups=3, n=4, **data_kw)
        before = _requests(metrics)
        want = stock.compute_advantages(copy.deepcopy(data))
        mid = _requests(metrics)
        got = engine.compute_advantages(copy.deepcopy(data))
        after = _requests(metrics)
        assert mid - before == 0, f"{name}: AReaL's own actor reached the service (+{mid - before})"
        assert after - mid == 2, f"{name}: the swapped actor made +{after - mid} requests, want +2"
        total += after - mid

        assert {"advantages", "returns", "kl_rewards", "tot_rewards", "loss_mask", "logprobs"} <= set(want[0])
        worst = compare(got, want)
        dtypes = sorted({str(want[0][k].dtype).removeprefix("torch.") for k in ("advantages", "returns")})
        print(f"AReaL as installed, {name}: +{after - mid:.0f} requests, advantages/returns {'/'.join(dtypes)}, "
              f"max |diff| {worst:.3g}")
        if name == "kl_k3_mask_no_eos":  # rows with and without an end token, KL nonzero
            assert any(bool((t["attention_mask"].sum(-1) == t["attention_mask"].shape[1]).any()) for t in want)
            assert any(bool((t["kl_rewards"] != 0).any()) for t in want)
    assert total == 2 * len(CASES) == 12
