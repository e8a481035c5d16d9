"""Where the verl golden vectors (``tests/golden/verl``, generated at an older verl commit, named in each
case's ``source``) no longer describe the pinned release (verl 0.9.1, ``advantage_client.references``).

The golden tests (tests/test_golden_verl.py, tests/test_estimators_refs.py) ask :func:`changed_in_release`
for each case: where it returns a reason, the case is the older verl's answer, so the plain-client paths
run it with the service option that reproduces that older verl, and the verl drop-in path (which
reproduces 0.9.1 only) skips it with the reason. tests/test_diff_verl.py checks the release itself.
"""
from __future__ import annotations

import torch

from advantage_server.estimators.reinforce_plus_plus import verl_returns_loop

#: service config that reproduces the golden's older verl, per estimator whose semantics changed
OLDER_VERL_CONFIG = {"reinforce_plus_plus": {"reset_returns_at_holes": True}}


def changed_in_release(case: dict) -> str | None:
    """Why verl 0.9.1 computes this golden case differently from the verl that produced it, or None.

    reinforce_plus_plus: verl PR #7300 (in 0.9) carries the running return across mask = 0 positions and
    zeroes the returns there; older verl reset it. Decided on the case's own inputs by the two recursions'
    loop twins (test oracles): changed exactly where they differ.
    """
    if case["estimator"] != "reinforce_plus_plus":
        return None
    inputs = case["inputs"]
    rewards = torch.tensor(inputs["token_level_rewards"], dtype=torch.float64)
    mask = torch.tensor(inputs["response_mask"], dtype=torch.float64)
    gamma = float(case["config"]["gamma"])
    old = verl_returns_loop(rewards, mask, gamma, reset_at_holes=True)
    new = verl_returns_loop(rewards, mask, gamma, reset_at_holes=False)
    if torch.equal(old, new):
        return None
    return (f"{case['id']}: generated at {case.get('source', 'an older verl')}, which resets REINFORCE++'s "
            "return at mask holes; verl 0.9.1 carries it across them (PR #7300)")
