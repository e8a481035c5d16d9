"""The server process's opt-in malloc settings (advantage_server.tuning): off by default, applied on import
with ADVANTAGE_MALLOC_TUNING=1, explicit glibc settings win."""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = ("import json, os, advantage_server; from advantage_server import tuning; "
         "print(json.dumps({'thp': os.environ.get('THP_MEM_ALLOC_ENABLE'), 'applied': tuning.APPLIED, "
         "'describe': tuning.describe()}))")


def glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError, AttributeError):
        return False


def probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("THP_MEM_ALLOC_ENABLE", "ADVANTAGE_MALLOC_TUNING", "MALLOC_TRIM_THRESHOLD_",
                         "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_off_by_default():
    got = probe()
    assert got["thp"] is None and got["applied"] == {}  # transparent huge pages stay opt-in too
    assert "glibc malloc defaults" in got["describe"]


def test_switched_on():
    got = probe(ADVANTAGE_MALLOC_TUNING="1")
    assert got["thp"] is None
    if glibc():
        assert got["applied"] == {"malloc mmap_threshold": str(32 << 20), "malloc trim_threshold": str(256 << 20)}


def test_explicit_settings_win():
    got = probe(ADVANTAGE_MALLOC_TUNING="1", THP_MEM_ALLOC_ENABLE="1", MALLOC_TRIM_THRESHOLD_="1048576")
    assert got["thp"] == "1"
    assert "malloc trim_threshold" not in got["applied"]
    if glibc():
        assert "malloc mmap_threshold" in got["applied"]
    assert "trim_threshold=1048576" in got["describe"] and "THP_MEM_ALLOC_ENABLE=1" in got["describe"]
