# syntax=docker/dockerfile:1
# Advantage service images.
#   CPU:  docker build --target cpu -t advantage-service:cpu .
#   GPU:  docker build --target gpu -t advantage-service:gpu .   (run with --gpus all)
# Both run the same `advantage-server` entrypoint the tests start, listening on 50051.
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

# ---------------------------------------------------------------- CPU-only image
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
COPY constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt /wheels/*.whl && rm -rf /wheels \
    && useradd --create-home --uid 10001 advantage
USER advantage
EXPOSE 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["advantage-healthcheck", "--address", "127.0.0.1:50051"]
ENTRYPOINT ["advantage-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--device", "cpu"]

# ---------------------------------------------------------------- GPU image (torch with CUDA from the base)
FROM ${TORCH_CUDA_IMAGE} AS gpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && useradd --create-home --uid 10001 advantage
USER advantage
EXPOSE 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["advantage-healthcheck", "--address", "127.0.0.1:50051"]
ENTRYPOINT ["advantage-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--device", "auto"]
