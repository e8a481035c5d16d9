"""The releases each ``semantics`` value reproduces: the one place that names them.

``ListEstimators`` reports them (``ListEstimatorsResponse.references``), the estimator table in docs/estimators.md
and the ``.proto`` comments name the same releases, and the differential tests
(``tests/test_diff_*.py``) install exactly these pins (``tests/references/requirements.txt``; a test
checks that the file and the installed packages agree with this module).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reference:
    """One public reference implementation.

    semantics: the ``Semantics`` enum's short name (``"verl"``).
    project:   the project's own name (``"verl"``).
    release:   the release reproduced: a PyPI version (``"0.9.1"``), or ``"main@<commit>"`` where the
               project publishes no release containing the estimators (NeMo RL, verl-agent, ROLL, slime,
               prime-rl).
    package:   the PyPI distribution the differential tests install, or ``None`` (NeMo RL: golden vectors
               produced at ``release``, ``tests/golden/nemo-rl``; verl-agent and ROLL: golden cases
               in ``tests/golden_gigpo`` and, for its RLVR step, ``tests/golden_roll``; slime: golden cases in
               ``tests/golden_slime``, made by its generator; prime-rl: golden cases in ``tests/golden_prime_rl``,
               made by its generator).
    code:      where the reproduced estimators live in that release.
    """

    semantics: str
    project: str
    release: str
    package: str | None
    code: str

    @property
    def pin(self) -> str | None:
        """The pip requirement of the release (``"verl==0.9.1"``), or ``None`` where none is published."""
        return f"{self.package}=={self.release}" if self.package else None

    @property
    def label(self) -> str:
        """``"verl 0.9.1"`` / ``"NeMo RL main@7ea279a"``: how docs/ and ListEstimators name it."""
        release = self.release if self.package else self.release[: len("main@") + 7]
        return f"{self.project} {release}"


#: semantics short name -> the release it reproduces, in the ``Semantics`` enum's order
REFERENCES: dict[str, Reference] = {r.semantics: r for r in (
    Reference("nemo_rl", "NeMo RL", "main@7ea279abfbeb698b092856d0dab61e7cf39bc909", None,
              "nemo_rl/algorithms/advantage_estimator.py"),
    Reference("verl", "verl", "0.9.1", "verl", "verl/trainer/ppo/core_algos.py"),
    Reference("openrlhf", "OpenRLHF", "0.11.2", "openrlhf", "openrlhf/trainer/ppo_utils/experience_maker.py"),
    Reference("trl", "TRL", "1.16.0", "trl", "trl/trainer/grpo_trainer.py"),
    Reference("verl_agent", "verl-agent", "main@29e3e8b3e3412aff53b1e4a461dac77a8eec19bd", None,
              "gigpo/core_gigpo.py"),
    Reference("trinity", "Trinity-RFT", "0.6.0", "trinity-rft", "trinity/algorithm/advantage_fn/gigpo_advantage.py"),
    # gigpo: roll/pipeline/agentic/utils.py; the RLVR step (grpo, reinforce_plus_plus, gae): roll/utils/functionals.py
    Reference("roll", "ROLL", "main@8eb27cc2dc34c4d1310b169d9b86d339004d811a", None, "roll/pipeline/agentic/utils.py"),
    Reference("skyrl", "SkyRL", "0.4.0", "skyrl", "skyrl/backends/skyrl_train/utils/ppo_utils.py"),
    Reference("areal", "AReaL", "1.0.4", "areal", "areal/trainer/ppo/actor.py"),
    Reference("slime", "slime", "main@624b824a898ab0ec1fcb4d373004c7f3852bf515", None,
              "slime/backends/megatron_utils/loss.py"),
    Reference("prime_rl", "prime-rl", "main@559b44772e471d1538537b8805cc77f3824a5e64", None,
              "src/prime_rl/orchestrator/algo/grpo.py"),
)}

#: the ``Semantics`` enum's short names
SEMANTICS = tuple(REFERENCES)
