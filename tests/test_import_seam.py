"""The seam between the client and the server distributions, read from the source (no module is imported).

Every ``import`` statement of every module under ``client/advantage_client`` and ``server/advantage_server`` is
parsed with ``ast``, those inside functions and methods included (a lazy import is still a dependency), and:

* no module imports another that (directly or through others) imports it back: no cycle among them;
* the server uses the client's public modules only: no ``advantage_client`` module whose dotted name has a
  part starting with ``_`` (``advantage_client._proto...``: use ``advantage_client.proto``), no private name
  imported from one, no private attribute of one (``wire._NP``);
* the client never imports the server (``advantage-client`` is installed without it).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"advantage_client": ROOT / "client" / "advantage_client",
            "advantage_server": ROOT / "server" / "advantage_server"}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    names: tuple[str, ...] = ()  # names imported from ``target`` (``from target import a, b``)


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``), for both packages."""
    out = {}
    for root in PACKAGES.values():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.attr`` -> ``a.b``), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _edges(module: str, source_text: str | None = None) -> list[Edge]:
    path, is_pkg = MODULES[module]
    package = module if is_pkg else module.rpartition(".")[0]
    text = path.read_text() if source_text is None else source_text
    edges = []
    for node in ast.walk(ast.parse(text, str(path))):  # every statement, at any depth
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name)
                if target:
                    edges.append(Edge(module, target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from ..y import z
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            plain = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:  # from pkg import submodule
                    edges.append(Edge(module, sub, node.lineno))
                else:
                    plain.append(alias.name)
            target = _known(source)
            if target and plain:
                edges.append(Edge(module, target, node.lineno, tuple(plain)))
    return [e for e in edges if e.target != module]


EDGES = {m: _edges(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {m: sorted({e.target for e in EDGES[m]}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")[1:])


def test_the_scan_sees_both_packages_and_lazy_imports():
    assert "advantage_client.client" in MODULES and "advantage_server.server" in MODULES
    assert "advantage_client._proto.advantage.v1.advantage_pb2" in MODULES
    # imports inside functions and methods count like top-level ones; relative imports are resolved
    src = ("import os\n"
           "def f():\n    from advantage_client import wire, AdvantageClient\n"
           "class C:\n    def m(self):\n        import advantage_client._proto.advantage.v1.advantage_pb2 as pb\n"
           "        from .errors import InvalidInput\n")
    got = {(e.target, e.names) for e in _edges("advantage_server.server", src)}
    assert got == {("advantage_client.wire", ()), ("advantage_client", ("AdvantageClient",)),
                   ("advantage_client._proto.advantage.v1.advantage_pb2", ()),
                   ("advantage_server.errors", ("InvalidInput",))}
    assert any(e.target == "advantage_client.streaming" for e in EDGES["advantage_client.client"])


def test_no_import_cycles():
    cycles = _cycles()
    detail = []
    for component in cycles:
        members = set(component)
        detail += [f"{e.source}:{e.line} imports {e.target}" for m in component for e in EDGES[m]
                   if e.target in members]
    assert not cycles, "modules that import each other (move the shared code to the module that owns it):\n" + \
        "\n".join(detail)


def test_server_uses_only_public_client_modules():
    bad = []
    for module, edges in EDGES.items():
        if not module.startswith("advantage_server"):
            continue
        for e in edges:
            if not e.target.startswith("advantage_client"):
                continue
            if _private(e.target):
                bad.append(f"{module}:{e.line} imports {e.target}")
            bad += [f"{module}:{e.line} imports {e.target}.{n}" for n in e.names
                    if n.startswith("_") and not n.startswith("__")]
        # a private attribute of an imported client module: ``wire._NP``
        path, _ = MODULES[module]
        tree = ast.parse(path.read_text(), str(path))
        bound = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("advantage_client"):
                bound |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
            elif isinstance(node, ast.Import):
                bound |= {a.asname for a in node.names if a.asname and a.name in MODULES
                          and a.name.startswith("advantage_client")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "the server reaches into the client's private parts (use advantage_client.proto, or give " \
                    "the helper a public name in its module):\n" + "\n".join(bad)


def test_client_never_imports_the_server():
    bad = [f"{e.source}:{e.line} imports {e.target}" for m, edges in EDGES.items() if m.startswith("advantage_client")
           for e in edges if e.target.startswith("advantage_server")]
    assert not bad, "\n".join(bad)
    # nor by name in a string (importlib.import_module("advantage_server..."))
    for root in (PACKAGES["advantage_client"],):
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                        "import_module", "__import__"):
                    for arg in node.args[:1]:
                        if isinstance(arg, ast.Constant) and str(arg.value).startswith("advantage_server"):
                            pytest.fail(f"{path}:{node.lineno} imports {arg.value}")


def test_the_public_proto_module_is_the_generated_one():
    from advantage_client import proto
    from advantage_client._proto.advantage.v1 import advantage_pb2, advantage_pb2_grpc

    assert proto.advantage_pb2 is advantage_pb2 and proto.advantage_pb2_grpc is advantage_pb2_grpc
