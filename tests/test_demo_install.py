"""`make demo` installs only what the demos need: the service's own dependencies and the `demo` extra.

The demos must run without anything only the test extra brings (Ray, buf, hadolint, kubernetes-validate,
pytest, the reference packages): the test runs both demos' code paths in a subprocess in which every module
of a test-only distribution is made unimportable.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import pathlib
import re
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].strip().lower().replace("_", "-") for r in requirements}


def _closure(names: set[str]) -> set[str]:
    """The installed distributions ``names`` need, their dependencies included."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [n for n in _names([r for r in requires if "extra ==" not in r])]
    return seen


def _test_only_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    demo = _closure(_names(project["dependencies"]) | _names(extras["demo"]))
    refs = [line for line in (ROOT / "tests/references/requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return _closure(_names(extras["test"]) | _names(refs)) - demo


def _demo_site(into: pathlib.Path) -> set[str]:
    """A site directory of links to everything installed except the test-only distributions' files, as if only
    the service and the demo extra were installed; returns the top-level names left out."""
    test_only = _test_only_distributions()
    site = pathlib.Path(md.distribution("numpy").locate_file(""))
    owned = set()
    for dist in md.distributions():
        if dist.metadata["Name"].lower().replace("_", "-") in test_only:
            owned |= {pathlib.PurePath(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    into.mkdir()
    for entry in site.iterdir():
        if entry.name not in owned and not entry.name.endswith(".pth") and entry.name != "__pycache__":
            (into / entry.name).symlink_to(entry)
    return {name.split(".")[0].split("-")[0] for name in owned}


def test_the_demo_target_installs_the_demo_extra_only():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(DEMO_STAMP): ", 1)[1].split("\n\n", 1)[0]
    assert "-e '.[demo]'" in recipe and "[test]" not in recipe and "$(REFS)" not in recipe
    for target in ("demo", "demo-cartpole"):
        assert re.search(rf"^{target}: \$\(DEMO_STAMP\)$", makefile, re.M), target


def test_the_demos_run_without_the_test_extra(tmp_path):
    left_out = _demo_site(tmp_path / "site")
    # the test extra really brings these, so the check is not vacuous; the demo's own packages stay
    assert {"ray", "pytest", "hypothesis", "kubernetes_validate"} <= left_out
    assert not left_out & {"torch", "numba", "grpc", "numpy", "gymnasium", "matplotlib"}
    script = f"""
import sys
sys.path[:0] = [{str(tmp_path / "site")!r}, {str(ROOT / "client")!r}, {str(ROOT / "server")!r}]
from advantage_server.demo import main
for name in ("ray", "pytest", "hypothesis", "kubernetes_validate"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{{name}} is still importable: the check would prove nothing")
main(["cartpole", "--total-steps", "2048", "--csv", {str(tmp_path / "c.csv")!r}, "--plot", {str(tmp_path / "c.png")!r}])
main(["lm", "--max-steps", "1", "--warm-accuracy", "0.0", "--csv", {str(tmp_path / "lm.csv")!r},
      "--plot", {str(tmp_path / "lm.png")!r}])
"""
    proc = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("c.csv", "c.png", "lm.csv", "lm.png"):
        assert (tmp_path / name).stat().st_size > 0, name
