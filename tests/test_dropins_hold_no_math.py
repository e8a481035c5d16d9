"""Issue #36: a drop-in translates, the service computes. No module under ``advantage_client/`` named for a framework
computes advantages or returns; what math they hold is layout, dtype and field mapping, or a framework's logging
field, each listed here with why.

The check reads each module's syntax tree: every call of a numeric reduction, normalisation or elementwise function
(:data:`MATH`: ``mean``, ``std``, ``cumsum``, ``rsqrt``, ``clamp``, ``where`` ...) and every true division or power
(``/``, ``**``), by the function it sits in. Each must be in :data:`ALLOWED` for that module and function, so math
that enters a drop-in (as ``gae``'s batch whitening and ``no_std_norm`` once did in the OpenRLHF drop-in, computed in
float64 beside the service) fails here until the service computes it or the exception is argued below."""
from __future__ import annotations

import ast
import pathlib

import pytest

CLIENT = pathlib.Path(__file__).resolve().parent.parent / "client" / "advantage_client"
FRAMEWORKS = ("openrlhf", "verl", "trl", "skyrl", "areal", "nemo", "slime", "roll", "prime_rl")
MATH = {"mean", "std", "var", "cumsum", "cumprod", "rsqrt", "sqrt", "exp", "log", "clamp", "clip", "nansum", "nanmean",
        "nanstd", "softmax", "log_softmax", "logsumexp", "flip", "sum", "abs", "where", "pow", "square", "div", "sub",
        "mul", "expm1", "log1p", "whiten", "normalize", "max", "min", "prod", "reciprocal"}
#: module -> function -> the math names it may use, and why (none of them feeds an advantage or a return)
ALLOWED: dict[str, dict[str, tuple[set[str], str]]] = {
    "openrlhf": {"_compute": ({"std", "sum", "clamp", "where", "max"},
                              "logging fields OpenRLHF writes beside the advantages (info['group_reward_std'], "
                              "info['return']) and the padded width (max)")},
    "verl": {"_gdpo_components": ({"sum"}, "a token-level reward [B, T] summed to the score verl's GDPO reads (input)")},
    "trl": {"weighted_rewards": ({"nansum"}, "TRL's weighted sum of its reward functions: the reward sent (input)")},
    "areal": {"areal_advantages": ({"clip", "sum", "where"},
                                   "AReaL's data['rewards'] field: the service's token rewards placed at seqlen - 2, "
                                   "as AReaL lays it out (layout)")},
    "nemo": {"one_edit_apart": ({"abs"}, "a config key spelling check (not numbers of a batch)"),
             "warn_unapplied": ({"add"}, "a set of unapplied option names (not numbers of a batch)")},
    "skyrl": {},
    "slime": {},
    "roll": {},
    "prime_rl": {},
}


def math_in(path: pathlib.Path) -> dict[str, set[str]]:
    """{function name: math names and operators used in it} of the module at ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    spans = sorted(((n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), key=lambda s: s[1] - s[0])

    def where(line: int) -> str:
        return next((name for a, b, name in spans if a <= line <= b), "<module>")

    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            name = name if name in MATH else None
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Pow)):
            name = "/" if isinstance(node.op, ast.Div) else "**"
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Div, ast.Pow)):
            name = "/=" if isinstance(node.op, ast.Div) else "**="
        if name is not None:
            out.setdefault(where(node.lineno), set()).add(name)
    return out


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_module_holds_no_advantage_math(framework):
    found = math_in(CLIENT / f"{framework}.py")
    allowed = ALLOWED[framework]
    extra = {fn: sorted(names - allowed.get(fn, (set(), ""))[0]) for fn, names in found.items()}
    extra = {fn: names for fn, names in extra.items() if names}
    assert not extra, (f"advantage_client/{framework}.py computes {extra}: the service computes advantages and "
                       "returns (add the option to its estimator), a drop-in only translates")


def test_the_check_sees_math():
    """The scan is not vacuous: the OpenRLHF drop-in's former client-side batch whitening is caught."""
    import tempfile
    code = ("def _whiten(x, mask, no_std_norm):\n    mean = (x * mask).sum() / mask.sum()\n"
            "    var = ((x - mean).pow(2) * mask).sum() / mask.sum()\n    return (x - mean) * var.clamp(min=1e-8).rsqrt()\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    found = math_in(pathlib.Path(f.name))
    assert found == {"_whiten": {"sum", "/", "pow", "clamp", "rsqrt"}}, found
