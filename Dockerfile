# syntax=docker/dockerfile:1
# Advantage service images (see README "Docker"):
#   CPU:  docker build --target cpu -t advantage-service:cpu .
#   GPU:  docker build --target gpu -t advantage-service:gpu .   (run with --gpus all)
# Both run the `advantage-server` console script the tests start, as an unprivileged user (uid 10001):
#   50051 gRPC (advantage.v1, health, reflection; TLS/token when configured)
#   50052 gRPC health only, plaintext (HEALTHCHECK and kubelet probes)
#    9090 Prometheus metrics (GET /metrics)
# A CPU-only torch: --build-arg PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index>; a mirror: PIP_INDEX_URL.
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

# ---------------------------------------------------------------- CPU dependencies in a virtualenv
FROM ${PYTHON_IMAGE} AS cpu-venv
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY constraints.txt /tmp/constraints.txt
COPY --from=build /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir --constraint /tmp/constraints.txt /wheels/*.whl

# ---------------------------------------------------------------- CPU-only image
FROM ${PYTHON_IMAGE} AS cpu
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/opt/advantage/numba-cache
RUN groupadd --system --gid 10001 advantage \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin advantage
COPY --from=cpu-venv /opt/venv /opt/venv
# every kernel signature compiled into the image's cache (readable by the server's user)
RUN python -m advantage_server.warmup && chmod -R a+rX /opt/advantage/numba-cache
USER 10001:10001
EXPOSE 50051 50052 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["advantage-healthcheck", "--address", "127.0.0.1:50052"]
ENTRYPOINT ["advantage-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--health-port", "50052", "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--device", "cpu"]

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
EXPOSE 50051 50052 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["advantage-healthcheck", "--address", "127.0.0.1:50052"]
ENTRYPOINT ["advantage-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--health-port", "50052", "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--device", "auto"]
