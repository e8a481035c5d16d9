"""AReaL's own launch, single controller (issue #36 item 2), run by ``make test-frameworks`` in ``.venv-areal``
(``areal==1.0.4`` with its declared dependencies, Ray included; tests/installed/requirements-areal.txt). It skips
where AReaL's dependencies are missing, as test_areal_installed.py does.

AReaL's documented launch is ``python3 <script>.py --config <yaml> scheduler.type=local|ray ...``: the trainer
(``PPOTrainer``) is a single controller, ``trainer.actor`` is a ``PPOActorController`` and the engines run in worker
processes that AReaL's scheduler starts (``LocalScheduler``: a process per worker; ``RayScheduler``: a Ray actor
per worker) and that build the engine from the class path the controller sends them. The one documented change::

    python -m advantage_client.areal <script>.py --config <yaml> scheduler.type=local ...   # was: python3 <script>.py

What runs, unchanged and as installed: ``areal_launch/tiny_rl.py`` (a script in the shape of AReaL's
examples/math/gsm8k_rl.py: AReaL's ``load_expr_config``, ``PPOTrainer``; eight prompts in memory in place of
GSM8K), ``areal_launch/tiny_grpo_cpu.yaml`` (AReaL's CPU GRPO example cut down: a tiny Qwen2 built from its
config.json with ``init_from_scratch``, a colocated reference model, ``kl_ctl`` 0.1), then AReaL's own
``PPOTrainer.__init__``: its scheduler, ``_create_train_engine`` (actor and ref controllers), each controller's
``initialize`` (workers started, the FSDP engines built and initialised on the CPU with gloo), all over AReaL's RPC.

What is stubbed (``areal_launch/sitecustomize.py``, loaded only with ``ADVANTAGE_TEST_AREAL_LAUNCH=1``): the GPU
stack, i.e. ``PPOTrainer._init_rollout``, which starts the vLLM/SGLang inference servers, is the probe: there it
runs the trainer's own ``self.actor.compute_advantages`` (the controller -> the worker's engine) and AReaL's own
``PPOActor.compute_advantages`` in the driver on copies of the same trajectories, two batches (float32 rollouts;
float64 critic values), and ends the launch. Also: AReaL's worker addresses are pinned to 127.0.0.1 (AReaL uses the
host's interface address; the yaml binds the workers to 127.0.0.1), and the driver drops
``$ADVANTAGE_SERVICE_TARGET`` before the workers start, so they get it only through AReaL's
``scheduling_spec[i].env_vars`` (the way it reaches workers on other nodes).

Checked: the service (``$ADVANTAGE_SERVER_BIN``, default ``.venv/bin/advantage-server``, its own process) counts
+4 requests with the launcher (+2 per ``compute_advantages``: advantages, then token rewards) and +0 without it;
every key of every trajectory equals AReaL's own by test_areal_installed.compare (the differential tests' rule, float64
returns and advantages to 1e-9, ``kl_rewards``/``tot_rewards`` to 4 float32 ulp, every other key bitwise); the worker
built ``advantage_client.areal.RemoteFSDPPPOActor`` for the actor and AReaL's ``FSDPPPOActor`` for the ref.
Checked at x1.0001, every run: ``test_the_comparison_fails_for_a_server_off_by_1e_4`` launches against the same
server with ``advantage_server.core.AdvantageCore.run``'s advantages and returns multiplied by 1.0001
(``areal_launch/scaled_server.py``): both batches fail the comparison (by hand, 2026-12-06: ``kl_rewards`` of the
float32 one, 14 of 36 positions beyond 4 float32 ulp; ``returns`` of the float64 one, 36 of 36 beyond 1e-9; the
in-process controller test failed on ``returns`` too, and the plain launch still passed, +0). The Ray case compares
the same way.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from test_areal_installed import TINY_MODEL, _config, _requests, compare, model_dir, service  # noqa: F401

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on 127.0.0.1 only (tests/conftest.py says why)

import torch  # noqa: E402

import advantage_client.areal as dropin  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
LAUNCH = HERE / "areal_launch"
SCRIPT, CONFIG = LAUNCH / "tiny_rl.py", LAUNCH / "tiny_grpo_cpu.yaml"
LAUNCHES = {
    "launcher": [sys.executable, "-m", "advantage_client.areal", str(SCRIPT)],  # the documented change
    "plain": [sys.executable, str(SCRIPT)],                                      # AReaL's own: +0
}
REQUESTS_PER_LAUNCH = 4  # two batches, +2 each


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A tiny Qwen2 for AReaL's launch: config.json (built with ``init_from_scratch``: no weights) and a word-level
    tokenizer ``t3 .. t127`` (AReaL's trainer loads the tokenizer); nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-qwen2-launch")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, TINY_MODEL["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({**TINY_MODEL, "eos_token_id": 1, "pad_token_id": 0}))
    return path


def _launch(service, tiny_model, tmp_path, launch: str, scheduler: str, *overrides: str) -> tuple[dict, dict, float]:
    """Runs ``LAUNCHES[launch]`` with AReaL's ``scheduler.type=scheduler`` and ``overrides``; returns (what the probe
    saw, its results ``{batch: {"got": [...], "want": [...]}}``, the requests the service counted meanwhile)."""
    address, metrics = service
    probe = tmp_path / "probe.json"
    env = {**os.environ, "ADVANTAGE_SERVICE_TARGET": address, "ADVANTAGE_TEST_AREAL_LAUNCH": "1",
           "ADVANTAGE_TEST_AREAL_PROBE": str(probe), "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": "local",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(LAUNCH), str(HERE), os.environ.get("PYTHONPATH")]))}
    args = ["--config", str(CONFIG), f"scheduler.type={scheduler}", f"actor.path={tiny_model}",
            f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'name_resolve'}",
            *overrides]
    before = _requests(metrics)
    done = subprocess.run([*LAUNCHES[launch], *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    added = _requests(metrics) - before
    log = done.stdout[-3000:] + done.stderr[-8000:]
    assert done.returncode != 0 and "ProbeDone: advantage test probe done" in log, log  # reached the probe, no further
    return json.loads(probe.read_text()), torch.load(str(probe) + ".pt"), added


#: scheduler -> AReaL overrides: the yaml's reference model (a second engine on the actor's worker: +20-30 s a launch
#: here) runs in the local case; the others drop it (hydra's ``~ref``), the probe's batches carry their own ref_logp
SCHEDULERS = {"local": (), "ray": ("~ref",)}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_areals_launch_with_the_launcher_reaches_the_service(service, tiny_model, tmp_path, scheduler):
    """The launch with the launcher, on AReaL's local and Ray schedulers (module docstring)."""
    address, _ = service
    seen, results, added = _launch(service, tiny_model, tmp_path, "launcher", scheduler, *SCHEDULERS[scheduler])
    assert seen["scheduler"] == {"local": "LocalScheduler", "ray": "RayScheduler"}[scheduler], seen
    assert seen["controller"] == "PPOActorController", seen
    assert seen["train_engine"] == "advantage_client.areal.RemoteFSDPPPOActor", seen  # the class the worker built
    if not SCHEDULERS[scheduler]:  # the ref keeps AReaL's engine (only the actor's computes advantages)
        assert seen["ref_controller"] == "PPOActorController", seen
        assert seen["ref_engine"] == "areal.engine.fsdp_engine.FSDPPPOActor", seen
    # the workers got the target through AReaL's scheduling_spec env_vars only (the driver dropped it before)
    assert seen["actor_env_vars"].get("ADVANTAGE_SERVICE_TARGET") == address, seen
    assert seen["driver_target"] == address and seen["driver_target_at_probe"] is None, seen
    assert added == REQUESTS_PER_LAUNCH, f"the service counted +{added}, want +{REQUESTS_PER_LAUNCH}"
    failed = {}
    for name, r in results.items():  # each batch, so a failure names every batch that fails
        try:
            worst = compare(r["got"], r["want"])
        except AssertionError as exc:
            failed[name] = str(exc).splitlines()[0]
            continue
        print(f"AReaL launch, {scheduler} scheduler, {name}: every key equal to AReaL's own, max |diff| {worst:.3g}")
    assert not failed, failed
    assert results["values_float64"]["want"][0]["returns"].dtype == torch.float64
    assert any(bool((t["kl_rewards"] != 0).any()) for t in results["rollout_float32"]["want"])


