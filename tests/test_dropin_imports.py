"""A drop-in used where its framework does not import says what is missing and where to call it (newcomer
findings, 2026-12-06: each was a bare ModuleNotFoundError or FileNotFoundError traceback). In this venv ROLL and
prime-rl are not installed, and AReaL is not importable (tests/installed/ runs it in its own venv)."""
from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("roll") is not None, reason="ROLL is installed here")
def test_roll_install_without_roll_names_both_pipeline_modules():
    from advantage_client import roll

    with pytest.raises(ImportError) as err:
        roll.install()
    message = str(err.value)
    assert roll.PIPELINE_MODULE in message and roll.AGENTIC_PIPELINE_MODULE in message
    assert "install(module=...)" in message and "'roll'" in message


@pytest.mark.skipif(importlib.util.find_spec("prime_rl") is not None, reason="prime-rl is installed here")
def test_prime_rl_install_without_prime_rl_says_where_to_run_it():
    from advantage_client import prime_rl

    with pytest.raises(ImportError, match=r"'prime_rl' does not import: run it in prime-rl's own environment"):
        prime_rl.install()


def test_areal_launcher_refuses_a_missing_script_and_install_names_what_to_install(tmp_path, monkeypatch):
    from advantage_client import areal

    with pytest.raises(SystemExit, match="no script 'nope.py'"):
        areal.main(["nope.py"])
    try:
        import areal.trainer.rl_trainer  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="AReaL|areal"):
            areal.install()
    else:
        pytest.skip("AReaL imports here")
    script = tmp_path / "s.py"
    script.write_text("")
    monkeypatch.delenv("ADVANTAGE_SERVICE_TARGET", raising=False)
    with pytest.warns(UserWarning, match=r"\$ADVANTAGE_SERVICE_TARGET is not set"), pytest.raises(ImportError):
        areal.main([str(script)])
