"""Generate golden advantage vectors by running ROLL's own RLVR code (alibaba/ROLL).

Pinned source: https://github.com/alibaba/ROLL at commit
8eb27cc2dc34c4d1310b169d9b86d339004d811a (the commit ``advantage_client.references`` names for ``roll``).

This script is a maintenance tool. The tests only read its output, ``tests/golden_roll/roll_cases.json``; they never
import this file and CI never runs it.

Refresh command (from the repository root)::

    rm -rf /tmp/roll-src && mkdir -p /tmp/roll-src && git --git-dir=/work/.mirror/alibaba+ROLL/repo archive 8eb27cc2dc34c4d1310b169d9b86d339004d811a roll | tar -x -C /tmp/roll-src && .venv/bin/python tests/golden_roll/generate.py --roll-src /tmp/roll-src

Without the local mirror, use a checkout instead (``git clone https://github.com/alibaba/ROLL /tmp/roll-src && git -C
/tmp/roll-src checkout 8eb27cc2dc34c4d1310b169d9b86d339004d811a``). The script checks the git blob ids of the two
files against the pinned commit and refuses other versions (``--no-verify`` skips that check). Needs torch, numpy and
tensordict (the service's venv has all three). Output is deterministic: seeded NumPy inputs, CPU torch, one thread.

ROLL code that is run (unmodified source text from --roll-src): ``roll/utils/functionals.py``'s
``get_sample_level_mask``, ``reward_postprocess``, ``compute_token_reward`` and ``compute_advantage``, in the order
``RLVRPipeline.run`` calls them for a domain (``roll/pipeline/rlvr/rlvr_pipeline.py``), with everything they call
(``reward_norm``, ``difficulty_mask``, ``expand_to_token_level``, ``compute_approx_kl``, ``masked_mean``,
``masked_whiten``, ``compute_reinforce_return``, ``compute_gae_advantage_return``), and ``roll/utils/kl_controller.py``'s
``FixedKLController`` / ``AdaptiveKLController`` (an adaptive one is first moved by one ``update`` so its value is not
its initial one).

Stand-ins (none computes anything numeric): ``roll.configs.base_config.PPOConfig``,
``roll.pipeline.rlvr.rlvr_config.RLVRConfig`` (type annotations only), ``roll.platforms.current_platform`` (unused by
these functions), ``roll.utils.logging.get_logger`` (the standard library's), a ``DataProto`` holding a real
``tensordict.TensorDict`` batch and a ``meta_info`` dict with ROLL's ``rename``, and the pipeline config as a
namespace with the fields these functions read.

Inputs are ROLL-shaped: a [B, S] sequence of a left prompt and a right-padded response (``attention_mask`` left
aligned, ``position_ids`` its cumulative count, ``response_mask`` 1 on the response, holes punched into it as ROLL's
train-infer filters do, sometimes on the last response token), ``old_log_probs`` / ``ref_log_probs`` / ``values`` of
[B, S - 1], ``response_level_rewards`` and ``scores`` [B], n samples per prompt back to back.

Drop-in check (``--check-dropin``)
----------------------------------

Proves ``advantage_client.roll`` inside ROLL's own ``RLVRPipeline.run`` code for every case already in ``--out``;
computes no new cases and writes only ``source.dropin_check`` (the cases are rewritten byte-identically). Same
command as above with ``--check-dropin`` added; it needs the whole ``roll/`` package of the commit (the command above
extracts it) and the venv's ray, codetiming, datasets and transformers besides torch and tensordict; ``server/`` and
``client/`` of this checkout are put first on sys.path. It checks the blob ids of DROPIN_BLOBS (the files whose code
runs on the checked path).

1. ROLL's ``roll.pipeline.rlvr.rlvr_pipeline`` is imported from ``--roll-src`` (everything under ``roll`` it imports
   comes from there, asserted) after DROPIN_STUBS are put in sys.modules: modules whose imports need packages the
   venv lacks (Ray worker clusters, schedulers, the router, model providers, ``BasePipeline``, telemetry,
   ``train_infer_corrections``, ``transfer_queue``), holding placeholders that raise when called.
2. ``ast`` reads ``RLVRPipeline.run`` from that file and takes its statements from ``batch.reorder(...)`` /
   ``batch.group_by("domain")`` through the per-domain loop (ROLL's ``get_sample_level_mask``,
   ``reward_postprocess``, ``compute_token_reward``, ``compute_advantage``) to ``DataProto.concat`` (checked
   against DROPIN_STATEMENTS; exactly one ``compute_advantage`` call, keyword arguments only, inside them). They are
   compiled under the file's name and line numbers as the body of a function whose globals are the pipeline
   module's own namespace, so ``compute_advantage`` is looked up where ``install()`` rebinds it; the global names
   they load must be the module's (none a placeholder) or builtins. They run under ``torch.no_grad()`` (run()'s
   decorator) with ``self`` an ``RLVRPipeline`` made without ``__init__`` (which builds Ray clusters) holding the
   three fields they read: ``pipeline_config`` (:func:`pipeline_config`), ``kl_ctrl`` (as :func:`run_case` makes
   it) and ``running`` (a ``RunningMoments`` per domain, as ``__init__``), a real ``MetricsManager`` and a no-op
   tracer for ROLL's OpenTelemetry one.
3. Each case's inputs are rebuilt from its seed (checked against the recorded ones) into ROLL's real ``DataProto``
   with ``prompt_id`` as ROLL's scheduler sets it, ``domain`` as a non-tensor field, rows shuffled, in two layouts:
   the case alone in one domain, and the case twice as two domains.
4. Without the drop-in: the statements' results must equal the goldens (``|got - want| <= 1e-5 |want| + 2e-6 max(1,
   max |want|)``, tests/test_roll_dropin.py's rule). Then ``$ADVANTAGE_SERVICE_TARGET`` points at an in-process
   server (``create_server("127.0.0.1", 0, device="cpu")``) whose registry entries grpo, reinforce_plus_plus and gae
   count their runs, ``advantage_client.roll.install()`` runs, and each case must give, with one request per
   domain, the same batch keys and advantages dtype as ROLL's run and advantages and returns equal to ROLL's run
   (and to the goldens, one domain). Then again with every estimator's results x1.0001 (``--dropin-perturbation F``
   tries another factor and writes nothing), counting the cases that fail.

The outcome goes into ``source.dropin_check``: ``cases``, ``cases_sha256`` (:func:`cases_sha256`; the CI test
requires it to match the cases), ``roll_run_matches_goldens``, per layout ``passed``, ``requests`` and
``fail_at_x1.0001``, the statements' lines, ``call_keywords`` (what ROLL's call site passes; the CI test calls the
drop-in with exactly these) and global names, the ROLL modules run from source, the placeholders and why, and the
command. Regenerating the cases drops it: run the check again afterwards. Exit status 1 when a case fails the
unperturbed run.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import dis
import hashlib
import importlib
import json
import logging
import os
import sys
import tempfile
import types
import zlib
from pathlib import Path

import numpy as np

ROLL_COMMIT = "8eb27cc2dc34c4d1310b169d9b86d339004d811a"
#: git blob ids of the files at ROLL_COMMIT (git rev-parse <commit>:<path>)
BLOBS = {"roll/utils/functionals.py": "24ea0e655fae289a6c6d0a772b8a6ee239e0b18d",
         "roll/utils/kl_controller.py": "85cd5139502daa13f7e08bb972de60430432cc5a"}
OUT = Path(__file__).resolve().parent / "roll_cases.json"


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def verify_source(src: Path, blobs=None) -> None:
    for rel, want in (blobs or BLOBS).items():
        got = git_blob_id(src / rel)
        if want is not None and got != want:
            sys.exit(f"{rel}: blob {got} is not the pinned {want} (ROLL {ROLL_COMMIT}); use --no-verify to override")


def load_roll(src: Path):
    """ROLL's ``roll.utils.functionals`` and ``roll.utils.kl_controller`` from ``src``, with the stand-ins above."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    module("roll", __path__=[])
    module("roll.configs", __path__=[])
    module("roll.configs.base_config", PPOConfig=object)
    module("roll.pipeline", __path__=[])
    module("roll.pipeline.rlvr", __path__=[])
    module("roll.pipeline.rlvr.rlvr_config", RLVRConfig=object)
    module("roll.platforms", current_platform=None)
    module("roll.utils", __path__=[])
    module("roll.utils.logging", get_logger=lambda *a, **k: logging.getLogger("roll"))
    out = []
    for name, rel in (("roll.utils.kl_controller", "roll/utils/kl_controller.py"),
                      ("roll.utils.functionals", "roll/utils/functionals.py")):
        m = module(name)
        m.__file__ = str(src / rel)
        exec(compile((src / rel).read_text(), str(src / rel), "exec"), m.__dict__)
        out.append(m)
    return out[1], out[0]


