"""Generate the Python stubs for ``proto/advantage/v1/advantage.proto``.

    python scripts/gen_proto.py            # write into client/advantage_client/_proto/
    python scripts/gen_proto.py --out DIR  # write elsewhere (the staleness test does this)

Runs protoc from grpcio-tools with the mypy-protobuf plugins, which write the typed
stubs (``advantage_pb2.pyi``, ``advantage_pb2_grpc.pyi``, with the .proto comments as
docstrings) shipped with the client (``pip install -e '.[dev]'`` installs both, at the
versions constraints.txt pins). The generated modules import each other as
``advantage.v1.*``; they are rewritten to import from ``advantage_client._proto.advantage.v1``
so the stubs live inside the package.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ["advantage/v1/advantage.proto"]
DEFAULT_OUT = ROOT / "client" / "advantage_client" / "_proto"
PACKAGE = "advantage_client._proto"


def plugin(name: str) -> str:
    """Path of the protoc plugin executable ``name`` (installed beside this Python, or on PATH)."""
    here = pathlib.Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install -c constraints.txt mypy-protobuf (the dev extra)")
    return found


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc  # dev dependency

    import grpc_tools

    out.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(p for p in out.rglob("*.py*") if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts):
        text = path.read_text()
        fixed = re.sub(r"^from advantage\.v1 import", f"from {PACKAGE}.advantage.v1 import", text, flags=re.M)
        path.write_text(fixed)
        written.append(path)
    for pkg in [out, out / "advantage", out / "advantage" / "v1"]:
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
            written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
