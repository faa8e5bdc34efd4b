#!/usr/bin/env bash
# Device check of maskplug's kernel backends (Triton and CuPy): correctness on the GPU,
# device copy bandwidth, and timings against xgrammar's Triton and CUDA kernels and a
# vLLM-style per-row Triton kernel. Meant to finish in under 8 minutes on an H100/H200.
#
#   benchmarks/gpu_check.sh fetch     on the development machine (network): download the
#                                     wheels the GPU image lacks into .whl/ (git-ignored):
#                                     xgrammar and its imports that are not on the image
#   benchmarks/gpu_check.sh [ARGS]    on the GPU machine: install .whl/*.whl (if present)
#                                     and maskplug's own distributions from this tree into
#                                     a scratch site directory, run the GPU tests, then
#                                     benchmarks/gpu_bench.py ARGS; copies the JSON and the
#                                     log to $OUT when that is set
#
# Environment: PYTHON (default python3), WHEEL_PY (Python version of the fetched wheels,
# default 3.12), SITE (scratch install directory, default /tmp/maskplug-site).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEEL_PY=${WHEEL_PY:-3.12}
SITE=${SITE:-/tmp/maskplug-site}

if [ "${1:-}" = "fetch" ]; then
    # Versions pinned to what the CPU environment was tested with; --no-deps keeps the image's
    # torch, triton, numpy and transformers.
    mkdir -p .whl
    for spec in xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5; do
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$WHEEL_PY" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$spec"
    done
    ls -la .whl
    exit 0
fi

start=$(date +%s)
mkdir -p "$SITE"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
# maskplug and both backends from this tree, without dependencies (the image has torch, triton, cupy).
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" \
    . backends/triton backends/cupy
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "installed in $(( $(date +%s) - start )) s"

"$PYTHON" -c "import maskplug; print(maskplug.backend_status('cuda'))"

log=$(mktemp)
status=0
# GPU tests first: a kernel that is wrong is not worth timing (about a minute).
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider -p no:xdist -m gpu tests/backends/test_gpu_kernels.py \
    2>&1 | tee "$log" || status=1
left=$(( 460 - ($(date +%s) - start) ))
if [ "$left" -lt 60 ]; then left=60; fi
timeout "$left" "$PYTHON" benchmarks/gpu_bench.py --budget-s $(( left - 40 )) --json /tmp/gpu_bench.json "$@" \
    2>&1 | tee -a "$log" || status=1
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$log" "$OUT/gpu_check.log"
    if [ -f /tmp/gpu_bench.json ]; then cp /tmp/gpu_bench.json "$OUT/gpu_bench.json"; fi
fi
echo "gpu_check: $( [ $status -eq 0 ] && echo passed || echo FAILED ) in $(( $(date +%s) - start )) s"
exit $status