class DataProto:
    """Stand-in for ROLL's DataProto: a TensorDict batch, a meta_info dict, and ``rename`` (no numbers)."""

    def __init__(self, batch, meta_info=None):
        self.batch, self.meta_info = batch, dict(meta_info or {})

    def rename(self, old_keys, new_keys):
        self.batch.rename_key_(old_keys, new_keys)
        return self


def spec(name, est, B, n, S, P, *, dtype="float32", mask="plain", gamma=1.0, lambd=0.95, mean=None, std=None,
         reward_clip=None, advantage_clip=None, whiten_adv=False, whiten_rew=False, kl=None, kl_ctrl="fixed",
         coef=0.1, sample_masks=(), scale=1.0):
    return dict(name=name, est=est, B=B, n=n, S=S, P=P, dtype=dtype, mask=mask, gamma=gamma, lambd=lambd, mean=mean,
                std=std, reward_clip=reward_clip, advantage_clip=advantage_clip, whiten_adv=whiten_adv,
                whiten_rew=whiten_rew, kl=kl, kl_ctrl=kl_ctrl, coef=coef, sample_masks=tuple(sample_masks),
                scale=scale)


def cases():
    c = []
    for est in ("grpo", "reinforce", "step_reinforce", "gae"):
        c.append(spec(f"{est}_defaults", est, 8, 4, 24, 6))
        c.append(spec(f"{est}_float64_holes", est, 8, 4, 28, 5, dtype="float64", mask="holes", gamma=0.97))
    # grpo: its options
    c += [
        spec("grpo_kl_fixed_k1", "grpo", 8, 4, 20, 5, kl="kl", coef=0.2, mask="holes"),
        spec("grpo_kl_adaptive_abs", "grpo", 8, 4, 20, 5, kl="abs", kl_ctrl="adaptive", coef=0.3),
        spec("grpo_kl_mse_float64", "grpo", 6, 3, 18, 4, kl="mse", dtype="float64", coef=0.5),
        spec("grpo_kl_k3", "grpo", 8, 2, 22, 6, kl="k3", coef=0.4, mask="masked_end"),
        spec("grpo_reward_clip", "grpo", 8, 4, 16, 4, reward_clip=0.8, kl="kl", coef=2.0),
        spec("grpo_advantage_clip_whiten", "grpo", 8, 4, 16, 4, advantage_clip=1.2, whiten_adv=True),
        spec("grpo_whiten_rewards", "grpo", 8, 4, 20, 4, whiten_rew=True, gamma=0.9, mask="holes"),
        spec("grpo_gamma_half_masked_end", "grpo", 6, 3, 18, 5, gamma=0.5, mask="masked_end"),
        spec("grpo_group_of_eight_float64", "grpo", 16, 8, 30, 7, dtype="float64", whiten_adv=True,
             advantage_clip=2.0, reward_clip=1.5),
        spec("grpo_sample_masks", "grpo", 12, 4, 24, 5, sample_masks=("max_len", "difficulty")),
        spec("grpo_single_valid_token", "grpo", 4, 2, 12, 4, mask="single", whiten_adv=True, whiten_rew=True),
        spec("grpo_adv_clip_zero", "grpo", 4, 2, 12, 3, advantage_clip=0.0),
        spec("grpo_reward_clip_zero_is_off", "grpo", 4, 2, 12, 3, reward_clip=0.0, scale=30.0),
    ]
    # reinforce / step_reinforce: the normalisation types
    c += [
        spec("reinforce_batch_batch", "reinforce", 8, 4, 20, 5, mean="batch", std="batch"),
        spec("reinforce_group_mean_only", "reinforce", 8, 4, 20, 5, mean="group"),
        spec("reinforce_group_mean_batch_std_f64", "reinforce", 8, 2, 20, 5, mean="group", std="batch",
             dtype="float64"),
        spec("reinforce_batch_std_only", "reinforce", 6, 3, 16, 4, std="batch", scale=3.0),
        spec("reinforce_batch_mean_only_kl", "reinforce", 6, 3, 16, 4, mean="batch", kl="kl", coef=0.05,
             kl_ctrl="adaptive"),
        spec("reinforce_group_group_whiten_clip", "reinforce", 8, 4, 20, 5, mean="group", std="group",
             whiten_adv=True, advantage_clip=1.0, reward_clip=1.0, gamma=0.95, mask="holes"),
        spec("step_reinforce_kl_k3_whiten_rew", "step_reinforce", 8, 4, 20, 5, kl="k3", coef=0.3, whiten_rew=True,
             mask="masked_end"),
        spec("reinforce_error_len_sample_mask", "reinforce", 8, 4, 20, 5, sample_masks=("error_len",), kl="mse",
             coef=0.2, mean="batch", std="batch"),
    ]
    # gae: lambda, gamma, whitening, KL, normalisation
    c += [
        spec("gae_gamma_lambda", "gae", 8, 4, 22, 5, gamma=0.9, lambd=0.8),
        spec("gae_whiten_clip", "gae", 8, 4, 22, 5, whiten_adv=True, advantage_clip=1.5, mask="holes"),
        spec("gae_kl_adaptive_k1_f64", "gae", 6, 3, 20, 4, kl="kl", kl_ctrl="adaptive", coef=0.2, dtype="float64",
             lambd=1.0),
        spec("gae_batch_norm_reward_clip", "gae", 8, 4, 18, 4, mean="batch", std="batch", reward_clip=1.0),
        spec("gae_group_norm_whiten_rewards", "gae", 8, 4, 18, 4, mean="group", std="group", whiten_rew=True,
             gamma=0.99, lambd=0.9, mask="masked_end"),
        spec("gae_sample_masks_abs", "gae", 12, 4, 24, 6, sample_masks=("max_len", "difficulty", "error_len"),
             kl="abs", coef=0.1, whiten_adv=True),
    ]
    return c


