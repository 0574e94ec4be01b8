#!/usr/bin/env bash
# The GPU checks (issue 12) as one short script, for one lease of a CUDA machine. CI never has a GPU.
#
#   bash bench/gpu_check.sh        # from anywhere; logs and summary.txt go to $OUT (default bench/gpu_out)
#
# 1. Install gradstore with the `gpu` extra (faiss-gpu in place of faiss-cpu: the same `faiss` module, never
#    both) and `hf`, over the machine's own CUDA build of torch. Where pip reaches no package index, set
#    GPU_CHECK_WHEELS=<folder of wheels> to install those instead (no dependency resolution; an empty folder
#    installs nothing and costs no wait); what is still missing is reported and the checks that need it are
#    skipped: pytest's store test without LanceDB, the
#    FAISS GPU test without a GPU build of faiss, both benchmarks without the store's dependencies.
# 2. pytest -m gpu: CUDA capture against torch.func and the CPU capture, training unchanged by capture, AMP
#    scaling, exact search on CUDA against numpy, the store's search on CUDA, FAISS GPU against CPU.
# 3. bench/query.py --device cuda (50k and 200k rows): the exact kernels, store.attribute and FAISS Flat on the GPU.
# 4. bench/capture.py --device cuda: W-capture (plain vs captured training steps) on the GPU.
# Every step runs even when an earlier one failed; summary.txt lists each step's exit status, its last pytest
# line or RESULT lines, and its time. Expect about 6-8 minutes after the install on an H100/H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/gpu_out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$SUMMARY"; }

step() { # step NAME COMMAND...: run it, log to $OUT/NAME.log, note its exit status, outcome lines and time
    local name=$1
    shift
    note "== $name: $*"
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -E '^RESULT |^[0-9]+ (passed|failed)|(passed|failed|skipped|error).* in [0-9.]+s' "$OUT/$name.log" | tee -a "$SUMMARY"
    [ "$rc" = 0 ] || tail -n 2 "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
    note "   exit status $rc after $((SECONDS - start)) s"
    return 0
}

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

step environment sh -c "nvidia-smi -L; $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name())'"
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    step install "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation "$GPU_CHECK_WHEELS"/*.whl -e .
else
    step install "$PYTHON" -m pip install --retries 1 --timeout 20 -e '.[gpu,hf]'
fi
if ! has gradstore; then # no index and no wheels: the repository's own packages still import from its root
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
STORE_OK=1
for module in lancedb lance duckdb pyarrow typer; do
    has "$module" || {
        note "   missing: $module (the store's checks are skipped)"
        STORE_OK=0
    }
done
has faiss && "$PYTHON" -c "import faiss, sys; sys.exit(not hasattr(faiss, 'StandardGpuResources'))" ||
    note "   faiss has no GPU support here: the FAISS GPU test skips and bench/query.py times FAISS on the CPU"

if [ "$STORE_OK" = 1 ]; then
    step pytest_gpu "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider
else # the other test modules import the store at collection
    step pytest_gpu "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/integrations/test_gpu.py tests/search/test_indexers_faiss.py
fi
if [ "$STORE_OK" = 1 ] && has faiss; then
    step query_cuda "$PYTHON" bench/query.py --device cuda
    step capture_cuda "$PYTHON" bench/capture.py --device cuda
else
    note "== query_cuda, capture_cuda: skipped (they need the store's dependencies and faiss)"
fi
note "logs: $OUT"
