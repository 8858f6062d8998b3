#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent GPU machine (issue 15 item 5):
# the tests marked `gpu` (CUDA transfer engine on its streams, the cudaHostRegister'ed arena, the
# end-to-end run with workers on CUDA), then the GPU<->arena copy benchmark against pinned
# cudaMemcpy. Usage, from the repository root: scripts/device_checks.sh [OUT_DIR]
#
# Such a machine has PyTorch with CUDA but may lack the daemon's own wheels and reach no package
# index: wheels for its Python in .whl/ (made beside the checkout with `pip download`, see
# docs/benchmarks.md "GPU") are installed into /tmp/site first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/kvserver-device}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
        --format=csv
    python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "$out/machine.txt"

# 1. every test marked gpu (and, beside them, their CPU twins in the same modules; the staged
#    copies' GPU twins are in test_transfer_cuda.py, which needs no hypothesis)
timeout "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rA \
    tests/worker/test_transfer.py tests/worker/test_transfer_cuda.py tests/test_e2e.py \
    2>&1 | tee "$out/pytest_gpu.log" || status=1

# 2. GPU<->arena copies vs pinned cudaMemcpy (the CPU rows run first, on one thread); each row
#    also times the other builder (CUDA: the per-page copies of before the staged path)
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_transfer.py ${BENCH_ARGS:-} \
    --json "$out/transfer_gpu.json" 2>&1 | tee "$out/bench_transfer.log" || status=1

# 3. one chunk per transfer (a decode step's stores), the rows where each transfer's own cost
#    shows: the engine's completion is a done flag per transfer and one condition per direction
#    (session 10, no GPU to test it then); compare with benchmarks/results/gpu_h100_decode_g256.json
if [ -z "${BENCH_ARGS:-}" ]; then
    timeout "${DECODE_TIMEOUT:-180}" python3 benchmarks/bench_transfer.py --quick --devices cuda \
        --chunks-per-transfer 1 --json "$out/transfer_gpu_decode.json" 2>&1 \
        | tee "$out/bench_transfer_decode.log" || status=1
fi
exit $status
