"""Generate golden advantage vectors by running ROLL's own agentic advantage step (alibaba/ROLL).

Pinned source: https://github.com/alibaba/ROLL at commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a (the commit
``advantage_client.references`` names for ``roll``), as tests/golden_roll/generate.py (the RLVR cases), whose
machinery this reuses. A maintenance tool: the tests read only its output, ``tests/golden_roll/roll_agentic_cases.json``.

Refresh command (from the repository root)::

    rm -rf /tmp/roll-src && mkdir -p /tmp/roll-src && git --git-dir=/work/.mirror/alibaba+ROLL/repo archive 8eb27cc2dc34c4d1310b169d9b86d339004d811a roll | tar -x -C /tmp/roll-src && .venv/bin/python tests/golden_roll/generate_agentic.py --roll-src /tmp/roll-src && .venv/bin/python tests/golden_roll/generate_agentic.py --roll-src /tmp/roll-src --check-dropin

The blob ids of AGENTIC_BLOBS are checked against the pinned commit (``--no-verify`` skips that). Needs the whole
``roll/`` package of the commit and the venv's torch, tensordict, ray, codetiming, datasets, transformers. Output is
deterministic (seeded NumPy inputs, CPU torch, one thread).

ROLL code that is run: ``roll.pipeline.agentic.agentic_pipeline`` is imported from ``--roll-src`` after the stubs of
:data:`STUBS` (generate.py's DROPIN_STUBS plus ``imageio``, the dataset manager and the rollout scheduler: modules
needing packages the venv lacks, placeholders that raise when called). Every case runs, on ROLL's real ``DataProto``,
the functions that module imported, in the order ``AgenticPipeline.run`` calls them: ``compute_discounted_returns``
(step rewards of step_reinforce / gigpo, ``step_reward_gamma``), ``get_agentic_response_level_mask``,
``compute_response_level_rewards`` (``agentic_reward_norm`` with ROLL's real ``RewardNormalizationConfig``; gigpo's
``build_state_group``), ``compute_token_reward`` (with a fixed or an adaptive ``kl_controller``, the adaptive one
moved by one update first) and ``agentic_compute_advantage`` (``roll/pipeline/agentic/utils.py``), called with
exactly the keywords the pipeline passes (no ``response_mask``).

Inputs are agentic-shaped: [B, S] rows of a left prompt and a multi-turn response (``response_mask`` 1 on the
assistant's turns, 0 on the environment's observation tokens between them, sometimes on the last response token),
``scores`` [B, S] (summed by ROLL for reinforce / grpo / gae / agentic_reinforce), non-tensor ``traj_group_id``,
``traj_id``, ``step``, ``step_scores``, ``episode_scores``, ``state_hash`` and ``tag``, rows in a shuffled order;
step_reinforce and gigpo cases have one row per step of multi-step trajectories.

Each case records ROLL's ``response_level_rewards`` (what compute_response_level_rewards left), ``token_level_rewards``
(what compute_token_reward left: agentic_compute_advantage's input), the masks, log-probs, values, the KL coefficient,
and ROLL's advantages and returns.

Drop-in check (``--check-dropin``): ``ast`` reads ``AgenticPipeline.run`` and takes its statement
``batch = compute_discounted_returns(...)`` and its statements from the ``cal_response_level_mask`` block through
the ``compute_advantage`` block (get_agentic_response_level_mask, compute_response_level_rewards,
compute_token_reward, agentic_compute_advantage, their Timer blocks and metrics lines), compiled under the file's
name as the body of a function whose globals are the pipeline module's namespace (``agentic_compute_advantage`` is
looked up where ``install()`` rebinds it; every global it loads is the module's and no placeholder, or a builtin).
They run with ``self`` an ``AgenticPipeline`` made without ``__init__`` holding ``pipeline_config`` and ``kl_ctrl``,
a no-op tracer and a metrics dict, on each case's batch rebuilt from its seed. ROLL's own run must equal the goldens;
then, against an in-process server counting the estimator runs, ``advantage_client.roll.install()`` runs and each
case must give one request, ROLL's batch keys, float32 advantages and advantages / returns equal to the goldens; then
with the server's results x1.0001 every case must fail. The outcome goes into ``source.dropin_check`` (as
generate.py's: ``cases_sha256``, ``passed``, ``requests``, ``fail_at_x1.0001``, the statements' lines,
``call_keywords``, ``globals``, stubs, command).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import dis
import functools
import importlib
import json
import os
import sys
import tempfile
import types
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate as rlvr  # noqa: E402  (the RLVR generator: blob checks, stubs, tolerance, dump)

ROLL_COMMIT = rlvr.ROLL_COMMIT
PIPELINE_PATH = "roll/pipeline/agentic/agentic_pipeline.py"
PIPELINE_MODULE = "roll.pipeline.agentic.agentic_pipeline"
#: git blob ids at ROLL_COMMIT of the files whose code runs (git rev-parse <commit>:<path>)
AGENTIC_BLOBS = {**rlvr.BLOBS,
                 "roll/pipeline/agentic/utils.py": "5d195851c0babd0f9502f7668a67849f1b4da162",
                 PIPELINE_PATH: "e4652a7c47153a444a84ab952d581304b2008380",
                 "roll/pipeline/agentic/agentic_config.py": "e792226cf45bcc307c44050eaa8aec45ba5337f2",
                 "roll/distributed/scheduler/protocol.py": "a3cd487e228431c320fa7ea2907826ee605016e1",
                 "roll/distributed/scheduler/remote_protocol.py": "22439c8c35977ba1c6cbe8efbeec1ebde7c307b7"}
STUBS = {**rlvr.DROPIN_STUBS,
         "roll.utils.telemetry": (("get_tracer", "inject_trace_context", "attach_trace_context"),
                                  "needs opentelemetry"),
         "imageio": ((), "third-party, not installed; roll/pipeline/agentic/utils.py imports it at module level and "
                         "uses it only to dump rollout GIFs"),
         "roll.datasets.global_dataset": (("GlobalDatasetManager",), "a Ray actor of the dataset manager"),
         "roll.distributed.scheduler.rollout_scheduler": (("RolloutScheduler",), "needs gem and Ray env managers")}
OUT = HERE / "roll_agentic_cases.json"
ESTIMATORS = ("reinforce", "grpo", "gae", "step_reinforce", "gigpo", "agentic_reinforce")
PERTURBATION = rlvr.DROPIN_PERTURBATION
COMMAND = ("rm -rf /tmp/roll-src && mkdir -p /tmp/roll-src && git --git-dir=/work/.mirror/alibaba+ROLL/repo archive "
           f"{ROLL_COMMIT} roll | tar -x -C /tmp/roll-src && .venv/bin/python tests/golden_roll/generate_agentic.py "
           "--roll-src /tmp/roll-src --check-dropin")


def spec(name, est, G, n, S, P, *, dtype="float32", mask="turns", gamma=1.0, lambd=0.95, grouping="traj_group_id",
         mean="group", std="group", reward_clip=None, advantage_clip=None, whiten_adv=False, whiten_rew=False,
         kl=None, kl_ctrl="fixed", coef=0.1, step_gamma=0.95, ep_w=1.0, step_w=1.0, scale=1.0):
    return dict(name=name, est=est, G=G, n=n, S=S, P=P, dtype=dtype, mask=mask, gamma=gamma, lambd=lambd,
                grouping=grouping, mean=mean, std=std, reward_clip=reward_clip, advantage_clip=advantage_clip,
                whiten_adv=whiten_adv, whiten_rew=whiten_rew, kl=kl, kl_ctrl=kl_ctrl, coef=coef,
                step_gamma=step_gamma, ep_w=ep_w, step_w=step_w, scale=scale)


def cases():
    c = []
    for est in ESTIMATORS:
        c.append(spec(f"{est}_defaults", est, 3, 4, 40, 6))
        c.append(spec(f"{est}_float64_masked_end", est, 3, 3, 44, 5, dtype="float64", mask="masked_end",
                      gamma=0.97))
    c += [
        # agentic_reinforce: its options (gamma per turn, whitening, clip, KL on the tokens, normalisations)
        spec("agentic_reinforce_gamma_whiten_clip", "agentic_reinforce", 3, 4, 48, 5, gamma=0.8, whiten_adv=True,
             advantage_clip=1.0),
        spec("agentic_reinforce_kl_k1_whiten_rewards", "agentic_reinforce", 2, 4, 40, 5, kl="kl", coef=0.3,
             whiten_rew=True, gamma=0.9),
        spec("agentic_reinforce_kl_adaptive_k3_f64", "agentic_reinforce", 2, 4, 40, 5, kl="k3", kl_ctrl="adaptive",
             coef=0.2, dtype="float64", gamma=0.95),
        spec("agentic_reinforce_batch_norm_reward_clip", "agentic_reinforce", 3, 3, 36, 4, grouping="batch",
             mean="batch", std="batch", reward_clip=0.7, scale=2.0),
        spec("agentic_reinforce_tag_mean_only_abs", "agentic_reinforce", 3, 4, 36, 4, grouping="tag", std=None,
             kl="abs", coef=0.1),
        spec("agentic_reinforce_one_turn", "agentic_reinforce", 2, 4, 30, 4, mask="one_turn", gamma=0.5),
        spec("agentic_reinforce_single_valid_token", "agentic_reinforce", 2, 2, 24, 4, mask="single",
             whiten_adv=True, whiten_rew=True),
        spec("agentic_reinforce_adv_clip_zero", "agentic_reinforce", 2, 2, 24, 4, advantage_clip=0.0),
        # the others on the agentic batch
        spec("reinforce_kl_mse_whiten", "reinforce", 3, 4, 40, 5, kl="mse", coef=0.2, whiten_adv=True, gamma=0.9),
        spec("grpo_batch_norm_clip", "grpo", 3, 4, 40, 5, grouping="batch", mean="batch", std="batch",
             reward_clip=1.0, advantage_clip=1.5),
        spec("gae_gamma_lambda_kl_whiten_rewards", "gae", 3, 3, 40, 5, gamma=0.9, lambd=0.8, kl="kl", coef=0.1,
             whiten_rew=True, whiten_adv=True),
        spec("step_reinforce_gamma_kl_k3", "step_reinforce", 3, 3, 36, 5, step_gamma=0.8, gamma=0.9, kl="k3",
             coef=0.3, grouping="traj_group_id", std=None),
        spec("step_reinforce_whiten_clip_f64", "step_reinforce", 2, 4, 36, 5, dtype="float64", whiten_adv=True,
             advantage_clip=1.2, mask="masked_end"),
        spec("gigpo_weights_gamma", "gigpo", 3, 3, 36, 5, ep_w=0.7, step_w=0.4, step_gamma=0.9, gamma=1.0),
        spec("gigpo_kl_adaptive_abs_whiten", "gigpo", 2, 4, 36, 5, kl="abs", kl_ctrl="adaptive", coef=0.2,
             whiten_adv=True, std=None),
    ]
    return c


def build(rng, c, torch, DataProto):
    """Agentic-shaped batch of case ``c`` (module docstring), in a real DataProto, and its raw arrays."""
    dt = getattr(torch, c["dtype"])
    G, n, S, P = c["G"], c["n"], c["S"], c["P"]
    stepwise = c["est"] in ("step_reinforce", "gigpo")
    traj_group, traj, step = [], [], []
    for g in range(G):
        for k in range(n):
            steps = int(rng.integers(1, 4)) if stepwise else 1
            for s in range(steps):
                traj_group.append(f"group{g}")
                traj.append(f"traj{g}_{k}")
                step.append(s)
    B = len(traj)
    resp_len = S - P
    prompt = rng.integers(2, P + 1, B)
    attention = np.zeros((B, S), np.int64)
    resp_mask = np.zeros((B, S), np.int64)
    for i in range(B):
        turns = 1 if c["mask"] == "one_turn" else int(rng.integers(1, 5))
        pos = prompt[i]
        for t in range(turns):
            a = int(rng.integers(1, max(2, resp_len // (2 * turns))))
            if pos + a > S:
                break
            resp_mask[i, pos:pos + a] = 1
            pos += a
            if t < turns - 1:  # the environment's observation tokens
                pos += int(rng.integers(1, max(2, resp_len // (3 * turns))))
                if pos >= S - 1:
                    break
        end = min(pos, S)
        attention[i, :end] = 1
        if c["mask"] == "masked_end" and i % 2 == 0 and resp_mask[i].sum() > 1:
            resp_mask[i, end - 1] = 0 if resp_mask[i, end - 1] else resp_mask[i, end - 1]
    if c["mask"] == "single":
        resp_mask[:] = 0
        last = int(np.flatnonzero(attention[B - 1]).max())
        resp_mask[B - 1, last] = 1
    position_ids = np.clip(np.cumsum(attention, -1) - 1, 0, None)
    scores = np.zeros((B, S))
    for i in range(B):  # the score on the last attended token, a bonus on a mid-response token of some rows
        last = int(np.flatnonzero(attention[i]).max())
        scores[i, last] = round(float(rng.standard_normal() * c["scale"]), 3)
        if i % 3 == 0:
            scores[i, prompt[i]] = round(float(rng.standard_normal() * 0.5), 3)
    first = [i for i in range(B) if traj_group[i] == "group0"]   # a tied group (ROLL's 0 there)
    scores[first] = 0.0
    for i in first:
        scores[i, int(np.flatnonzero(attention[i]).max())] = 1.0
    step_scores = np.round(rng.standard_normal(B), 3)
    episode = {t: round(float(rng.standard_normal()), 3) for t in sorted(set(traj))}
    episode_scores = np.array([episode[t] for t in traj])
    state_hash = np.array([f"s{int(rng.integers(0, 3))}" for _ in range(B)], dtype=object)
    tag = np.array(["envA" if g.endswith(("0", "2")) else "envB" for g in traj_group], dtype=object)
    logp = -rng.random((B, S - 1)) * 3.0
    refp = logp + rng.standard_normal((B, S - 1)) * 0.3
    values = rng.standard_normal((B, S - 1))
    perm = rng.permutation(B)
    tensors = {
        "attention_mask": torch.from_numpy(attention), "position_ids": torch.from_numpy(position_ids),
        "response_mask": torch.from_numpy(resp_mask), "responses": torch.zeros(B, resp_len, dtype=torch.int64),
        "scores": torch.tensor(scores, dtype=dt), "old_log_probs": torch.tensor(logp, dtype=dt),
        "ref_log_probs": torch.tensor(refp, dtype=dt), "values": torch.tensor(values, dtype=dt),
    }
    non_tensors = {"traj_group_id": np.array(traj_group, dtype=object), "traj_id": np.array(traj, dtype=object),
                   "step": np.array(step, dtype=object), "step_scores": step_scores.astype(object),
                   "episode_scores": episode_scores.astype(object), "state_hash": state_hash, "tag": tag}
    p = torch.from_numpy(perm)
    data = DataProto.from_dict({k: v[p] for k, v in tensors.items()},
                               non_tensors={k: v[perm] for k, v in non_tensors.items()})
    raw = dict(logp=logp[perm], refp=refp[perm], values=values[perm], scores=scores[perm], B=B)
    return data, raw


def pipeline_config(c, RewardNormalizationConfig):
    return types.SimpleNamespace(
        adv_estimator=c["est"], gamma=c["gamma"], lambd=c["lambd"], advantage_clip=c["advantage_clip"],
        whiten_advantages=c["whiten_adv"], whiten_rewards=c["whiten_rew"], reward_clip=c["reward_clip"],
        reward_normalization=RewardNormalizationConfig(grouping=c["grouping"], norm_mean_type=c["mean"],
                                                       norm_std_type=c["std"]),
        episode_reward_weight=c["ep_w"], step_reward_weight=c["step_w"], step_reward_gamma=c["step_gamma"],
        kl_penalty=c["kl"] or "kl", add_token_level_kl=c["kl"] is not None, max_len_mask=False,
        is_pure_opd=False, use_opd=False, enable_old_logprobs_recompute=False)


def kl_controller(K, c):
    if c["kl_ctrl"] == "adaptive":  # a previous step moved it
        ctrl = K.get_kl_controller(init_kl_coef=c["coef"], target_kl=0.05, kl_horizon=100)
        ctrl.update(current=0.5, n_steps=7)
        return ctrl
    return K.get_kl_controller(init_kl_coef=c["coef"])


def seed(c):
    return zlib.crc32(c["name"].replace(c["est"], "EST", 1).encode())


def load(src: Path):
    """ROLL's agentic pipeline module imported from ``src`` after STUBS. Returns (module, ROLL modules run)."""
    os.environ.setdefault("ROLL_LOG_DIR", tempfile.mkdtemp(prefix="roll-logs-"))
    for name, (attrs, _why) in STUBS.items():
        m = types.ModuleType(name)
        for a in attrs:
            setattr(m, a, type(a, (), {"__module__": name}) if a == "BasePipeline" else rlvr._Stub(f"{name}.{a}"))
        m.__roll_dropin_stub__ = True
        sys.modules[name] = m
    sys.path.insert(0, str(src))
    mod = importlib.import_module(PIPELINE_MODULE)
    real = []
    for name, m in sorted(sys.modules.items()):
        if name.split(".")[0] != "roll" or getattr(m, "__roll_dropin_stub__", False):
            continue
        f = Path(getattr(m, "__file__", "") or "").resolve()
        assert f.is_relative_to(src), f"{name} was imported from {f}, not from {src}"
        real.append(name)
    return mod, real


