# `make demo`: set up .venv and train a small transformer on addition with GRPO through the service
# (`make demo-cartpole`: PPO on CartPole through the service's GAE).
# `make test`: set up .venv and run the test suite (what CI runs).
# `make lint`: only the deployment checks (hadolint, Kubernetes schemas, buf lint and breaking); `make test` runs them too.
VENV ?= .venv
PYTHON ?= python3
# tests/references/requirements.txt: the released references the differential tests run (installed --no-deps)
REFS := tests/references/requirements.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt $(REFS) | cksum | cut -d' ' -f1)
# The Node.js example's packages (the lockfile's exact versions), where npm exists.
NODE_EXAMPLE := examples/node
NODE_STAMP := $(if $(shell command -v npm 2>/dev/null),$(NODE_EXAMPLE)/node_modules/.installed)

.PHONY: demo demo-cartpole test lint proto setup clean

setup: $(STAMP) $(NODE_STAMP)

$(STAMP): pyproject.toml constraints.txt $(REFS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt -r $(REFS)
	rm -f $(VENV)/.installed-*
	touch $@

$(NODE_EXAMPLE)/node_modules/.installed: $(NODE_EXAMPLE)/package.json $(NODE_EXAMPLE)/package-lock.json
	cd $(NODE_EXAMPLE) && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

demo: $(STAMP)
	mkdir -p runs
	$(VENV)/bin/advantage-demo lm --csv runs/lm.csv --plot runs/lm.png

demo-cartpole: $(STAMP)
	mkdir -p runs
	$(VENV)/bin/advantage-demo cartpole --csv runs/cartpole.csv --plot runs/cartpole.png

test: $(STAMP) $(NODE_STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/test_deploy_docker.py tests/test_deploy_k8s.py tests/test_deploy_proto.py

proto: $(STAMP)
	$(VENV)/bin/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache $(NODE_EXAMPLE)/node_modules