@pytest.fixture(scope="module")
def scaled_service(tmp_path_factory):
    """The same server, every advantage and return multiplied by 1.0001 (areal_launch/scaled_server.py, run by the
    python of the server ``service`` runs)."""
    from test_areal_installed import SERVER_BIN, serving

    wrapper = tmp_path_factory.mktemp("scaled") / "advantage-server-scaled"
    wrapper.write_text(f"#!/bin/sh\nexec {pathlib.Path(SERVER_BIN).parent / 'python'} {LAUNCH / 'scaled_server.py'} "
                       f"\"$@\"\n")
    wrapper.chmod(0o755)
    with serving(str(wrapper)) as s:
        yield s


def test_the_comparison_fails_for_a_server_off_by_1e_4(scaled_service, tiny_model, tmp_path):
    """The launcher's launch (local scheduler, no ref) against ``scaled_service``: the service counts its +4, and
    the comparison with AReaL's own numbers fails in both batches (float32 ``kl_rewards``, float64 ``returns``):
    the rule above tells a server 1e-4 wrong from a right one."""
    _, results, added = _launch(scaled_service, tiny_model, tmp_path, "launcher", "local", "~ref")
    assert added == REQUESTS_PER_LAUNCH
    for name, r in results.items():
        with pytest.raises(AssertionError):
            compare(r["got"], r["want"])


