"""Generate golden advantage vectors by running slime's own code (THUDM/slime).

Pinned source: https://github.com/THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515.

This script is a maintenance tool.  The tests only read its output,
``tests/golden_slime/slime_cases.json``; they never import this file and CI
never runs it.

Refresh command (from the repository root)::

    rm -rf /tmp/slime-src && mkdir -p /tmp/slime-src && git --git-dir=/work/.mirror/THUDM+slime/repo archive 624b824a898ab0ec1fcb4d373004c7f3852bf515 | tar -x -C /tmp/slime-src && .venv/bin/python tests/golden_slime/generate.py --slime-src /tmp/slime-src

Without the local mirror, use a checkout instead::

    git clone https://github.com/THUDM/slime /tmp/slime-src && git -C /tmp/slime-src checkout 624b824a898ab0ec1fcb4d373004c7f3852bf515
    .venv/bin/python tests/golden_slime/generate.py --slime-src /tmp/slime-src

The script checks the git blob ids of the source files it runs against the
pinned commit and refuses to run on other versions (``--no-verify`` skips
that check).  Output is deterministic: seeded NumPy inputs, CPU PyTorch with
one thread.

slime code that is run (unmodified source text from --slime-src):

* ``RolloutManager._post_process_rewards`` (``slime/ray/rollout.py``): that
  module imports ray and sglang, so only this method's source is extracted
  with ``ast`` and executed against a fake ``self`` (``.args`` plus
  ``custom_reward_post_process_func = None``) and real
  ``slime.utils.types.Sample`` objects carrying the raw reward
  (``Sample.get_reward_value`` with ``reward_key=None``).
* ``compute_advantages_and_returns(args, rollout_data)``
  (``slime/backends/megatron_utils/loss.py``), imported normally, which calls
  the real ``compute_approx_kl``, ``get_grpo_returns``,
  ``get_reinforce_plus_plus_returns``,
  ``get_reinforce_plus_plus_baseline_advantages``,
  ``get_advantages_and_returns_batch`` / ``chunked_gae`` /
  ``chunked_discounted_returns`` (``slime/utils/ppo_utils.py``) and
  ``distributed_masked_whiten`` (``slime/utils/distributed_utils.py``).
  For ``normalize_advantages=True`` cases it is called a second time with
  ``normalize_advantages=False`` on fresh copies of the same inputs to record
  the advantages before whitening.

Stand-ins (only for packages that are not installed; none of them computes
anything numeric):

* ``megatron``, ``megatron.core``, ``megatron.core.mpu``: empty modules; ``mpu``
  provides ``is_pipeline_last_stage() -> True``,
  ``get_context_parallel_world_size() -> 1``,
  ``get_context_parallel_rank() -> 0`` and
  ``get_data_parallel_group(with_context_parallel=True) ->
  torch.distributed.group.WORLD``.  WORLD is a real single-process gloo group
  on 127.0.0.1, so the all_reduce inside ``distributed_masked_whiten`` runs
  for real (and is the identity).  Because ``megatron.core.parallel_state`` is
  missing, slime's optional Megatron grad-coalesce patch skips itself with a
  warning, and ``deep_ep`` is reported missing; both are irrelevant here.
* ``httpx``: an empty module with a dummy ``AsyncClient`` class (imported by
  ``slime/utils/http_utils.py`` through ``slime.utils.misc``; never called).
* ``args``: an ``argparse.Namespace`` with the fields the two functions read
  (``use_rollout_logprobs=False``, ``use_opd=False``,
  ``custom_advantage_function_path=None``, ``reward_key=None`` besides the
  recorded ``slime_args``).

Drop-in check (``--check-dropin``)
---------------------------------

Proves ``advantage_client.slime`` (the ``--custom-advantage-function-path`` /
``--custom-reward-post-process-path`` hooks) with slime's own code, for every case already in
``--out``; it computes no new cases and writes only ``source.dropin_check``.  Command (from the repository
root)::

    rm -rf /tmp/slime-src && mkdir -p /tmp/slime-src && git --git-dir=/work/.mirror/THUDM+slime/repo archive 624b824a898ab0ec1fcb4d373004c7f3852bf515 | tar -x -C /tmp/slime-src && .venv/bin/python tests/golden_slime/generate.py --slime-src /tmp/slime-src --check-dropin

(``server/`` and ``client/`` are added to ``sys.path`` when the venv does not install them.)  With the same
slime set-up as above, it starts an in-process server (``advantage_server.server.create_server("127.0.0.1", 0,
device="cpu")``), points ``$ADVANTAGE_SERVICE_TARGET`` at it (``$ADVANTAGE_SERVICE_TLS_CA`` /
``$ADVANTAGE_SERVICE_TOKEN_FILE`` are unset for the run), and wraps the ``fn`` of the server's registry
entries ``grpo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` and ``gae`` to count the calls.
Per case, from its recorded inputs:

1. the extracted ``_post_process_rewards`` runs against a fake ``self`` whose
   ``custom_reward_post_process_func`` is ``slime.utils.misc.load_function(
   "advantage_client.slime.post_process_rewards")``; the rewards must equal ``post_processed_rewards``
   within ``|a - b| <= 2e-6 * max(1, |b|)`` and the call must make exactly 1 request for
   grpo/gspo/cispo/reinforce_plus_plus_baseline with ``rewards_normalization``, else 0;
2. the real ``compute_advantages_and_returns`` runs with ``custom_advantage_function_path =
   "advantage_client.slime.compute_advantages_and_returns"`` (slime loads it with its ``load_function``) on
   the recorded inputs and the rewards step 1 returned; ``rollout_data["advantages"]`` (after slime's own
   whitening) and ``["returns"]`` must be lists of B float32 ``[T_i]`` tensors equal to
   ``expected_advantages`` / ``expected_returns`` within ``|got - want| <= 1e-5 * |want| + 2e-6 * max(1,
   max|want|)`` (tests/test_golden_slime.py's rule), with exactly 1 request, and leave slime's input tensors
   unchanged.

It then runs every case again with each wrapped estimator's advantages and returns multiplied by 1.0001
(``--dropin-perturbation F`` tries another factor and writes nothing) and counts the cases that fail: all of
them (slime's whitening removes a common scale from the advantages, but the returns are not whitened).
The outcome goes into ``source.dropin_check`` (``cases``, ``passed``, ``requests`` per server estimator and
per step, ``fail_at_x1.0001``, ``command``); the cases are rewritten byte-identically.  Regenerating the
cases (the refresh command) drops ``dropin_check``: run the check again afterwards.  Exit status 1 when a
case fails the unperturbed check.

Input conventions follow slime's trainer: ``log_probs``, ``ref_log_probs`` and
``values`` are float32 tensors of shape [T_i], ``loss_masks`` are
``torch.int`` (int32) tensors (``MegatronTrainRayActor._get_rollout_data``
converts them so), ``rewards`` is the list of Python floats returned by
``_post_process_rewards``, ``total_lengths = prompt_length + T_i``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import math
import os
import socket
import sys
import textwrap
import types
from pathlib import Path

import numpy as np

SLIME_REPO = "https://github.com/THUDM/slime"
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
# git blob ids of the files at SLIME_COMMIT (git rev-parse <commit>:<path>).
SLIME_BLOBS = {
    "slime/ray/rollout.py": "246e828fb18ecce75121abc5a5e6038e84a88599",
    "slime/backends/megatron_utils/loss.py": "e7ac97c19e0e5a024b320895566e985c820b8144",
    "slime/utils/ppo_utils.py": "4746af4f3a62c1559748638bc767960087ad51aa",
    "slime/utils/distributed_utils.py": "af97bc14daa84f10bcbeeb3624e18708cb02a1fe",
    "slime/utils/types.py": "df4b10062ca643f3796e9296c4bb24c9d444b149",
}
SOURCE_PATHS = [
    "slime/ray/rollout.py",
    "slime/backends/megatron_utils/loss.py",
    "slime/utils/ppo_utils.py",
    "slime/utils/distributed_utils.py",
]
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "slime_cases.json"
BASE_SEED = 20240624


# --------------------------------------------------------------------------
# Importing slime
# --------------------------------------------------------------------------


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def verify_source(src: Path) -> None:
    bad = []
    for rel, blob in SLIME_BLOBS.items():
        p = src / rel
        if not p.is_file():
            bad.append(f"{rel}: missing")
        elif git_blob_id(p) != blob:
            bad.append(f"{rel}: blob {git_blob_id(p)} != {blob}")
    if bad:
        raise SystemExit(
            f"--slime-src {src} is not slime@{SLIME_COMMIT}:\n  " + "\n  ".join(bad) + "\n(use --no-verify to override)"
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_stubs(torch) -> None:
    """Stand-ins for packages that are not installed (megatron, httpx)."""
    import torch.distributed as dist

    mpu = types.ModuleType("megatron.core.mpu")
    mpu.is_pipeline_last_stage = lambda *a, **k: True
    mpu.get_context_parallel_world_size = lambda *a, **k: 1
    mpu.get_context_parallel_rank = lambda *a, **k: 0

    def get_data_parallel_group(with_context_parallel=False, **kwargs):
        assert with_context_parallel, "slime whitens over the DP group *with* CP"
        return dist.group.WORLD

    mpu.get_data_parallel_group = get_data_parallel_group

    megatron = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    megatron.__path__ = []
    core.__path__ = []
    megatron.core = core
    core.mpu = mpu
    for name in ("megatron", "megatron.core", "megatron.core.mpu"):
        assert name not in sys.modules, f"{name} is importable; refusing to shadow it"
    sys.modules.update({"megatron": megatron, "megatron.core": core, "megatron.core.mpu": mpu})

    try:
        import httpx  # noqa: F401
    except ImportError:
        httpx = types.ModuleType("httpx")
        httpx.AsyncClient = type("AsyncClient", (), {})
        sys.modules["httpx"] = httpx


def load_post_process_rewards(src: Path, torch, Sample):
    """Exec the unmodified source of RolloutManager._post_process_rewards."""
    path = src / "slime/ray/rollout.py"
    text = path.read_text()
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutManager")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_post_process_rewards")
    assert not fn.decorator_list
    lines = text.splitlines(keepends=True)[fn.lineno - 1 : fn.end_lineno]
    code = textwrap.dedent("".join(lines))
    ns = {"torch": torch, "Sample": Sample}
    exec(compile(code, f"{path}:RolloutManager._post_process_rewards", "exec"), ns)
    return ns["_post_process_rewards"], code


# --------------------------------------------------------------------------
# Case specifications
# --------------------------------------------------------------------------


def spec(name, est, B, n, *, kl=0.0, klt="k1", gamma=1.0, lambd=1.0, norm_adv=False, rew_norm=True,
         std_norm=True, rewards="binary", masks="mixed", lengths="long"):
    if est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert norm_adv, "slime's arguments.py requires --normalize-advantages for REINFORCE++"
    assert B % n == 0 and n >= 2
    return dict(name=name, est=est, B=B, n=n, kl=kl, klt=klt, gamma=gamma, lambd=lambd, norm_adv=norm_adv,
                rew_norm=rew_norm, std_norm=std_norm, rewards=rewards, masks=masks, lengths=lengths)


CASES = [
    # ---- grpo: group mean (and std) normalisation in the rollout manager; KL never enters the advantage.
    spec("grpo-b8n4-std-binary-long", "grpo", 8, 4, masks="mixed", lengths="long"),
    spec("grpo-b4n2-std-float-k1", "grpo", 4, 2, kl=0.01, klt="k1", rewards="float", lengths="mid"),
    spec("grpo-b16n8-std-binary-k3-whiten", "grpo", 16, 8, kl=0.2, klt="k3", norm_adv=True, lengths="short"),
    spec("grpo-b6n3-nostd-float-lowvar-whiten", "grpo", 6, 3, kl=0.01, klt="low_var_kl", norm_adv=True,
         std_norm=False, rewards="float", lengths="long"),
    spec("grpo-b2n2-norewnorm-k2", "grpo", 2, 2, kl=0.2, klt="k2", rew_norm=False, rewards="float", lengths="mid"),
    spec("grpo-b12n4-norewnorm-ones-whiten", "grpo", 12, 4, norm_adv=True, rew_norm=False, masks="ones",
         lengths="short"),
    spec("grpo-b8n8-std-exact256-whiten", "grpo", 8, 8, norm_adv=True, rewards="float", lengths="exact256"),
    spec("grpo-b16n2-std-float-lowvar", "grpo", 16, 2, kl=0.2, klt="low_var_kl", rewards="float", masks="holes",
         lengths="short"),
    # ---- gspo: same advantage path as grpo.
    spec("gspo-b8n4-std-binary", "gspo", 8, 4, lengths="long"),
    spec("gspo-b6n2-nostd-float-k3-whiten", "gspo", 6, 2, kl=0.01, klt="k3", norm_adv=True, std_norm=False,
         rewards="float", lengths="mid"),
    spec("gspo-b4n4-norewnorm-k1-whiten", "gspo", 4, 4, kl=0.2, klt="k1", norm_adv=True, rew_norm=False,
         masks="tail0", lengths="long"),
    spec("gspo-b10n5-std-float-tail0", "gspo", 10, 5, rewards="float", masks="tail0", lengths="short"),
    spec("gspo-b16n4-std-binary-k2-whiten", "gspo", 16, 4, kl=0.01, klt="k2", norm_adv=True, lengths="short"),
    # ---- cispo: same advantage path as grpo.
    spec("cispo-b8n4-std-float", "cispo", 8, 4, rewards="float", lengths="long"),
    spec("cispo-b4n2-std-binary-lowvar-whiten", "cispo", 4, 2, kl=0.2, klt="low_var_kl", norm_adv=True,
         lengths="mid"),
    spec("cispo-b9n3-nostd-binary", "cispo", 9, 3, std_norm=False, masks="holes", lengths="short"),
    spec("cispo-b6n6-norewnorm-float-k1", "cispo", 6, 6, kl=0.01, klt="k1", rew_norm=False, rewards="float",
         lengths="exact128"),
    spec("cispo-b14n7-std-float-ones-whiten", "cispo", 14, 7, norm_adv=True, rewards="float", masks="ones",
         lengths="short"),
    # ---- reinforce_plus_plus: token-level masked KL penalty, reward at the last loss-mask token,
    #      chunked discounted returns (gamma), then whitening (always on).
    spec("rpp-b4n2-g1-kl0", "reinforce_plus_plus", 4, 2, norm_adv=True, rewards="binary", lengths="long"),
    spec("rpp-b6n3-g1-k1-0.01", "reinforce_plus_plus", 6, 3, kl=0.01, klt="k1", norm_adv=True,
         rewards="float", lengths="long"),
    spec("rpp-b8n4-g0.9-k3-0.2", "reinforce_plus_plus", 8, 4, kl=0.2, klt="k3", gamma=0.9, norm_adv=True,
         masks="tail0", lengths="mid"),
    spec("rpp-b4n4-g0.95-lowvar-0.2", "reinforce_plus_plus", 4, 4, kl=0.2, klt="low_var_kl", gamma=0.95,
         norm_adv=True, rewards="float", lengths="long"),
    spec("rpp-b2n2-g0-k2-0.2", "reinforce_plus_plus", 2, 2, kl=0.2, klt="k2", gamma=0.0, norm_adv=True,
         rewards="float", lengths="mid"),
    spec("rpp-b16n8-g1-k2-0.01-ones", "reinforce_plus_plus", 16, 8, kl=0.01, klt="k2", norm_adv=True,
         rew_norm=False, masks="ones", lengths="short"),
    spec("rpp-b8n2-g0.95-k1-0.2-exact256", "reinforce_plus_plus", 8, 2, kl=0.2, klt="k1", gamma=0.95,
         norm_adv=True, masks="holes", lengths="exact256"),
    spec("rpp-b6n2-g0.9-lowvar-0.01-exact128", "reinforce_plus_plus", 6, 2, kl=0.01, klt="low_var_kl",
         gamma=0.9, norm_adv=True, lengths="exact128"),
    # ---- reinforce_plus_plus_baseline: group mean subtraction (never std), advantage = r - kl_coef * kl
    #      (unmasked), then whitening (always on).
    spec("rppb-b8n4-kl0-binary", "reinforce_plus_plus_baseline", 8, 4, norm_adv=True, lengths="long"),
    spec("rppb-b4n2-k1-0.01-float", "reinforce_plus_plus_baseline", 4, 2, kl=0.01, klt="k1", norm_adv=True,
         rewards="float", lengths="mid"),
    spec("rppb-b6n3-k3-0.2-stdflag", "reinforce_plus_plus_baseline", 6, 3, kl=0.2, klt="k3", norm_adv=True,
         std_norm=True, rewards="float", lengths="long"),
    spec("rppb-b12n6-lowvar-0.2-nostd", "reinforce_plus_plus_baseline", 12, 6, kl=0.2, klt="low_var_kl",
         norm_adv=True, std_norm=False, masks="holes", lengths="short"),
    spec("rppb-b4n2-norewnorm-k2-0.2", "reinforce_plus_plus_baseline", 4, 2, kl=0.2, klt="k2", norm_adv=True,
         rew_norm=False, rewards="float", masks="tail0", lengths="long"),
    spec("rppb-b16n8-k1-0.2-ones", "reinforce_plus_plus_baseline", 16, 8, kl=0.2, klt="k1", norm_adv=True,
         masks="ones", lengths="short"),
    # ---- ppo: token-level KL penalty, reward added at the last token (index -1, regardless of the mask),
    #      chunked GAE with values; optional whitening.
    spec("ppo-b4n2-g1-l1-kl0", "ppo", 4, 2, rewards="float", lengths="long"),
    spec("ppo-b6n3-g0.9-l0.95-k1-0.01-whiten", "ppo", 6, 3, kl=0.01, klt="k1", gamma=0.9, lambd=0.95,
         norm_adv=True, rewards="binary", lengths="long"),
    spec("ppo-b4n4-g0.95-l1-k3-0.2", "ppo", 4, 4, kl=0.2, klt="k3", gamma=0.95, lambd=1.0, rewards="float",
         masks="tail0", lengths="mid"),
    spec("ppo-b8n2-g1-l0.95-lowvar-0.2-whiten", "ppo", 8, 2, kl=0.2, klt="low_var_kl", gamma=1.0, lambd=0.95,
         norm_adv=True, rewards="float", lengths="mid"),
    spec("ppo-b2n2-g1-l0-k2-0.01", "ppo", 2, 2, kl=0.01, klt="k2", gamma=1.0, lambd=0.0, rewards="float",
         lengths="long"),
    spec("ppo-b4n2-g0-l1-k1-0.2-whiten", "ppo", 4, 2, kl=0.2, klt="k1", gamma=0.0, lambd=1.0, norm_adv=True,
         rewards="float", masks="holes", lengths="mid"),
    spec("ppo-b16n8-g0.99-l0.95-k3-0.01", "ppo", 16, 8, kl=0.01, klt="k3", gamma=0.99, lambd=0.95,
         rew_norm=False, rewards="binary", lengths="short"),
    spec("ppo-b6n2-g1-l1-k2-0.2-exact256-whiten", "ppo", 6, 2, kl=0.2, klt="k2", norm_adv=True, rewards="float",
         lengths="exact256"),
    spec("ppo-b8n4-g0.9-l0.95-kl0-exact128-ones", "ppo", 8, 4, gamma=0.9, lambd=0.95, rewards="float",
         masks="ones", lengths="exact128"),
    spec("ppo-b10n5-g0.95-l0.9-lowvar-0.01-whiten", "ppo", 10, 5, kl=0.01, klt="low_var_kl", gamma=0.95,
         lambd=0.9, norm_adv=True, rew_norm=False, rewards="binary", masks="tail0", lengths="short"),
]


# --------------------------------------------------------------------------
# Input generation
# --------------------------------------------------------------------------


def _not_mult128(rng, lo, hi):
    while True:
        x = int(rng.integers(lo, hi + 1))
        if x % 128:
            return x


def gen_lengths(rng, B, profile):
    def small(k, hi):
        # log-uniform in [2, hi]
        return [int(round(math.exp(rng.uniform(math.log(2), math.log(hi))))) for _ in range(k)]

    if profile == "long":  # one row in (512, 700], one in (256, 512) when B >= 4, a length-1 row
        special = [_not_mult128(rng, 513, 700)]
        if B >= 4:
            special.append(_not_mult128(rng, 257, 511))
        special.append(1)
        rest = small(B - len(special), 100)
    elif profile == "mid":  # longest row in (128, 256)
        special = [_not_mult128(rng, 129, 255), 1]
        rest = small(B - len(special), 90)
    elif profile == "short":  # everything below 128
        special = [1, int(rng.integers(100, 128))]
        rest = small(B - len(special), 40)
    elif profile == "exact128":  # batch max is exactly one chunk
        special = [128, 1]
        rest = small(B - len(special), 127)
    elif profile == "exact256":  # batch max is exactly two chunks
        special = [256, _not_mult128(rng, 129, 255), 1]
        rest = small(B - len(special), 60)
    else:
        raise ValueError(profile)
    lengths = special + rest
    assert len(lengths) == B and all(x >= 1 for x in lengths)
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def gen_mask(rng, T, kind):
    m = np.ones(T, dtype=np.int64)
    if T == 1:
        return m
    if kind == "mixed":
        kind = str(rng.choice(["ones", "holes", "tail0", "holes_tail0", "lead0"]))
    if kind == "ones":
        return m
    if kind in ("holes", "holes_tail0") and T >= 3:
        # multi-turn: spans of tool-output tokens (mask 0) between model turns
        for _ in range(int(rng.integers(1, 4))):
            a = int(rng.integers(1, T - 1))
            b = int(rng.integers(a + 1, min(T, a + max(2, T // 3)) + 1))
            m[a:b] = 0
    if kind in ("tail0", "holes_tail0"):
        k = int(rng.integers(1, max(2, T // 4) + 1))
        m[T - min(k, T - 1):] = 0
    if kind == "lead0":
        k = int(rng.integers(1, max(2, T // 4) + 1))
        m[: min(k, T - 1)] = 0
    if m.sum() == 0:  # every row keeps at least one loss token
        m[int(rng.integers(0, T))] = 1
    return m


def gen_rewards(rng, c):
    B, n = c["B"], c["n"]
    divides_by_std = c["rew_norm"] and c["std_norm"] and c["est"] in ("grpo", "gspo", "cispo")
    out = []
    for _ in range(B // n):
        while True:
            if c["rewards"] == "binary":
                g = rng.integers(0, 2, size=n).astype(np.float32)
            else:
                g = rng.normal(0.0, 1.0, size=n).astype(np.float32)
            if not divides_by_std or len(set(g.tolist())) > 1:
                break
        out.extend(float(x) for x in g)
    return out


def gen_inputs(rng, c):
    B = c["B"]
    lengths = gen_lengths(rng, B, c["lengths"])
    masks, lps, refs, vals, prompts = [], [], [], [], []
    for T in lengths:
        masks.append(gen_mask(rng, T, c["masks"]))
        lp = -rng.exponential(1.5, size=T)
        noise = rng.normal(0.0, 0.3, size=T)
        big = rng.random(T) < 0.05
        noise[big] = rng.normal(0.0, 3.0, size=int(big.sum()))
        ref = -np.abs(lp + noise)
        lps.append(lp.astype(np.float32))
        refs.append(ref.astype(np.float32))
        vals.append(rng.normal(0.0, 0.5, size=T).astype(np.float32))
        prompts.append(int(rng.integers(1, 400)))
    return dict(lengths=lengths, masks=masks, log_probs=lps, ref_log_probs=refs, values=vals, prompts=prompts,
                raw_rewards=gen_rewards(rng, c))


# --------------------------------------------------------------------------
# Running slime
# --------------------------------------------------------------------------


def slime_args(c):
    return {
        "advantage_estimator": c["est"],
        "kl_coef": c["kl"],
        "kl_loss_type": c["klt"],
        "gamma": c["gamma"],
        "lambd": c["lambd"],
        "normalize_advantages": c["norm_adv"],
        "rewards_normalization": c["rew_norm"],
        "grpo_std_normalization": c["std_norm"],
        "n_samples_per_prompt": c["n"],
        "rollout_batch_size": c["B"] // c["n"],
    }


def make_namespace(sa, **over):
    ns = argparse.Namespace(
        **sa,
        use_rollout_logprobs=False,
        use_opd=False,
        custom_advantage_function_path=None,
        reward_key=None,
    )
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def build_rollout_data(torch, inp, rewards, est):
    rd = {
        "log_probs": [torch.from_numpy(x.copy()) for x in inp["log_probs"]],
        "ref_log_probs": [torch.from_numpy(x.copy()) for x in inp["ref_log_probs"]],
        "rewards": list(rewards),
        "response_lengths": list(inp["lengths"]),
        # MegatronTrainRayActor._get_rollout_data: loss_masks -> dtype=torch.int
        "loss_masks": [torch.tensor(m.tolist(), dtype=torch.int) for m in inp["masks"]],
        "total_lengths": [p + t for p, t in zip(inp["prompts"], inp["lengths"])],
    }
    if est == "ppo":
        rd["values"] = [torch.from_numpy(x.copy()) for x in inp["values"]]
    return rd


def flat(tensors):
    import torch

    for t in tensors:
        assert t.dtype == torch.float32, t.dtype
        assert t.dim() == 1
    out = [float(x) for x in torch.cat(tensors).tolist()]
    assert all(math.isfinite(x) for x in out), "non-finite output"
    return out


def run_case(torch, post_process, compute, Sample, idx, c):
    rng = np.random.default_rng([BASE_SEED, idx])
    inp = gen_inputs(rng, c)
    sa = slime_args(c)
    args = make_namespace(sa)

    # 1. reward post-processing (rollout manager)
    fake_self = types.SimpleNamespace(args=args, custom_reward_post_process_func=None)
    samples = [Sample(reward=r) for r in inp["raw_rewards"]]
    raw, rewards = post_process(fake_self, samples)
    assert raw == inp["raw_rewards"] and len(rewards) == c["B"]
    rewards = [float(r) for r in rewards]

    # 2. advantages/returns (trainer)
    rd = build_rollout_data(torch, inp, rewards, c["est"])
    rd_in = copy.deepcopy(rd)
    compute(args, rd)
    for k in rd_in:  # slime must not have modified its inputs
        if isinstance(rd_in[k], list) and rd_in[k] and torch.is_tensor(rd_in[k][0]):
            assert all(torch.equal(a, b) for a, b in zip(rd_in[k], rd[k])), k
    lengths = inp["lengths"]
    assert [t.numel() for t in rd["advantages"]] == lengths
    assert [t.numel() for t in rd["returns"]] == lengths

    cu = [0]
    for T in lengths:
        cu.append(cu[-1] + T)
    case = {
        "name": c["name"],
        "slime_estimator": c["est"],
        "slime_args": sa,
        "raw_rewards": [float(r) for r in raw],
        "post_processed_rewards": rewards,
        "cu_seqlens": cu,
        "loss_mask": [float(x) for m in inp["masks"] for x in m],
        "log_probs": [float(x) for a in inp["log_probs"] for x in a],
        "ref_log_probs": [float(x) for a in inp["ref_log_probs"] for x in a],
    }
    if c["est"] == "ppo":
        case["values"] = [float(x) for a in inp["values"] for x in a]
    case["prompt_length"] = list(inp["prompts"])
    case["expected_advantages"] = flat(rd["advantages"])
    case["expected_returns"] = flat(rd["returns"])

    if c["norm_adv"]:
        rd2 = build_rollout_data(torch, inp, rewards, c["est"])
        compute(make_namespace(sa, normalize_advantages=False), rd2)
        case["expected_advantages_unwhitened"] = flat(rd2["advantages"])
        # returns do not depend on whitening
        assert flat(rd2["returns"]) == case["expected_returns"]
    return case


HOW = (
    "CPU PyTorch {torch_version}, torch.set_num_threads(1), float32 inputs from a seeded NumPy generator "
    "(numpy.random.default_rng([{seed}, case_index])). Per case: (1) the unmodified source of "
    "RolloutManager._post_process_rewards (slime/ray/rollout.py), extracted with ast and exec'd against a fake "
    "self (args + custom_reward_post_process_func=None) and real slime.utils.types.Sample objects holding the raw "
    "rewards, gives post_processed_rewards; (2) the real compute_advantages_and_returns "
    "(slime/backends/megatron_utils/loss.py, which calls the real compute_approx_kl and estimator helpers of "
    "slime/utils/ppo_utils.py and distributed_masked_whiten of slime/utils/distributed_utils.py) runs on "
    "rollout_data with per-sample float32 log_probs/ref_log_probs/values[T_i], int32 loss_masks (as "
    "MegatronTrainRayActor._get_rollout_data makes them), rewards=post_processed_rewards, response_lengths and "
    "total_lengths=prompt_length+T_i; expected_advantages/expected_returns are the concatenated "
    "rollout_data['advantages']/['returns'] it leaves; for normalize_advantages cases it is called again with "
    "normalize_advantages=False to give expected_advantages_unwhitened. Stubs: megatron.core.mpu "
    "(is_pipeline_last_stage->True, context-parallel size 1/rank 0, get_data_parallel_group(with_context_parallel="
    "True)->torch.distributed.group.WORLD of a real single-process gloo group on 127.0.0.1) and an empty httpx "
    "module; args is a Namespace with slime_args plus use_rollout_logprobs=False, use_opd=False, "
    "custom_advantage_function_path=None, reward_key=None. Floats are written with repr (exact doubles of the "
    "float32 values)."
)


def dump(doc, path: Path) -> None:
    # one case per line: compact but diffable
    parts = ['{"source":' + json.dumps(doc["source"], allow_nan=False) + ',\n"cases":[\n']
    parts.append(",\n".join(json.dumps(c, separators=(",", ":"), allow_nan=False) for c in doc["cases"]))
    parts.append("\n]}\n")
    path.write_text("".join(parts))
    assert json.loads(path.read_text()) == doc


# --------------------------------------------------------------------------
# --check-dropin: advantage_client.slime inside slime's own code
# --------------------------------------------------------------------------

DROPIN_ADVANTAGES = "advantage_client.slime.compute_advantages_and_returns"
DROPIN_REWARDS = "advantage_client.slime.post_process_rewards"
#: the server's estimators the drop-in asks for (slime's gspo/cispo are grpo, ppo is gae)
DROPIN_ESTIMATORS = ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
#: slime's estimators whose rewards _post_process_rewards normalises per group (with rewards_normalization)
DROPIN_GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
DROPIN_PERTURBATION = 1.0001
DROPIN_COMMAND = (
    "rm -rf /tmp/slime-src && mkdir -p /tmp/slime-src && git --git-dir=/work/.mirror/THUDM+slime/repo archive "
    f"{SLIME_COMMIT} | tar -x -C /tmp/slime-src && .venv/bin/python tests/golden_slime/generate.py "
    "--slime-src /tmp/slime-src --check-dropin"
)


def _first_miss(got, want, tol_of):
    """First index where |got - want| > tol_of(want) (NaN never passes): (index, got, want, tol), or None."""
    if len(got) != len(want):
        return ("length", len(got), len(want), 0.0)
    for i, (g, w) in enumerate(zip(got, want)):
        tol = tol_of(w)
        if not abs(g - w) <= tol:
            return (i, g, w, tol)
    return None


def _worst_ratio(got, want, tol_of):
    """max |got - want| / tol over the positions (how close to the tolerance the comparison came)."""
    return max((abs(g - w) / tol_of(w) for g, w in zip(got, want)), default=0.0)


def _reward_tol(w):
    return 2e-6 * max(1.0, abs(w))


def _token_tol_of(want):
    scale = 2e-6 * max(1.0, max((abs(w) for w in want), default=0.0))
    return lambda w: 1e-5 * abs(w) + scale


def _case_inputs(case):
    """The case's recorded inputs in gen_inputs' shapes (per-sample float32 / int arrays)."""
    cu = case["cu_seqlens"]
    lengths = [b - a for a, b in zip(cu, cu[1:])]

    def split(key, dtype):
        flat_ = np.asarray(case[key], dtype=np.float64)
        out = [flat_[a:b].astype(dtype) for a, b in zip(cu, cu[1:])]
        assert all(np.array_equal(o.astype(np.float64), flat_[a:b]) for o, a, b in zip(out, cu, cu[1:])), key
        return out

    inp = dict(lengths=lengths, masks=split("loss_mask", np.int64), log_probs=split("log_probs", np.float32),
               ref_log_probs=split("ref_log_probs", np.float32), prompts=list(case["prompt_length"]))
    if "values" in case:
        inp["values"] = split("values", np.float32)
    return inp


def dropin_case(torch, post_process, compute, Sample, load_function, case, requests):
    """One case through slime's _post_process_rewards and compute_advantages_and_returns with the drop-in's
    hooks set; returns (failures, info). failures: strings (empty: the case passes)."""
    sa, est, B = case["slime_args"], case["slime_estimator"], len(case["raw_rewards"])
    inp = _case_inputs(case)
    lengths = inp["lengths"]
    failures, info = [], {}
    total = lambda: sum(requests.values())  # noqa: E731

    # 1. the rollout manager: RolloutManager._post_process_rewards with --custom-reward-post-process-path
    args = make_namespace(sa, custom_reward_post_process_path=DROPIN_REWARDS)
    fake_self = types.SimpleNamespace(args=args, custom_reward_post_process_func=load_function(DROPIN_REWARDS))
    samples = [Sample(reward=r) for r in case["raw_rewards"]]
    before = total()
    try:
        raw, rewards = post_process(fake_self, samples)
    except Exception as err:  # noqa: BLE001  (reported, not hidden)
        return [f"reward step raised {err!r}"], info
    info["reward_requests"] = got_req = total() - before
    want_req = int(est in DROPIN_GROUP_NORMALISED and bool(sa["rewards_normalization"]))
    if got_req != want_req:
        failures.append(f"reward step made {got_req} requests, expected {want_req}")
    if list(raw) != case["raw_rewards"]:
        failures.append("reward step: raw_rewards differ from the recorded ones")
    if not (isinstance(rewards, list) and len(rewards) == B and all(isinstance(r, float) for r in rewards)):
        failures.append(f"reward step: rewards is not a list of {B} floats: {type(rewards).__name__} "
                        f"of {len(rewards)}")
        return failures, info
    miss = _first_miss(rewards, case["post_processed_rewards"], _reward_tol)
    info["reward_worst"] = _worst_ratio(rewards, case["post_processed_rewards"], _reward_tol)
    if miss:
        failures.append("post_processed_rewards[{}]: got {!r}, want {!r} (tolerance {:.3g})".format(*miss))

    # 2. the trainer: compute_advantages_and_returns with --custom-advantage-function-path, on the rewards the
    #    rollout manager just returned (slime's pipeline)
    args = make_namespace(sa, custom_advantage_function_path=DROPIN_ADVANTAGES)
    rd = build_rollout_data(torch, inp, rewards, est)
    rd_in = copy.deepcopy(rd)
    before = total()
    try:
        compute(args, rd)
    except Exception as err:  # noqa: BLE001
        failures.append(f"trainer step raised {err!r}")
        return failures, info
    info["trainer_requests"] = got_req = total() - before
    if got_req != 1:
        failures.append(f"trainer step made {got_req} requests, expected 1")
    for k in rd_in:  # the drop-in must not modify slime's inputs
        if isinstance(rd_in[k], list) and rd_in[k] and torch.is_tensor(rd_in[k][0]):
            if not all(torch.equal(x, y) for x, y in zip(rd_in[k], rd[k])):
                failures.append(f"trainer step modified rollout_data[{k!r}]")
    for key, want_key in (("advantages", "expected_advantages"), ("returns", "expected_returns")):
        got = rd.get(key)
        ok = (isinstance(got, list) and len(got) == B and all(
            torch.is_tensor(t) and t.dtype == torch.float32 and t.dim() == 1 and t.numel() == T
            for t, T in zip(got, lengths)))
        if not ok:
            failures.append(f"rollout_data[{key!r}] is not a list of {B} float32 tensors of lengths {lengths}: "
                            + (f"{[(tuple(t.shape), t.dtype) for t in got]}" if isinstance(got, list) else repr(got)))
            continue
        got = [float(x) for x in torch.cat(got).tolist()]
        want = case[want_key]
        tol_of = _token_tol_of(want)
        info[f"{key}_worst"] = _worst_ratio(got, want, tol_of)
        miss = _first_miss(got, want, tol_of)
        if miss:
            i = miss[0]
            row = next((r for r in range(B) if isinstance(i, int) and i < case["cu_seqlens"][r + 1]), None)
            where = f"{key}[{i}]" + (f" (sample {row}, token {i - case['cu_seqlens'][row]})" if row is not None else "")
            failures.append("{}: got {!r}, want {!r} (tolerance {:.3g})".format(where, *miss[1:]))
    return failures, info


def check_dropin(torch, post_process, compute, Sample, path: Path, factor: float = DROPIN_PERTURBATION) -> int:
    """--check-dropin: every case of ``path`` through slime's own code with advantage_client.slime's hooks,
    against an in-process server whose estimators count their calls; then again with the estimators' results
    scaled by ``factor``. Writes source.dropin_check into ``path`` (only for the default factor). Returns the
    exit status: 0 when every case passes the unperturbed run."""
    import dataclasses
    import functools

    root = HERE.parents[1]
    for sub in ("server", "client"):  # when the venv does not install them
        if str(root / sub) not in sys.path:
            sys.path.append(str(root / sub))
    from advantage_server.estimators.registry import REGISTRY
    from advantage_server.server import create_server
    from slime.utils.misc import load_function

    import advantage_client.slime as dropin

    doc = json.loads(path.read_text())
    cases = doc["cases"]
    state = {"scale": 1.0, "requests": dict.fromkeys(DROPIN_ESTIMATORS, 0)}

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

    originals = {name: REGISTRY[name] for name in DROPIN_ESTIMATORS}
    for name, spec_ in originals.items():
        REGISTRY[name] = dataclasses.replace(spec_, fn=counted(name, spec_.fn))
    for var in ("ADVANTAGE_SERVICE_TLS_CA", "ADVANTAGE_SERVICE_TOKEN_FILE"):  # a plaintext loopback server
        os.environ.pop(var, None)
    srv = create_server("127.0.0.1", 0, device="cpu").start()
    try:
        os.environ["ADVANTAGE_SERVICE_TARGET"] = srv.address
        assert dropin._client is None, "advantage_client.slime already made its client"
        loaded = load_function(DROPIN_ADVANTAGES)
        assert loaded is dropin.compute_advantages_and_returns, loaded

        def run_all(scale):
            state["scale"] = scale
            out = []
            for case in cases:
                failures, info = dropin_case(torch, post_process, compute, Sample, load_function, case,
                                             state["requests"])
                out.append((case["name"], failures, info))
            return out

        results = run_all(1.0)
        requests = dict(state["requests"])
        reward_calls = sum(info.get("reward_requests", 0) for _, _, info in results)
        trainer_calls = sum(info.get("trainer_requests", 0) for _, _, info in results)
        perturbed = run_all(factor)
    finally:
        srv.stop(grace=1.0)
        REGISTRY.update(originals)

    passed = [name for name, failures, _ in results if not failures]
    failed_perturbed = [name for name, failures, _ in perturbed if failures]
    print(f"drop-in check, {len(cases)} cases of {path}:")
    for name, failures, info in results:
        worst = ", ".join(f"{k[:-6]} {v:.3g}" for k, v in info.items() if k.endswith("_worst"))
        print(f"  {'ok  ' if not failures else 'FAIL'} {name}: requests {info.get('reward_requests')}+"
              f"{info.get('trainer_requests')}; worst |err|/tol: {worst}")
        for f in failures:
            print(f"       {f}")
    print(f"passed {len(passed)}/{len(cases)}; requests {requests} "
          f"(reward step {reward_calls}, trainer step {trainer_calls})")
    print(f"with every estimator's results x{factor}: {len(failed_perturbed)}/{len(cases)} fail")
    for name, failures, info in perturbed:
        if failures:
            print(f"  fails  {name}: " + "; ".join(failures))
        else:
            worst = ", ".join(f"{k[:-6]} {v:.3g}" for k, v in info.items() if k.endswith("_worst"))
            print(f"  PASSES {name}: worst |err|/tol: {worst}")
    if len(failed_perturbed) < len(cases):
        print(f"WARNING: {len(cases) - len(failed_perturbed)} cases do not notice results x{factor}")
    if factor != DROPIN_PERTURBATION:
        print(f"(factor {factor} is not the recorded {DROPIN_PERTURBATION}: {path} left as it is)")
        return 0 if len(passed) == len(cases) else 1

    doc["source"]["dropin_check"] = {
        "cases": len(cases),
        "passed": len(passed),
        "requests": {**requests, "reward_step": reward_calls, "trainer_step": trainer_calls},
        f"fail_at_x{DROPIN_PERTURBATION}": len(failed_perturbed),
        "command": DROPIN_COMMAND,
    }
    dump(doc, path)
    print(f"wrote source.dropin_check into {path}")
    return 0 if len(passed) == len(cases) else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slime-src", required=True, type=Path, help="slime source tree at commit " + SLIME_COMMIT)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-verify", action="store_true", help="skip the source version check")
    ap.add_argument("--check-dropin", action="store_true",
                    help="check advantage_client.slime against the cases in --out (slime's own code, an in-process "
                         "server) and record the outcome in its source.dropin_check; computes no new cases")
    ap.add_argument("--dropin-perturbation", type=float, default=DROPIN_PERTURBATION,
                    help=f"with --check-dropin: the factor of the perturbed run (default {DROPIN_PERTURBATION}; "
                         "another factor only prints, it writes nothing)")
    a = ap.parse_args(argv)
    src = a.slime_src.resolve()
    if not a.no_verify:
        verify_source(src)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(BASE_SEED)
    install_stubs(torch)
    sys.path.insert(0, str(src))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        from slime.backends.megatron_utils.loss import compute_advantages_and_returns
        from slime.utils.types import Sample

        for mod in ("slime.utils.ppo_utils", "slime.utils.distributed_utils", "slime.backends.megatron_utils.loss"):
            f = Path(sys.modules[mod].__file__).resolve()
            assert f.is_relative_to(src), f"{mod} was imported from {f}, not from {src}"
        post_process, _ = load_post_process_rewards(src, torch, Sample)

        if a.check_dropin:
            return check_dropin(torch, post_process, compute_advantages_and_returns, Sample, a.out,
                                a.dropin_perturbation)

        names = [c["name"] for c in CASES]
        assert len(set(names)) == len(names)
        cases = [run_case(torch, post_process, compute_advantages_and_returns, Sample, i, c) for i, c in enumerate(CASES)]
    finally:
        dist.destroy_process_group()

    doc = {
        "source": {
            "repo": SLIME_REPO,
            "commit": SLIME_COMMIT,
            "paths": SOURCE_PATHS,
            "how": HOW.format(torch_version=torch.__version__, seed=BASE_SEED),
            "generator": "tests/golden_slime/generate.py",
        },
        "cases": cases,
    }
    dump(doc, a.out)
    counts = {}
    for c in cases:
        counts[c["slime_estimator"]] = counts.get(c["slime_estimator"], 0) + 1
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes, {len(cases)} cases: {counts})")


if __name__ == "__main__":
    sys.exit(main())