def run_case(mod, K, torch, DataProto, c):
    rng = np.random.default_rng(seed(c))
    data, raw = build(rng, c, torch, DataProto)
    cfg = pipeline_config(c, sys.modules["roll.pipeline.agentic.agentic_config"].RewardNormalizationConfig)
    kl_ctrl = kl_controller(K, c)
    beta = float(kl_ctrl.value)
    data = mod.compute_discounted_returns(data, cfg.adv_estimator, cfg.step_reward_gamma)
    data, _ = mod.get_agentic_response_level_mask(data, cfg)
    data, _ = mod.compute_response_level_rewards(batch=data, pipeline_config=cfg)
    rlr = data.batch["response_level_rewards"].clone()
    data, _ = mod.compute_token_reward(data, cfg, kl_ctrl)
    tlr = data.batch["token_level_rewards"].clone()
    data = mod.agentic_compute_advantage(data=data, gamma=cfg.gamma, lambd=cfg.lambd, adv_estimator=cfg.adv_estimator,
                                         advantage_clip=cfg.advantage_clip, whiten_advantages=cfg.whiten_advantages,
                                         whiten_rewards=cfg.whiten_rewards, pipeline_config=cfg)
    tl = rlvr.tolist
    out = {
        "name": c["name"], "roll_estimator": c["est"], "dtype": c["dtype"],
        "roll_config": {k: c[k] for k in ("gamma", "lambd", "reward_clip", "advantage_clip")} | {
            "whiten_advantages": c["whiten_adv"], "whiten_rewards": c["whiten_rew"],
            "reward_normalization": {"grouping": c["grouping"], "norm_mean_type": c["mean"], "norm_std_type": c["std"]},
            "step_reward_gamma": c["step_gamma"], "episode_reward_weight": c["ep_w"], "step_reward_weight": c["step_w"],
            "add_token_level_kl": c["kl"] is not None, "kl_penalty": c["kl"] or "kl", "kl_ctrl": c["kl_ctrl"],
            "kl_coef": beta},
        "response_level_rewards_dtype": str(rlr.dtype).replace("torch.", ""),
        "response_level_rewards": tl(rlr),
        "response_mask": tl(data.batch["response_mask"][:, 1:]),
        "attention_mask": tl(data.batch["attention_mask"][:, 1:]),
        "old_log_probs": raw["logp"].tolist(), "ref_log_probs": raw["refp"].tolist(),
        "token_level_rewards": tl(tlr),
        "expected_advantages": tl(data.batch["advantages"]),
        "expected_returns": tl(data.batch["returns"]),
    }
    if c["est"] == "gae":
        out["values"] = raw["values"].tolist()
    for key in ("expected_advantages", "expected_returns"):
        assert np.isfinite(np.asarray(out[key])).all(), (c["name"], key)
    return out


