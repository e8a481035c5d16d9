"""SkyRL 0.4.0's ppo_utils with the real Ray, for the SkyRL plugin's Ray test (test-only).

tests/references/skyrl_ref.py stands in for ``ray`` (``is_initialized`` False) so that SkyRL's
``AdvantageEstimatorRegistry`` stays in one process, as SkyRL's own unit tests run it. Here the registry must be
SkyRL's as deployed: backed by its named Ray actor (``RegistryActor``, ``advantage_estimator_registry``), which
SkyRL creates on the first ``register`` with Ray initialised and from which a worker's ``get`` loads what the
driver registered. :func:`load` imports the same released file with skyrl_ref's other stand-ins (SkyRL's package
``__init__``s, ``skyrl.train.config``, jaxtyping and loguru where not installed) and the real, initialised ray.

One thing differs from a SkyRL installation: SkyRL's package ``__init__``s cannot run here (they import SkyRL's
whole stack, which needs Python 3.12 packages), so ``skyrl`` cannot be imported by name in another process.
Ray and cloudpickle pickle a class or function by reference when its module can be imported by name, and the
registry actor's class and SkyRL's built-in estimators would then fail to load in the actor's process. So
``skyrl`` is registered with both picklers as pickled by value (``register_pickle_by_value``) while the file
imports, and its modules are out of ``sys.modules`` afterwards (as skyrl_ref leaves them), so that later pickles
go by value too. Nothing of the advantage code or the registry's logic is replaced.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

from references import skyrl_ref
from references.stubs import import_released

__all__ = ["load"]

OWNER = "tests/references/skyrl_ray_ref.py"


def load() -> types.ModuleType:
    """A fresh import of SkyRL's ``ppo_utils`` with the real ray (initialised by the caller: the registry creates
    or finds its actor while the module registers its built-in estimators). Raises ``ImportError`` where skyrl is
    not installed."""
    import cloudpickle
    import ray
    import ray.cloudpickle

    spec = importlib.util.find_spec("skyrl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("skyrl is not installed: run `make setup` (it installs tests/references/requirements.txt)")
    assert ray.is_initialized(), "skyrl_ray_ref.load() needs ray.init() first"

    def by_value() -> None:
        for pickler in (ray.cloudpickle, cloudpickle):
            pickler.register_pickle_by_value(sys.modules["skyrl"])

    stubs = {name: attrs for name, attrs in skyrl_ref.STUBS.items() if name.split(".")[0] != "ray"}
    return import_released(skyrl_ref.TARGET, pathlib.Path(list(spec.submodule_search_locations)[0]),
                           skyrl_ref.PACKAGES, stubs, skyrl_ref._OPTIONAL, [], OWNER, prepare=by_value)