def build(rng, c, torch, TensorDict):
    """ROLL-shaped batch for case ``c`` (module docstring)."""
    dt = getattr(torch, c["dtype"])
    B, S, P = c["B"], c["S"], c["P"]
    resp_len = S - P
    prompt = rng.integers(2, P + 1, B)                     # prompt tokens per row (left-aligned after ROLL's shift)
    response = rng.integers(1, resp_len + 1, B)            # response tokens per row
    response[rng.integers(0, B)] = resp_len                # one row at the maximum length (max_len_mask)
    attention = np.zeros((B, S), np.int64)
    resp_mask = np.zeros((B, S), np.int64)
    for i in range(B):
        attention[i, :prompt[i] + response[i]] = 1
        resp_mask[i, prompt[i]:prompt[i] + response[i]] = 1
        if c["mask"] in ("holes", "masked_end") and response[i] > 2:
            if c["mask"] == "holes":
                k = rng.integers(1, max(2, response[i] // 3))
                start = prompt[i] + rng.integers(0, response[i] - k)
                resp_mask[i, start:start + k] = 0
            elif i % 2 == 0:
                resp_mask[i, prompt[i] + response[i] - 1] = 0   # the last response token masked
    if c["mask"] == "single":
        resp_mask[:] = 0
        resp_mask[B - 1, prompt[B - 1] + response[B - 1] - 1] = 1   # the last token of a row outside the tied group
    position_ids = np.clip(np.cumsum(attention, -1) - 1, 0, None)
    rewards = (rng.standard_normal(B) * c["scale"]).round(3)
    rewards[: c["n"]] = rewards[0]                        # a tied group (exact 0 in ROLL too: dyadic-free mean)
    scores = (rng.random(B) < 0.5).astype(np.float64)
    logp = -rng.random((B, S - 1)) * 3.0
    refp = logp + rng.standard_normal((B, S - 1)) * 0.3
    values = rng.standard_normal((B, S - 1))
    batch = TensorDict({
        "attention_mask": torch.from_numpy(attention), "position_ids": torch.from_numpy(position_ids),
        "response_mask": torch.from_numpy(resp_mask), "responses": torch.zeros(B, resp_len, dtype=torch.int64),
        "response_level_rewards": torch.tensor(rewards, dtype=dt), "scores": torch.tensor(scores, dtype=dt),
        "old_log_probs": torch.tensor(logp, dtype=dt), "ref_log_probs": torch.tensor(refp, dtype=dt),
        "values": torch.tensor(values, dtype=dt),
    }, batch_size=[B])
    return DataProto(batch), dict(rewards=rewards, logp=logp, refp=refp, values=values, scores=scores)


def pipeline_config(c):
    sm = c["sample_masks"]
    return types.SimpleNamespace(
        adv_estimator=c["est"], norm_mean_type=c["mean"], norm_std_type=c["std"],
        actor_infer=types.SimpleNamespace(generating_args=types.SimpleNamespace(num_return_sequences=c["n"])),
        reward_clip=c["reward_clip"], kl_penalty=c["kl"] or "kl", add_token_level_kl=c["kl"] is not None,
        max_len_mask="max_len" in sm, difficulty_mask="difficulty" in sm, difficulty_low_threshold=0.2,
        difficulty_high_threshold=0.8, error_max_len_clip="error_len" in sm, error_max_len_threshold=6,
        gamma=c["gamma"], lambd=c["lambd"], advantage_clip=c["advantage_clip"], whiten_advantages=c["whiten_adv"],
        whiten_rewards=c["whiten_rew"], is_pure_opd=False, use_opd=False)


def tolist(t):
    return t.detach().to("cpu").double().numpy().tolist()


def run_case(F, K, torch, TensorDict, idx, c):
    # seeded by the name with the estimator left out: reinforce_defaults and step_reinforce_defaults (and the other
    # per-estimator pairs) get the same inputs, so the cases show where ROLL's estimators agree
    rng = np.random.default_rng(zlib.crc32(c["name"].replace(c["est"], "EST", 1).encode()))
    data, raw = build(rng, c, torch, TensorDict)
    cfg = pipeline_config(c)
    if c["kl_ctrl"] == "adaptive":
        kl_ctrl = K.get_kl_controller(init_kl_coef=c["coef"], target_kl=0.05, kl_horizon=100)
        kl_ctrl.update(current=0.5, n_steps=7)            # a previous step moved it
    else:
        kl_ctrl = K.get_kl_controller(init_kl_coef=c["coef"])
    beta = float(kl_ctrl.value)
    data, _ = F.get_sample_level_mask(data, cfg)
    data, _ = F.reward_postprocess(data, cfg, {})
    data, _ = F.compute_token_reward(data, cfg, kl_ctrl)
    token_level_rewards = data.batch["token_level_rewards"].clone()
    final = data.batch["final_response_mask"].clone()
    data = F.compute_advantage(data=data, gamma=cfg.gamma, lambd=cfg.lambd, adv_estimator=cfg.adv_estimator,
                               advantage_clip=cfg.advantage_clip, whiten_advantages=cfg.whiten_advantages,
                               whiten_rewards=cfg.whiten_rewards, response_mask=final, pipeline_config=cfg)
    out = {
        "name": c["name"], "roll_estimator": c["est"], "dtype": c["dtype"], "n_samples": c["n"],
        "roll_config": {k: c[k] for k in ("gamma", "lambd", "reward_clip", "advantage_clip")} | {
            "norm_mean_type": c["mean"], "norm_std_type": c["std"], "whiten_advantages": c["whiten_adv"],
            "whiten_rewards": c["whiten_rew"], "add_token_level_kl": c["kl"] is not None, "kl_penalty": c["kl"] or "kl",
            "kl_ctrl": c["kl_ctrl"], "kl_coef": beta, "sample_masks": list(c["sample_masks"])},
        "response_level_rewards": raw["rewards"].tolist(),
        "final_response_mask": tolist(final),
        "attention_mask": tolist(data.batch["attention_mask"][:, 1:]),
        "old_log_probs": raw["logp"].tolist(), "ref_log_probs": raw["refp"].tolist(),
        "token_level_rewards": tolist(token_level_rewards),
        "expected_advantages": tolist(data.batch["advantages"]),
        "expected_returns": tolist(data.batch["returns"]),
    }
    if c["est"] == "gae":
        out["values"] = raw["values"].tolist()
    for key in ("expected_advantages", "expected_returns"):
        assert np.isfinite(np.asarray(out[key])).all(), (c["name"], key)
    return out


def dump(doc, path: Path) -> None:
    parts = ['{"source":' + json.dumps(doc["source"], allow_nan=False) + ',\n"cases":[\n']
    parts.append(",\n".join(json.dumps(c, separators=(",", ":"), allow_nan=False) for c in doc["cases"]))
    parts.append("\n]}\n")
    path.write_text("".join(parts))


# --------------------------------------------------------------------------
# --check-dropin: advantage_client.roll inside ROLL's own RLVRPipeline.run
# --------------------------------------------------------------------------

PIPELINE_PATH = "roll/pipeline/rlvr/rlvr_pipeline.py"
PIPELINE_MODULE = "roll.pipeline.rlvr.rlvr_pipeline"
#: the files whose code runs on the checked path, pinned (git rev-parse <commit>:<path>)
DROPIN_BLOBS = {**BLOBS,
                PIPELINE_PATH: "1f3dca2a5e65f83f24b764bd9a28e18adbb5cf70",
                "roll/distributed/scheduler/protocol.py": "a3cd487e228431c320fa7ea2907826ee605016e1",
                "roll/distributed/scheduler/remote_protocol.py": "22439c8c35977ba1c6cbe8efbeec1ebde7c307b7",
                "roll/utils/metrics/metrics_manager.py": "6b75661c220ab412b65595af53dc17230ece01d1"}
#: modules registered in sys.modules before ROLL's pipeline module is imported: module -> (the names the pipeline's
#: import chain takes from it, why it is not imported). Every name is a placeholder that raises when called (or an
#: empty class); the check asserts the statements it runs load none of them.
DROPIN_STUBS = {
    "transfer_queue": ((), "third-party, not installed; roll/distributed/scheduler/transfer_backend.py imports it at "
                           "module level on Python < 3.13 and uses it only for remote batches"),
    "roll.distributed.executor.cluster": (("Cluster",), "needs more_itertools and Ray worker clusters"),
    "roll.distributed.scheduler.generate_scheduler": (("DynamicSamplingScheduler",), "needs more_itertools"),
    "roll.distributed.scheduler.router": (("RouterManager",), "needs httpx"),
    "roll.models.model_providers": (("default_tokenizer_provider",), "needs peft"),
    "roll.pipeline.base_pipeline": (("BasePipeline",), "RLVRPipeline's base class (checkpoints, trackers); needs "
                                                       "more_itertools"),
    "roll.utils.train_infer_corrections": (("apply_train_infer_correction_to_batch",),
                                           "needs imageio (through roll.pipeline.agentic)"),
    "roll.utils.telemetry": (("get_tracer", "inject_trace_context"), "needs opentelemetry"),
}
#: the statements of RLVRPipeline.run that are run, as ast.unparse prints them (None: the domain loop, checked apart)
DROPIN_STATEMENTS = ("batch.reorder(indices=torch.argsort(batch.batch['prompt_id']))",
                     "batch_grouped: Dict[str, DataProto] = batch.group_by('domain')",
                     "batch_list = []",
                     None,
                     "batch = DataProto.concat(batch_list)")
#: the domain layouts checked: each case alone in one domain (compared with the goldens and ROLL's own run), and the
#: case twice, as two domains (compared with ROLL's own run: its KL controller moves between domains)
DROPIN_LAYOUTS = (("math",), ("math", "code"))
DROPIN_PERTURBATION = 1.0001
DROPIN_RTOL, DROPIN_ATOL = 1e-5, 2e-6   # tests/test_roll_dropin.py's rule
DROPIN_COMMAND = (
    "rm -rf /tmp/roll-src && mkdir -p /tmp/roll-src && git --git-dir=/work/.mirror/alibaba+ROLL/repo archive "
    f"{ROLL_COMMIT} roll | tar -x -C /tmp/roll-src && .venv/bin/python tests/golden_roll/generate.py "
    "--roll-src /tmp/roll-src --check-dropin"
)


def cases_sha256(cases) -> str:
    """Hash of the cases as the JSON holds them (tests/test_roll_dropin.py computes the same)."""
    text = json.dumps(cases, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


class _Stub:
    def __init__(self, qualname):
        self.qualname = qualname

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.qualname} is a stand-in of the drop-in check and was called")


def load_pipeline(src: Path):
    """ROLL's ``roll.pipeline.rlvr.rlvr_pipeline`` imported from ``src`` (with ``src`` first on sys.path), after
    DROPIN_STUBS are registered. Returns (the module, the names of the ROLL modules imported from ``src``)."""
    os.environ.setdefault("ROLL_LOG_DIR", tempfile.mkdtemp(prefix="roll-logs-"))  # ROLL's logger writes a file
    for name, (attrs, _why) in DROPIN_STUBS.items():
        m = types.ModuleType(name)
        for a in attrs:
            setattr(m, a, type(a, (), {"__module__": name}) if a == "BasePipeline" else _Stub(f"{name}.{a}"))
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


def extract_advantage_step(path: Path, module):
    """The statements of ``RLVRPipeline.run`` from the domain grouping through ``DataProto.concat`` (the loop that
    calls get_sample_level_mask, reward_postprocess, compute_token_reward and compute_advantage per domain), read
    from ROLL's file with ``ast`` and compiled, under that file's name and line numbers, as the body of
    ``rlvr_advantage_step(self, batch, metrics_mgr, tracer)`` (returning ``batch``) whose globals are ``module``'s
    own namespace: a name such as ``compute_advantage`` is looked up there at call time, as run() looks it up.
    Returns (function, info)."""
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RLVRPipeline")
    run = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert [ast.unparse(d) for d in run.decorator_list] == ["torch.no_grad()"], "run()'s decorators changed"
    found = []
    for node in ast.walk(run):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                found += [(stmts, i) for i, s in enumerate(stmts)
                          if isinstance(s, ast.For) and ast.unparse(s.target) == "(domain, domain_batch)"
                          and ast.unparse(s.iter) == "batch_grouped.items()"]
    assert len(found) == 1, f"{len(found)} domain loops in RLVRPipeline.run"
    stmts, i = found[0]
    chosen = stmts[i - 3:i + 2]
    got = [ast.unparse(s) for s in chosen]
    for g, w in zip(got, DROPIN_STATEMENTS):
        assert w is None or g == w, f"RLVRPipeline.run changed: {g!r}, expected {w!r}"
    calls = [n for n in ast.walk(run) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "compute_advantage"]
    assert len(calls) == 1, f"{len(calls)} compute_advantage calls in RLVRPipeline.run"
    call = calls[0]
    assert any(call is n for s in chosen for n in ast.walk(s)), "compute_advantage is called outside the domain loop"
    assert not call.args and all(k.arg for k in call.keywords), "ROLL's call passes positional or ** arguments"
    template = ast.parse("def rlvr_advantage_step(self, batch, metrics_mgr, tracer):\n    return batch\n")
    fn_def = template.body[0]
    ret = fn_def.body[0]
    fn_def.body = list(chosen) + [ret]
    for node, line in ((fn_def, chosen[0].lineno), (ret, chosen[-1].end_lineno)):
        for n in ast.walk(node) if node is ret else (node, *ast.walk(node.args)):
            n.lineno = n.end_lineno = line
    code = compile(template, str(path), "exec")
    fn_code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "rlvr_advantage_step")
    fn = types.FunctionType(fn_code, module.__dict__, "rlvr_advantage_step")

    def global_names(co):
        names = {ins.argval for ins in dis.get_instructions(co) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                names |= global_names(c)
        return names
    names = sorted(global_names(fn_code))
    for name in names:
        if name in module.__dict__:
            obj = module.__dict__[name]
            assert not isinstance(obj, _Stub) and not getattr(obj, "__module__", "") in DROPIN_STUBS, \
                f"the statements use {name}, a stand-in"
        else:
            assert hasattr(builtins, name), f"the statements use {name}, which ROLL's module does not define"
    info = {"path": PIPELINE_PATH, "lines": [chosen[0].lineno, chosen[-1].end_lineno],
            "compute_advantage_call_line": call.lineno, "call_keywords": [k.arg for k in call.keywords],
            "globals": names}
    return fn, info


class _NoopTracer:
    """Stand-in for ROLL's OpenTelemetry tracer (``get_tracer("driver")``): spans that record nothing."""

    def start_as_current_span(self, name):
        return contextlib.nullcontext()


def _close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return False, float("inf")
    tol = DROPIN_RTOL * np.abs(want) + DROPIN_ATOL * max(1.0, float(np.abs(want).max(initial=0.0)))
    err = np.abs(got - want)
    return bool((err <= tol).all()), float((err / tol).max(initial=0.0))


def _pipeline_inputs(torch, TensorDict, DataProto, c, case, domains):
    """The batch of case ``c`` as ROLL's pipeline holds it before the domain loop: the inputs generate.py made for
    the case (rebuilt from its seed and checked against the recorded ones), once per domain of ``domains``, in a
    real DataProto; ``prompt_id`` as ROLL's scheduler sets it (the prompt's index, repeated for its n samples),
    ``domain`` a non-tensor field, the rows in a seeded shuffled order (so ROLL's reorder and group_by do work);
    ``golden_row`` is added to put the results back in order (domain by domain, the case's rows)."""
    rng = np.random.default_rng(zlib.crc32(c["name"].replace(c["est"], "EST", 1).encode()))
    data, raw = build(rng, c, torch, TensorDict)
    for key, recorded in (("rewards", "response_level_rewards"), ("logp", "old_log_probs"),
                          ("refp", "ref_log_probs"), ("values", "values")):
        if recorded in case:
            assert raw[key].tolist() == case[recorded], f"{c['name']}: rebuilt {recorded} differ from the recorded"
    B, D = c["B"], len(domains)
    fields = {k: torch.cat([v] * D) for k, v in data.batch.items()}
    fields["prompt_id"] = torch.arange(B * D) // c["n"]
    fields["golden_row"] = torch.arange(B * D)
    perm = np.random.default_rng(zlib.crc32(c["name"].encode()) + D).permutation(B * D)
    return DataProto.from_dict({k: v[torch.from_numpy(perm)] for k, v in fields.items()},
                               non_tensors={"domain": list(np.repeat(np.array(domains, dtype=object), B)[perm])})


def _kl_ctrl(K, c):
    if c["kl_ctrl"] == "adaptive":  # as run_case: the pipeline's controller, moved by one previous step
        ctrl = K.get_kl_controller(init_kl_coef=c["coef"], target_kl=0.05, kl_horizon=100)
        ctrl.update(current=0.5, n_steps=7)
        return ctrl
    return K.get_kl_controller(init_kl_coef=c["coef"])


def check_dropin(src: Path, torch, TensorDict, path: Path, factor: float = DROPIN_PERTURBATION) -> int:
    """--check-dropin (module docstring). Returns the exit status: 0 when every case passes the unperturbed run."""
    import dataclasses
    import functools

    root = Path(__file__).resolve().parents[2]
    for sub in ("server", "client"):  # when the venv does not install them
        if str(root / sub) not in sys.path:
            sys.path.insert(0, str(root / sub))
    from advantage_server.estimators.registry import REGISTRY
    from advantage_server.server import create_server

    import advantage_client.roll as dropin

    doc = json.loads(path.read_text())
    cases_json = doc["cases"]
    specs = {c["name"]: c for c in cases()}
    assert [c["name"] for c in cases_json] == list(specs), f"{path} does not hold this generator's cases: refresh it"

    mod, real_modules = load_pipeline(src)
    F = sys.modules["roll.utils.functionals"]
    K = sys.modules["roll.utils.kl_controller"]
    DataProto = sys.modules["roll.distributed.scheduler.protocol"].DataProto
    assert mod.DataProto is DataProto and mod.compute_advantage is F.compute_advantage
    step, info = extract_advantage_step(src / PIPELINE_PATH, mod)
    metrics_mgr_cls, pipeline_cls = mod.MetricsManager, mod.RLVRPipeline

    estimators = sorted(set(dropin.ESTIMATORS.values()))
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

    def run_statements(c, case, domains):
        """ROLL's statements on the case's batch: (advantages, returns, batch keys, advantages dtype, requests)."""
        self = pipeline_cls.__new__(pipeline_cls)  # RLVRPipeline.__init__ builds Ray clusters: its three fields
        self.pipeline_config = pipeline_config(c)
        self.pipeline_config.save_logging_board_dir = None
        self.kl_ctrl = _kl_ctrl(K, c)
        assert float(self.kl_ctrl.value) == case["roll_config"]["kl_coef"]
        self.running = {d: F.RunningMoments() for d in domains}
        before = sum(state["requests"].values())
        batch = _pipeline_inputs(torch, TensorDict, DataProto, c, case, domains)
        with torch.no_grad():  # run() is @torch.no_grad()
            out = step(self, batch, metrics_mgr_cls(), _NoopTracer())
        order = torch.argsort(out.batch["golden_row"])
        adv, ret = out.batch["advantages"][order], out.batch["returns"][order]
        return (adv.double().numpy(), ret.double().numpy(), sorted(out.batch.keys()), str(adv.dtype),
                sum(state["requests"].values()) - before)

    # 1. ROLL as released: compute_advantage is roll.utils.functionals'
    roll_runs = {(layout, case["name"]): run_statements(specs[case["name"]], case, layout)
                 for layout in DROPIN_LAYOUTS for case in cases_json}
    assert sum(state["requests"].values()) == 0
    roll_vs_golden = [case["name"] for case in cases_json
                      if not all(_close(got, case[key])[0] for got, key in zip(
                          roll_runs[DROPIN_LAYOUTS[0], case["name"]][:2], ("expected_advantages", "expected_returns")))]

    # 2. installed: the launcher's one line, against an in-process server that counts its estimator runs
    originals = {name: REGISTRY[name] for name in estimators}
    for name, spec_ in originals.items():
        REGISTRY[name] = dataclasses.replace(spec_, fn=counted(name, spec_.fn))
    for var in ("ADVANTAGE_SERVICE_TLS_CA", "ADVANTAGE_SERVICE_TOKEN_FILE"):  # a plaintext loopback server
        os.environ.pop(var, None)
    srv = create_server("127.0.0.1", 0, device="cpu").start()
    results = {}  # (scale, layout) -> [(name, failures, worst, requests)]
    requests = {}
    try:
        os.environ["ADVANTAGE_SERVICE_TARGET"] = srv.address
        assert dropin._client is None, "advantage_client.roll already made its client"
        replaced = dropin.install()
        assert replaced is F.compute_advantage and sys.modules[PIPELINE_MODULE] is mod
        assert mod.compute_advantage is dropin.compute_advantage
        for scale in (1.0, factor):
            state["scale"] = scale
            for layout in DROPIN_LAYOUTS:
                before = dict(state["requests"])
                sink = results[scale, layout] = []
                for case in cases_json:
                    name = case["name"]
                    failures, worst = [], {}
                    try:
                        adv, ret, keys, dtype, req = run_statements(specs[name], case, layout)
                    except Exception as err:  # noqa: BLE001  (reported, not hidden)
                        sink.append((name, [f"raised {err!r}"], worst, 0))
                        continue
                    r_adv, r_ret, r_keys, r_dtype, _ = roll_runs[layout, name]
                    if req != len(layout):
                        failures.append(f"{req} requests, expected {len(layout)} (one per domain)")
                    if keys != r_keys:
                        failures.append(f"batch keys {keys}, ROLL's {r_keys}")
                    if dtype != r_dtype:
                        failures.append(f"advantages {dtype}, ROLL's {r_dtype}")
                    checks = [("advantages vs ROLL's run", adv, r_adv), ("returns vs ROLL's run", ret, r_ret)]
                    if len(layout) == 1:
                        checks += [("advantages", adv, case["expected_advantages"]),
                                   ("returns", ret, case["expected_returns"])]
                    for label, got, want in checks:
                        ok, worst[label] = _close(got, want)
                        if not ok:
                            failures.append(f"{label} differ (worst |err|/tol {worst[label]:.3g})")
                    sink.append((name, failures, worst, req))
                if scale == 1.0:
                    requests[layout] = {k: v - before[k] for k, v in state["requests"].items()}
    finally:
        srv.stop(grace=1.0)
        REGISTRY.update(originals)
        mod.compute_advantage = F.compute_advantage

    n = len(cases_json)
    print(f"drop-in check in ROLL's RLVRPipeline.run ({PIPELINE_PATH} lines {info['lines'][0]}-{info['lines'][1]}, "
          f"compute_advantage called at line {info['compute_advantage_call_line']}), {n} cases of {path}")
    print(f"ROLL's own run of those statements (not installed) matches the goldens on {n - len(roll_vs_golden)}/{n}"
          + (f"; not on {roll_vs_golden}" if roll_vs_golden else ""))
    record, ok = {}, not roll_vs_golden
    for layout in DROPIN_LAYOUTS:
        label = "+".join(layout)
        res, pert = results[1.0, layout], results[factor, layout]
        passed = [name for name, failures, _, _ in res if not failures]
        failed_perturbed = [name for name, failures, _, _ in pert if failures]
        ok = ok and len(passed) == n
        print(f"domains {label}:")
        for name, failures, worst, req in res:
            print(f"  {'ok  ' if not failures else 'FAIL'} {name}: requests {req}; worst |err|/tol: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
            for f in failures:
                print(f"       {f}")
        print(f"  passed {len(passed)}/{n}; requests {requests[layout]}")
        print(f"  with every estimator's results x{factor}: {len(failed_perturbed)}/{n} fail")
        for name, failures, worst, _ in pert:
            if not failures:
                print(f"  PASSES {name}: worst |err|/tol: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
        record[label] = {"passed": len(passed),
                         "compared_with": "goldens and ROLL's run" if len(layout) == 1 else "ROLL's run",
                         "requests": {**requests[layout], "total": sum(requests[layout].values())},
                         f"fail_at_x{DROPIN_PERTURBATION}": len(failed_perturbed)}
    if factor != DROPIN_PERTURBATION:
        print(f"(factor {factor} is not the recorded {DROPIN_PERTURBATION}: {path} left as it is)")
        return 0 if ok else 1

    doc["source"]["dropin_check"] = {
        "cases": n,
        "cases_sha256": cases_sha256(cases_json),
        "roll_run_matches_goldens": n - len(roll_vs_golden),
        "domains": record,
        "pipeline": {**info, "blob": git_blob_id(src / PIPELINE_PATH)},
        "roll_modules_run_from_source": real_modules,
        "stubs": {name: why for name, (_, why) in DROPIN_STUBS.items()},
        "command": DROPIN_COMMAND,
    }
    dump(doc, path)
    print(f"wrote source.dropin_check into {path}")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roll-src", required=True, type=Path, help="ROLL source tree at commit " + ROLL_COMMIT)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check-dropin", action="store_true",
                    help="run advantage_client.roll inside ROLL's own RLVRPipeline.run code on every case of --out "
                         "(an in-process server) and record the outcome in its source.dropin_check; computes no "
                         "new cases")
    ap.add_argument("--dropin-perturbation", type=float, default=DROPIN_PERTURBATION,
                    help=f"with --check-dropin: the factor of the perturbed run (default {DROPIN_PERTURBATION}; "
                         "another factor only prints, it writes nothing)")
    args = ap.parse_args(argv)
    if not args.no_verify:
        verify_source(args.roll_src, DROPIN_BLOBS if args.check_dropin else BLOBS)
    import torch
    from tensordict import TensorDict
    torch.set_num_threads(1)
    if args.check_dropin:
        return check_dropin(args.roll_src.resolve(), torch, TensorDict, args.out, args.dropin_perturbation)
    F, K = load_roll(args.roll_src)
    out = [run_case(F, K, torch, TensorDict, i, c) for i, c in enumerate(cases())]
    doc = {"source": {"repo": "https://github.com/alibaba/ROLL", "commit": ROLL_COMMIT,
                      "paths": sorted(BLOBS), "blobs": {k: git_blob_id(args.roll_src / k) for k in BLOBS},
                      "generator": "tests/golden_roll/generate.py",
                      "torch": torch.__version__, "numpy": np.__version__}, "cases": out}
    dump(doc, args.out)
    print(f"wrote {len(out)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
