#!/usr/bin/env bash
# The estimator kernels on a GPU, in one call: advantage-bench --device cuda --sections kernel.
#
#   scripts/gpu_bench.sh fetch   # on a machine with internet (once): wheels of the few packages a GPU
#                                # image may lack, into .whl/ (ignored by git; carried to the GPU machine)
#   scripts/gpu_bench.sh         # on the GPU machine: install, check, benchmark; results under $OUT
#
# Installing: the torch already on the GPU machine is kept (a CUDA build; never replaced by the CPU
# wheel the pinned constraints.txt names), and so is every other package already installed there:
# `pip install -e .` runs with constraints.txt minus the pins of installed packages, offline from .whl/
# when it exists. If pip still cannot install (no network, a wheel missing), the benchmark runs from the
# source tree (PYTHONPATH) and says which import failed.
#
# Output ($OUT, default ./gpu-bench-out): env.txt (GPU, driver, versions, pip log), gpu_bench.txt (the
# table) and gpu_bench.json (the rows). Target (issue #3): each kernel within 2x of the HBM floor (a
# device-to-device copy of the same bytes). Runs in about 1-3 minutes on an H200; CI never runs it.
#
# Variables: PYTHON (default python3), OUT, WHEELS (default .whl), SIZES, GROUP_SIZES, ESTIMATORS, REPEATS.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
# the packages advantage-server needs that a CUDA image may lack or hold in an older version; the
# versions are those of the environment this runs `fetch` in (the development venv)
FETCH_PACKAGES="grpcio grpcio-status grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos prometheus-client"

if [ "${1:-}" = "fetch" ]; then
    mkdir -p "$WHEELS"
    for name in $FETCH_PACKAGES; do
        version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || exit 1
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$WHEELS" "$name==$version" || exit 1
    done
    ls -l "$WHEELS"
    exit 0
fi

OUT="${OUT:-$PWD/gpu-bench-out}"
mkdir -p "$OUT"
SIZES="${SIZES:-256x1024x8,1024x4096x16,512x8192x8,4096x8192x8}"
GROUP_SIZES="${GROUP_SIZES:-65536x1x8,65536x64x8,65536x256x8,262144x256x16}"
ESTIMATORS="${ESTIMATORS:-gae,grpo,gdpo,reinforce_plus_plus,opd}"
REPEATS="${REPEATS:-15}"
export PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_bench.sh: $PY has no CUDA torch or sees no GPU (see $OUT/env.txt); install a CUDA build of torch first" >&2
    exit 2
fi

# constraints.txt without the pins of packages already installed here (torch, numba, numpy stay as they are)
constraints="$(mktemp)"
"$PY" - constraints.txt >"$constraints" <<'EOF'
import importlib.metadata as m, re, sys
for line in open(sys.argv[1]):
    name = re.split(r"[=<>!~ ;\[#]", line.strip(), maxsplit=1)[0]
    if not name:
        continue
    try:
        m.version(name)          # installed: keep the machine's own version
    except m.PackageNotFoundError:
        print(line.strip())
EOF
pip_args=(install --no-build-isolation --disable-pip-version-check -c "$constraints" -e .)
if [ -d "$WHEELS" ]; then
    pip_args+=(--no-index --find-links "$WHEELS")
else  # no wheels: try the index, but do not wait long where there is no network
    pip_args+=(--retries 0 --timeout 10)
fi
if "$PY" -m pip "${pip_args[@]}" >>"$OUT/env.txt" 2>&1; then
    echo "installed: pip ${pip_args[*]}"
else
    echo "gpu_bench.sh: pip install failed (tail of $OUT/env.txt below); running from the source tree" >&2
    tail -5 "$OUT/env.txt" >&2
    site=""
    if [ -d "$WHEELS" ] && "$PY" -m pip install --quiet --no-index --no-deps --target /tmp/advantage-site \
            "$WHEELS"/*.whl >>"$OUT/env.txt" 2>&1; then
        site=":/tmp/advantage-site"   # the carried wheels, for this process only
    fi
    export PYTHONPATH="$PWD/server:$PWD/client$site${PYTHONPATH:+:$PYTHONPATH}"
fi
rm -f "$constraints"
"$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|numpy|numba|grpcio[a-z-]*|protobuf) " >>"$OUT/env.txt"

# the GPU path is the torch kernels: numba applies to CPU tensors only, so nothing compiles here
set -x
"$PY" -m advantage_server.bench --device cuda --sections kernel --estimators "$ESTIMATORS" \
    --sizes "$SIZES" --group-sizes "$GROUP_SIZES" --repeats "$REPEATS" --no-refs \
    --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
status=${PIPESTATUS[0]}
set +x
echo "gpu_bench.sh: exit $status; results in $OUT (gpu_bench.txt, gpu_bench.json, env.txt)"
exit "$status"