def test_areals_launch_without_the_launcher_keeps_areals_engine(service, tiny_model, tmp_path):
    """The same launch with ``python3`` (AReaL's own): the worker builds AReaL's ``FSDPPPOActor``, the service
    counts +0: what the launcher adds above."""
    seen, results, added = _launch(service, tiny_model, tmp_path, "plain", "local", "~ref")
    assert seen["train_engine"] == "areal.engine.fsdp_engine.FSDPPPOActor", seen
    assert "ADVANTAGE_SERVICE_TARGET" not in seen["actor_env_vars"], seen
    assert added == 0, f"AReaL's own launch reached the service (+{added})"
    for r in results.values():
        assert compare(r["got"], r["want"]) == 0.0


def test_the_controller_path_in_process(service, model_dir, monkeypatch):
    """What the launcher does to the actor's controller, on AReaL's own ``FSDPPPOActor.as_controller`` (before
    ``initialize``): its ``train_engine`` becomes the class AReaL's worker imports by path (AReaL's own
    ``import_from_string``, as areal/infra/rpc/rpc_server.py does), its config's ``scheduling_spec`` env_vars carry
    the target; the README's swap on a controller raises, naming the launcher; that class, built as a worker builds
    it, computes on the service (+2) and equals AReaL's own engine."""
    import copy

    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.utils.dynamic_import import import_from_string

    from test_areal_installed import CASES, trajectories

    address, metrics = service
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", address)
    config_kw, data_kw = CASES["ppo_values"]
    config_kw = {**config_kw, "backend": "fsdp:d1p1t1"}  # one worker, as the launch's yaml
    controller = FSDPPPOActor.as_controller(_config(model_dir, config_kw), None)  # as _create_train_engine does
    with pytest.raises(TypeError, match=r"python -m advantage_client\.areal"):
        dropin.RemotePPOActor(controller.config, controller)  # the README's swap: would never run
    assert dropin.use_service(controller) is controller
    assert controller.train_engine is dropin.RemoteFSDPPPOActor
    assert import_from_string("advantage_client.areal.RemoteFSDPPPOActor") is controller.train_engine
    assert all(spec.env_vars["ADVANTAGE_SERVICE_TARGET"] == address for spec in controller.config.scheduling_spec)
    dropin.use_service(controller)  # idempotent
    assert controller.train_engine is dropin.RemoteFSDPPPOActor
    controller.workers = ["started"]
    with pytest.raises(RuntimeError, match="after controller.initialize"):
        dropin.use_service(controller)

    monkeypatch.delenv("ADVANTAGE_SERVICE_TARGET")  # as in a worker: only the env_vars AReaL gives it
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", controller.config.scheduling_spec[0].env_vars[
        "ADVANTAGE_SERVICE_TARGET"])
    engine = controller.train_engine(_config(model_dir, config_kw))
    stock = FSDPPPOActor(_config(model_dir, config_kw))
    assert isinstance(engine.actor, dropin.RemotePPOActor) and engine.actor.engine is engine
    data = trajectories(41, groups=3, n=4, **data_kw)
    before = _requests(metrics)
    got = engine.compute_advantages(copy.deepcopy(data))
    added = _requests(metrics) - before
    want = stock.compute_advantages(copy.deepcopy(data))
    assert added == 2 and _requests(metrics) - before == 2
    compare(got, want)


def test_replicas_cross_areals_env_vars_parsing(monkeypatch, model_dir):
    """Replicas ``h1:p,h2:p`` travel space-separated: AReaL's own ``get_env_vars`` (areal/infra/utils/launcher.py,
    which both schedulers use on ``scheduling_spec.env_vars``) splits the ``k=v`` list on ',' and fails on the
    comma form; the space form parses, and a worker's client gets both replicas back."""
    from areal.infra.utils.launcher import get_env_vars

    replicas = "127.0.0.1:50051,127.0.0.1:50052"
    with pytest.raises(ValueError):
        get_env_vars(f"ADVANTAGE_SERVICE_TARGET={replicas}")
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", replicas)
    config = dropin.forward_service_env(_config(model_dir, {}))
    env = config.scheduling_spec[0].env_vars
    assert env["ADVANTAGE_SERVICE_TARGET"] == "127.0.0.1:50051 127.0.0.1:50052"
    parsed = get_env_vars(",".join(f"{k}={v}" for k, v in env.items()))
    assert parsed["ADVANTAGE_SERVICE_TARGET"] == "127.0.0.1:50051 127.0.0.1:50052"
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", parsed["ADVANTAGE_SERVICE_TARGET"])
    assert dropin._target_from_env() == ["127.0.0.1:50051", "127.0.0.1:50052"]
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", "127.0.0.1:50051")
    assert dropin._target_from_env() == "127.0.0.1:50051"