# --------------------------------------------------------------------------
# --check-dropin: advantage_client.roll inside ROLL's own AgenticPipeline.run
# --------------------------------------------------------------------------

def _with_span(stmt) -> str:
    return ast.unparse(stmt.items[-1].context_expr) if isinstance(stmt, ast.With) else ""


def extract_advantage_step(path: Path, module):
    """``AgenticPipeline.run``'s ``batch = compute_discounted_returns(...)`` and its statements from the
    ``cal_response_level_mask`` block through the line after the ``compute_advantage`` block, compiled as the body
    of ``agentic_advantage_step(self, batch, metrics, tracer)`` (returning ``batch``) with ``module``'s namespace as
    globals. Returns (function, info)."""
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AgenticPipeline")
    run = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert [ast.unparse(d) for d in run.decorator_list] == ["torch.no_grad()"], "run()'s decorators changed"
    disc = [s for s in ast.walk(run) if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
            and isinstance(s.value.func, ast.Name) and s.value.func.id == "compute_discounted_returns"]
    assert len(disc) == 1, f"{len(disc)} compute_discounted_returns statements in AgenticPipeline.run"
    found = []
    for node in ast.walk(run):
        stmts = getattr(node, "body", None)
        if isinstance(stmts, list):
            found += [(stmts, i) for i, s in enumerate(stmts) if "cal_response_level_mask" in _with_span(s)]
    assert len(found) == 1, f"{len(found)} cal_response_level_mask blocks in AgenticPipeline.run"
    stmts, i = found[0]
    j = next(k for k in range(i, len(stmts)) if _with_span(stmts[k]) == "tracer.start_as_current_span('compute_advantage')")
    chosen = stmts[i:j + 2]
    spans = [_with_span(s) for s in chosen if isinstance(s, ast.With)]
    assert spans == [f"tracer.start_as_current_span('{n}')" for n in
                     ("cal_response_level_mask", "cal_response_norm_rewards", "cal_token_reward",
                      "compute_advantage")], spans
    assert ast.unparse(chosen[-1]) == "metrics['time/step_adv'] = timer.last", ast.unparse(chosen[-1])
    calls = [n for n in ast.walk(run) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "agentic_compute_advantage"]
    assert len(calls) == 1, f"{len(calls)} agentic_compute_advantage calls in AgenticPipeline.run"
    call = calls[0]
    assert any(call is n for s in chosen for n in ast.walk(s))
    assert not call.args and all(k.arg for k in call.keywords), "ROLL's call passes positional or ** arguments"
    template = ast.parse("def agentic_advantage_step(self, batch, metrics, tracer):\n    return batch\n")
    fn_def = template.body[0]
    ret = fn_def.body[0]
    fn_def.body = [disc[0]] + list(chosen) + [ret]
    for node, line in ((fn_def, disc[0].lineno), (ret, chosen[-1].end_lineno)):
        for n in ast.walk(node) if node is ret else (node, *ast.walk(node.args)):
            n.lineno = n.end_lineno = line
    code = compile(template, str(path), "exec")
    fn_code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "agentic_advantage_step")
    fn = types.FunctionType(fn_code, module.__dict__, "agentic_advantage_step")

    def global_names(co):
        names = {ins.argval for ins in dis.get_instructions(co) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        for k in co.co_consts:
            if isinstance(k, types.CodeType):
                names |= global_names(k)
        return names
    names = sorted(global_names(fn_code))
    for name in names:
        if name in module.__dict__:
            obj = module.__dict__[name]
            assert not isinstance(obj, rlvr._Stub) and getattr(obj, "__module__", "") not in STUBS, \
                f"the statements use {name}, a stand-in"
        else:
            assert hasattr(builtins, name), f"the statements use {name}, which ROLL's module does not define"
    info = {"path": PIPELINE_PATH, "compute_discounted_returns_line": disc[0].lineno,
            "lines": [chosen[0].lineno, chosen[-1].end_lineno], "agentic_compute_advantage_call_line": call.lineno,
            "call_keywords": [k.arg for k in call.keywords], "globals": names}
    return fn, info


def check_dropin(src: Path, torch, path: Path, factor: float) -> int:
    root = HERE.parents[1]
    for sub in ("server", "client"):
        if str(root / sub) not in sys.path:
            sys.path.insert(0, str(root / sub))
    from advantage_server.estimators.registry import REGISTRY
    from advantage_server.server import create_server

    import advantage_client.roll as dropin

    doc = json.loads(path.read_text())
    cases_json = doc["cases"]
    specs = {c["name"]: c for c in cases()}
    assert [c["name"] for c in cases_json] == list(specs), f"{path} does not hold this generator's cases: refresh it"
    mod, real_modules = load(src)
    U = sys.modules["roll.pipeline.agentic.utils"]
    K = sys.modules["roll.utils.kl_controller"]
    RNC = sys.modules["roll.pipeline.agentic.agentic_config"].RewardNormalizationConfig
    DataProto = sys.modules["roll.distributed.scheduler.protocol"].DataProto
    assert mod.DataProto is DataProto and mod.agentic_compute_advantage is U.agentic_compute_advantage
    step, info = extract_advantage_step(src / PIPELINE_PATH, mod)

    estimators = sorted(set(dropin.AGENTIC_ESTIMATORS.values()))
    state = {"scale": 1.0, "requests": dict.fromkeys(estimators, 0)}

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(cfg, batch):
            state["requests"][name] += 1
            result = fn(cfg, batch)
            f = state["scale"]
            if f != 1.0:
                result = dataclasses.replace(result, advantages=result.advantages * f,
                                             returns=None if result.returns is None else result.returns * f)
            return result
        return wrapper

    def run_statements(c):
        self = mod.AgenticPipeline.__new__(mod.AgenticPipeline)  # __init__ builds Ray clusters: its two fields
        self.pipeline_config = pipeline_config(c, RNC)
        self.kl_ctrl = kl_controller(K, c)
        before = sum(state["requests"].values())
        batch, _ = build(np.random.default_rng(seed(c)), c, torch, DataProto)
        with torch.no_grad():  # run() is @torch.no_grad()
            out = step(self, batch, {}, rlvr._NoopTracer())
        adv, ret = out.batch["advantages"], out.batch["returns"]
        return (adv.double().numpy(), ret.double().numpy(), sorted(out.batch.keys()), str(adv.dtype),
                sum(state["requests"].values()) - before)

    roll_runs = {case["name"]: run_statements(specs[case["name"]]) for case in cases_json}
    assert sum(state["requests"].values()) == 0
    roll_vs_golden = [case["name"] for case in cases_json
                      if not all(rlvr._close(got, case[key])[0] for got, key in zip(
                          roll_runs[case["name"]][:2], ("expected_advantages", "expected_returns")))]

    originals = {name: REGISTRY[name] for name in estimators}
    for name, spec_ in originals.items():
        REGISTRY[name] = dataclasses.replace(spec_, fn=counted(name, spec_.fn))
    for var in ("ADVANTAGE_SERVICE_TLS_CA", "ADVANTAGE_SERVICE_TOKEN_FILE"):
        os.environ.pop(var, None)
    srv = create_server("127.0.0.1", 0, device="cpu").start()
    results, requests = {}, {}
    try:
        os.environ["ADVANTAGE_SERVICE_TARGET"] = srv.address
        assert dropin._client is None, "advantage_client.roll already made its client"
        dropin.install()  # the launcher's one line
        assert dropin.INSTALLED[PIPELINE_MODULE] is U.agentic_compute_advantage
        assert sys.modules[PIPELINE_MODULE] is mod and mod.agentic_compute_advantage is dropin.agentic_compute_advantage
        for scale in (1.0, factor):
            state["scale"] = scale
            before = dict(state["requests"])
            sink = results[scale] = []
            for case in cases_json:
                name = case["name"]
                failures, worst = [], {}
                try:
                    adv, ret, keys, dtype, req = run_statements(specs[name])
                except Exception as err:  # noqa: BLE001  (reported)
                    sink.append((name, [f"raised {err!r}"], worst, 0))
                    continue
                r_adv, r_ret, r_keys, r_dtype, _ = roll_runs[name]
                if req != 1:
                    failures.append(f"{req} requests, expected 1")
                if keys != r_keys:
                    failures.append(f"batch keys {keys}, ROLL's {r_keys}")
                if dtype != r_dtype:
                    failures.append(f"advantages {dtype}, ROLL's {r_dtype}")
                for label, got, want in (("advantages vs ROLL's run", adv, r_adv), ("returns vs ROLL's run", ret, r_ret),
                                         ("advantages", adv, case["expected_advantages"]),
                                         ("returns", ret, case["expected_returns"])):
                    ok, worst[label] = rlvr._close(got, want)
                    if not ok:
                        failures.append(f"{label} differ (worst |err|/tol {worst[label]:.3g})")
                sink.append((name, failures, worst, req))
            if scale == 1.0:
                requests = {k: v - before[k] for k, v in state["requests"].items()}
    finally:
        srv.stop(grace=1.0)
        REGISTRY.update(originals)
        mod.agentic_compute_advantage = U.agentic_compute_advantage

    n = len(cases_json)
    res, pert = results[1.0], results[factor]
    passed = [name for name, f, _, _ in res if not f]
    failed_perturbed = [name for name, f, _, _ in pert if f]
    print(f"drop-in check in ROLL's AgenticPipeline.run ({PIPELINE_PATH} line {info['compute_discounted_returns_line']}"
          f" and lines {info['lines'][0]}-{info['lines'][1]}), {n} cases of {path}")
    print(f"ROLL's own run of those statements matches the goldens on {n - len(roll_vs_golden)}/{n}"
          + (f"; not on {roll_vs_golden}" if roll_vs_golden else ""))
    for name, failures, worst, req in res:
        print(f"  {'ok  ' if not failures else 'FAIL'} {name}: requests {req}; worst |err|/tol: "
              + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
        for f in failures:
            print(f"       {f}")
    print(f"passed {len(passed)}/{n}; requests {requests}")
    print(f"with every estimator's results x{factor}: {len(failed_perturbed)}/{n} fail")
    for name, failures, worst, _ in pert:
        if not failures:
            print(f"  PASSES {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    ok = not roll_vs_golden and len(passed) == n
    if factor != PERTURBATION:
        print(f"(factor {factor} is not the recorded {PERTURBATION}: {path} left as it is)")
        return 0 if ok else 1
    worst_all = max((v for _, _, w, _ in res for k, v in w.items() if not k.endswith("ROLL's run")), default=0.0)
    doc["source"]["dropin_check"] = {
        "cases": n, "cases_sha256": rlvr.cases_sha256(cases_json),
        "roll_run_matches_goldens": n - len(roll_vs_golden),
        "passed": len(passed), "worst_err_over_tol": worst_all,
        "requests": {**requests, "total": sum(requests.values())},
        f"fail_at_x{PERTURBATION}": len(failed_perturbed),
        "pipeline": {**info, "blob": rlvr.git_blob_id(src / PIPELINE_PATH)},
        "roll_modules_run_from_source": real_modules,
        "stubs": {name: why for name, (_, why) in STUBS.items()},
        "command": COMMAND,
    }
    rlvr.dump(doc, path)
    print(f"wrote source.dropin_check into {path}")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roll-src", required=True, type=Path, help="ROLL source tree at commit " + ROLL_COMMIT)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check-dropin", action="store_true",
                    help="run advantage_client.roll inside ROLL's own AgenticPipeline.run code on every case of --out "
                         "and record the outcome in its source.dropin_check; computes no new cases")
    ap.add_argument("--dropin-perturbation", type=float, default=PERTURBATION)
    args = ap.parse_args(argv)
    if not args.no_verify:
        rlvr.verify_source(args.roll_src, AGENTIC_BLOBS)
    import torch
    torch.set_num_threads(1)
    src = args.roll_src.resolve()
    if args.check_dropin:
        return check_dropin(src, torch, args.out, args.dropin_perturbation)
    mod, _ = load(src)
    K = sys.modules["roll.utils.kl_controller"]
    DataProto = sys.modules["roll.distributed.scheduler.protocol"].DataProto
    out = [run_case(mod, K, torch, DataProto, c) for c in cases()]
    doc = {"source": {"repo": "https://github.com/alibaba/ROLL", "commit": ROLL_COMMIT,
                      "paths": sorted(AGENTIC_BLOBS), "blobs": {k: rlvr.git_blob_id(src / k) for k in AGENTIC_BLOBS},
                      "generator": "tests/golden_roll/generate_agentic.py",
                      "torch": torch.__version__, "numpy": np.__version__}, "cases": out}
    rlvr.dump(doc, args.out)
    print(f"wrote {len(out)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
