# `make demo`: set up .venv (the demo's dependencies only) and train a small transformer on addition with GRPO through the service
# (`make demo-cartpole`: PPO on CartPole through the service's GAE).
# `make test`: set up .venv and run the test suite (what CI runs).
# `make lint`: only the deployment checks (hadolint, Kubernetes schemas, buf lint and breaking); `make test` runs them too.
# `make image-check`: build the cpu image (docker, or podman here) and check that it serves (TORCH=cpu: CPU-only torch).
VENV ?= .venv
PYTHON ?= python3
# tests/references/requirements.txt: the released references the differential tests run (installed --no-deps)
REFS := tests/references/requirements.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt $(REFS) | cksum | cut -d' ' -f1)
# `make demo` installs only what the demos run: the service's own dependencies and the `demo` extra (not the
# test extra's Ray, buf, hadolint, kubernetes-validate and reference packages)
DEMO_STAMP := $(VENV)/.demo-installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
# The Node.js example's packages (the lockfile's exact versions), where npm exists.
NODE_EXAMPLE := examples/node
NODE_STAMP := $(if $(shell command -v npm 2>/dev/null),$(NODE_EXAMPLE)/node_modules/.installed)

.PHONY: demo demo-cartpole test test-frameworks lint proto setup clean

setup: $(STAMP) $(NODE_STAMP)

$(STAMP): pyproject.toml constraints.txt $(REFS)
	@echo "make: installing the service and its test tools into $(VENV) (torch, numba, grpcio, Ray, buf, hadolint,"
	@echo "make: kubernetes-validate, the reference packages and TRL's training stack (transformers, accelerate, datasets): about 2.4 GB with a CPU-only torch, 3-5 min)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	# --ignore-requires-python: skyrl 0.4.0 declares Python >= 3.12; its advantage code runs on 3.11 (tests/references/skyrl_ref.py)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python -c constraints.txt -r $(REFS)
	rm -f $(VENV)/.installed-*
	touch $@

$(NODE_EXAMPLE)/node_modules/.installed: $(NODE_EXAMPLE)/package.json $(NODE_EXAMPLE)/package-lock.json
	cd $(NODE_EXAMPLE) && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

$(DEMO_STAMP): pyproject.toml constraints.txt
	@echo "make: installing the service and the demo extra into $(VENV) (torch, numba, grpcio, gymnasium, matplotlib:"
	@echo "make: about 1.3 GB and 1-2 min with a CPU-only torch; a torch that bundles CUDA adds several GB)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[demo]'
	rm -f $(VENV)/.demo-installed-*
	touch $@

demo: $(DEMO_STAMP)
	mkdir -p runs
	$(VENV)/bin/advantage-demo lm --csv runs/lm.csv --plot runs/lm.png

demo-cartpole: $(DEMO_STAMP)
	mkdir -p runs
	$(VENV)/bin/advantage-demo cartpole --csv runs/cartpole.csv --plot runs/cartpole.png

# Three pytest-xdist workers, each module whole on one of them (--dist loadfile: a module's servers, clusters and
# network namespace stay its own, and its tests run in order). On the 2-core machine: 10 min 51 s with 3 workers,
# 11 min 41 s to 12 min with 2, 18 min 51 s in one process (the suite waits on sockets, sleeps and subprocesses
# about a third of the time). The suite passes beside a busy loop on both cores as well (docs/development.md).
# `make test PYTEST_WORKERS=0` runs everything in one process.
PYTEST_WORKERS ?= 3
test: $(STAMP) $(NODE_STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(VENV)/bin/python -m pytest -q $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)

# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: every Ray cluster the tests start stays on 127.0.0.1 (tests/conftest.py).
# `make test-frameworks` (issue #28): the frameworks as their users install them, each in its own venv built from
# tests/installed/requirements-*.txt with the framework's declared dependencies (cached by a stamp like .venv).
# SkyRL 0.4.0 needs Python 3.12 (PYTHON312; pyenv's 3.12 where it exists), AReaL 1.0.4 3.11 or 3.12 (3.12 here).
# The server runs from .venv.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
SKYRL_VENV := .venv-skyrl
SKYRL_STAMP := $(SKYRL_VENV)/.installed-$(shell cat tests/installed/requirements-skyrl.txt client/pyproject.toml | cksum | cut -d' ' -f1)

