"""The checked-in stubs in client/advantage_client/_proto are exactly what scripts/gen_proto.py generates
from proto/advantage/v1/advantage.proto (so nobody edits the .proto and forgets to regenerate)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) generates the stubs")
pytest.importorskip("mypy_protobuf", reason="mypy-protobuf (the dev extra) generates the typed stubs")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED_IN = ROOT / "client" / "advantage_client" / "_proto"
FIX = "the generated stubs are stale: run `python scripts/gen_proto.py` and commit client/advantage_client/_proto"


def generate(script: pathlib.Path, out: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"gen_proto.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def stub_files(root: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".pyi")}


def differences(generated: pathlib.Path, checked_in: pathlib.Path) -> list[str]:
    fresh, current = stub_files(generated), stub_files(checked_in)
    problems = [f"missing from {checked_in.name}/: {name}" for name in sorted(set(fresh) - set(current))]
    problems += [f"not generated (left over?): {name}" for name in sorted(set(current) - set(fresh))]
    problems += [f"differs: {name}" for name in sorted(set(fresh) & set(current)) if fresh[name] != current[name]]
    return problems


def test_generated_stubs_are_up_to_date(tmp_path):
    out = tmp_path / "_proto"
    generate(ROOT / "scripts" / "gen_proto.py", out)
    assert (out / "advantage" / "v1" / "advantage_pb2.py").is_file()
    problems = differences(out, CHECKED_IN)
    assert not problems, FIX + ":\n  " + "\n  ".join(problems)


def test_staleness_is_detected_when_the_proto_changes(tmp_path):
    """Generating from a modified copy of the .proto (the real one untouched) must differ."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "proto", copy / "proto")
    (copy / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "gen_proto.py", copy / "scripts" / "gen_proto.py")
    proto = copy / "proto" / "advantage" / "v1" / "advantage.proto"
    text = proto.read_text()
    assert "message OPDConfig {}" in text
    proto.write_text(text.replace("message OPDConfig {}", "message OPDConfig {\n  optional bool extra = 1;\n}"))
    out = tmp_path / "_proto"
    generate(copy / "scripts" / "gen_proto.py", out)
    problems = differences(out, CHECKED_IN)
    assert "differs: advantage/v1/advantage_pb2.py" in problems, problems
    assert "differs: advantage/v1/advantage_pb2.pyi" in problems, problems
    assert (ROOT / "proto" / "advantage" / "v1" / "advantage.proto").read_text().count("message OPDConfig {}") == 1


def test_generated_modules_import_from_the_package(tmp_path):
    """The stubs import each other through advantage_client._proto, not a top-level `advantage` package."""
    text = (CHECKED_IN / "advantage" / "v1" / "advantage_pb2_grpc.py").read_text()
    assert "from advantage_client._proto.advantage.v1 import advantage_pb2" in text
    assert "\nfrom advantage.v1 import" not in text
