# `make demo`: set up .venv and train PPO on CartPole through the service.
# `make test`: set up .venv and run the test suite (what CI runs).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test proto setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/advantage-demo cartpole

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

proto: $(STAMP)
	$(VENV)/bin/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache
