"""tests/installed/ runs in the frameworks' own venvs (`make test-frameworks`), not in the project's .venv: where
this interpreter cannot hold the framework (SkyRL 0.4.0 needs Python >= 3.12), `make test` does not collect it."""
import sys

collect_ignore = ["test_skyrl_installed.py"] if sys.version_info < (3, 12) else []
