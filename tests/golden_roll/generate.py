"""Generate golden advantage vectors by running ROLL's own RLVR code (alibaba/ROLL).

Pinned source: https://github.com/alibaba/ROLL at commit
8eb27cc2dc34c4d1310b169d9b86d339004d811a (the commit ``advantage_client.references`` names for ``roll``).

This script is a maintenance tool. The tests only read its output, ``tests/golden_roll/roll_cases.json``; they never
import this file and CI never runs it.

Refresh command (from the repository root)::

    rm -rf /tmp/roll-src && mkdir -p /tmp/roll-src && git --git-dir=/work/.mirror/alibaba+ROLL/repo archive 8eb27cc2dc34c4d1310b169d9b86d339004d811a roll/utils/functionals.py roll/utils/kl_controller.py | tar -x -C /tmp/roll-src && .venv/bin/python tests/golden_roll/generate.py --roll-src /tmp/roll-src

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
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
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


def verify_source(src: Path) -> None:
    for rel, want in BLOBS.items():
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roll-src", required=True, type=Path, help="ROLL source tree at commit " + ROLL_COMMIT)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not args.no_verify:
        verify_source(args.roll_src)
    import torch
    from tensordict import TensorDict
    torch.set_num_threads(1)
    F, K = load_roll(args.roll_src)
    out = [run_case(F, K, torch, TensorDict, i, c) for i, c in enumerate(cases())]
    doc = {"source": {"repo": "https://github.com/alibaba/ROLL", "commit": ROLL_COMMIT,
                      "paths": sorted(BLOBS), "blobs": {k: git_blob_id(args.roll_src / k) for k in BLOBS},
                      "generator": "tests/golden_roll/generate.py",
                      "torch": torch.__version__, "numpy": np.__version__}, "cases": out}
    dump(doc, args.out)
    print(f"wrote {len(out)} cases to {args.out}")


if __name__ == "__main__":
    main()
