# syntax=docker/dockerfile:1
# Advantage service images (see docs/docker.md):
#   CPU:  docker build --target cpu -t advantage-service:cpu .
#   GPU:  docker build --target gpu -t advantage-service:gpu .   (run with --gpus all)
# Both run the `advantage-server` console script the tests start, as an unprivileged user (uid 10001):
#   50051 gRPC (advantage.v1, health, reflection; TLS/token when configured)
#   50052 gRPC health only, plaintext (HEALTHCHECK and kubelet probes)
#    9464 Prometheus metrics (GET /metrics; not 9090, Prometheus's own port)
# A CPU-only torch (cpu target; 1.5 GB instead of 5.5 GB, since PyPI's torch bundles CUDA): a CPU wheel of the
# pinned torch==2.13.0 is 2.13.0+cpu, which pip prefers over PyPI's 2.13.0 once it sees it. Either
#   --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu     (PyTorch's CPU wheel index), or
#   --build-arg PIP_FIND_LINKS=/wheels-host -v /opt/wheels:/wheels-host:ro   (podman: a local folder of wheels).
# A mirror: PIP_INDEX_URL. `make image-check TORCH=cpu` does the second on machines that hold such a wheel.
# numba kernels: compiled at build time into NUMBA_CACHE_DIR (/opt/advantage/numba-cache, outside /tmp so a
# Kubernetes emptyDir on /tmp does not hide it; read-only at run time: the server copies it to $TMPDIR once).
# numba keys the cache on the build machine's CPU: on another CPU model the server compiles at start instead
# (about 20 s, before health reports SERVING).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_CUDA_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# ---------------------------------------------------------------- build: one wheel for both targets
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY proto ./proto
COPY client ./client
COPY server ./server
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- the dependencies pyproject.toml declares
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; print(*tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
    > /requirements.txt

# ---------------------------------------------------------------- CPU dependencies in a virtualenv
# Only the dependencies (torch, numba, grpcio, ...): this stage and the copy of its venv into the image are
# built again only when constraints.txt or the dependency list change, not when the service's code does.
FROM ${PYTHON_IMAGE} AS cpu-venv
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY constraints.txt /tmp/constraints.txt
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install --no-cache-dir --constraint /tmp/constraints.txt --requirement /tmp/requirements.txt

# ---------------------------------------------------------------- CPU-only image
FROM ${PYTHON_IMAGE} AS cpu
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/opt/advantage/numba-cache
RUN groupadd --system --gid 10001 advantage \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin advantage
COPY --from=cpu-venv /opt/venv /opt/venv
# the service itself (its dependencies are all in the venv already: pip check says so)
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --disable-pip-version-check --no-deps /tmp/wheels/*.whl && pip check
# every kernel signature compiled into the image's cache (readable by the server's user)
RUN python -m advantage_server.warmup && chmod -R a+rX /opt/advantage/numba-cache
USER 10001:10001
EXPOSE 50051 50052 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["advantage-healthcheck", "--address", "127.0.0.1:50052"]
ENTRYPOINT ["advantage-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--health-port", "50052", "--metrics-port", "9464", "--metrics-host", "0.0.0.0", "--device", "cpu"]

# ---------------------------------------------------------------- GPU image (torch with CUDA from the base)
FROM ${TORCH_CUDA_IMAGE} AS gpu
ARG PIP_INDEX_URL
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 NUMBA_CACHE_DIR=/opt/advantage/numba-cache
COPY --from=build /wheels /wheels
# The base's torch satisfies torch>=2.4; pip adds grpcio, protobuf, numpy and prometheus-client.
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && groupadd --system --gid 10001 advantage \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin advantage
# every kernel signature compiled into the image's cache (CPU kernels: no GPU needed at build time)
RUN python -m advantage_server.warmup && chmod -R a+rX /opt/advantage/numba-cache
USER 10001:10001
EXPOSE 50051 50052 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["advantage-healthcheck", "--address", "127.0.0.1:50052"]
ENTRYPOINT ["advantage-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--health-port", "50052", "--metrics-port", "9464", "--metrics-host", "0.0.0.0", "--device", "auto"]