$(SKYRL_STAMP): tests/installed/requirements-skyrl.txt client/pyproject.toml
	@echo "make: installing skyrl==0.4.0 with its dependencies and Ray into $(SKYRL_VENV) (Python 3.12; PyPI's torch bundles CUDA: several GB)"
	$(PYTHON312) -m venv $(SKYRL_VENV)
	$(SKYRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r tests/installed/requirements-skyrl.txt
	rm -f $(SKYRL_VENV)/.installed-*
	touch $@

AREAL_VENV := .venv-areal
AREAL_STAMP := $(AREAL_VENV)/.installed-$(shell cat tests/installed/requirements-areal.txt tests/installed/constraints-areal.txt client/pyproject.toml | cksum | cut -d' ' -f1)

# Two pip calls: AReaL with its declared dependencies (versions from constraints-areal.txt), then the client, whose
# protobuf >= 7.35.1 one pip call cannot put beside AReaL's swanlab 0.6.12 (protobuf < 7): pip upgrades protobuf
# and prints that swanlab's requirement is unmet (requirements-areal.txt says why that is left so).
$(AREAL_STAMP): tests/installed/requirements-areal.txt tests/installed/constraints-areal.txt client/pyproject.toml
	@echo "make: installing areal==1.0.4 with its dependencies into $(AREAL_VENV) (Python 3.12; about 300 packages, PyPI's torch 2.10 bundles CUDA: several GB)"
	$(PYTHON312) -m venv $(AREAL_VENV)
	$(AREAL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r tests/installed/requirements-areal.txt -c tests/installed/constraints-areal.txt
	@echo "make: installing the client beside AReaL: pip will print \"ERROR: pip's dependency resolver ... swanlab ... protobuf\"; expected (swanlab 0.6.12 pins protobuf < 7, the client needs >= 7.35.1; AReaL's code we test does not use swanlab) and not a failure"
	$(AREAL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e ./client
	rm -f $(AREAL_VENV)/.installed-*
	touch $@

test-frameworks: $(STAMP) $(SKYRL_STAMP) $(AREAL_STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(SKYRL_VENV)/bin/python -m pytest -q -s -p no:cacheprovider --confcutdir=tests/installed tests/installed/test_skyrl_installed.py
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(AREAL_VENV)/bin/python -m pytest -q -s -p no:cacheprovider --confcutdir=tests/installed tests/installed/test_areal_installed.py tests/installed/test_areal_launch.py

lint: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/test_deploy_docker.py tests/test_deploy_k8s.py tests/test_deploy_proto.py

proto: $(STAMP)
	$(VENV)/bin/python scripts/gen_proto.py

# `make image-check` (issue #29): build the Dockerfile's cpu target and check from the host that it serves (a golden
# call per NeMo RL case, /metrics, uid 10001, the HEALTHCHECK, SIGTERM drains a call in flight and exits 0) and how
# many seconds `run` takes to SERVING (scripts/image_check.py says how). The engine: docker where `docker info`
# answers, else podman with ../shared/tools/container (no registry is reachable on the project's machines).
# TORCH=cpu: a CPU-only torch (1.5 GB image, not 5.5 GB: PyPI's torch bundles CUDA). Not in `make test`: cold, 8 min
# to build (3.5 min with TORCH=cpu) and 1-2 min to check on 2 busy cores; after a code change ~2 min (docs/docker.md).
# `make image`: the build only. IMAGE_ENGINE=docker|podman picks the engine; IMAGE_CHECK_ARGS passes more flags.
IMAGE_ENGINE ?= auto
TORCH ?= pypi
IMAGE_CHECK_ARGS ?=
.PHONY: image image-check
image: $(STAMP)
	$(VENV)/bin/python scripts/image_check.py --engine $(IMAGE_ENGINE) --torch $(TORCH) --build-only $(IMAGE_CHECK_ARGS)

image-check: $(STAMP)
	$(VENV)/bin/python scripts/image_check.py --engine $(IMAGE_ENGINE) --torch $(TORCH) $(IMAGE_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(SKYRL_VENV) $(AREAL_VENV) .pytest_cache $(NODE_EXAMPLE)/node_modules
