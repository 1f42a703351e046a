#!/usr/bin/env bash
# One device command that validates the GPU code and re-measures the host tier (about 8-9 minutes on the H200): the
# GPU tests, the compiled kernels' tests, then cache_bench, each under its own time limit, results under $OUT.
# kernel_bench.py (attention kernels) and `gr-engine bench` run on their own.
# Usage (device tool, with .whl carried):
#   bash benchmarks/gpu_checks.sh <commit>
set -uo pipefail
commit=${1:?usage: gpu_checks.sh <commit>}
out=${OUT:?set OUT to the results folder}
source .whl/activate.sh
timeout 300 python -m pytest -q -ra -m gpu tests/ -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
tail -2 "$out/gpu_tests.log"
# The Triton kernels' own tests are not marked gpu (on CPU they run in the interpreter): compiled, on CUDA, here.
# The device tile plan's random steps compile a kernel each: about 3 minutes.
timeout 270 python -m pytest -q -ra tests/test_offload_kernel.py tests/test_onload_kernel.py \
    tests/test_hstu_triton_device_plan.py -p no:cacheprovider > "$out/kernel_tests.log" 2>&1
tail -2 "$out/kernel_tests.log"
timeout 200 python benchmarks/cache_bench.py --out "$out/cache_bench.json" --commit "$commit" > "$out/cache_bench.log" 2>&1
echo "cache_bench exit $?"
