#!/usr/bin/env bash
# One device command that validates the GPU code and re-measures the component benchmarks (about 8-10 minutes
# on the H200): the GPU tests and the compiled kernels' tests, then cache_bench, kernel_bench and engine_smoke,
# each under its own time limit, results under $OUT.
# Usage (device tool, with .whl carried): bash benchmarks/gpu_checks.sh <commit>
set -uo pipefail
commit=${1:?usage: gpu_checks.sh <commit>}
out=${OUT:?set OUT to the results folder}
source .whl/activate.sh
timeout 330 python -m pytest -q -ra -m gpu tests/ -p no:cacheprovider 2>&1 | tail -40 > "$out/gpu_tests.log"
tail -3 "$out/gpu_tests.log"
# The Triton kernels' own tests are not marked gpu (on CPU they run in the interpreter): compiled, on CUDA, here.
timeout 270 python -m pytest -q -ra tests/test_offload_kernel.py tests/test_onload_kernel.py \
    tests/test_hstu_triton_device_plan.py -p no:cacheprovider 2>&1 | tail -20 > "$out/kernel_tests.log"
tail -2 "$out/kernel_tests.log"
timeout 120 python benchmarks/cache_bench.py --out "$out/cache_bench.json" --commit "$commit" 2>&1 | tail -3
timeout 120 python benchmarks/kernel_bench.py --out "$out/kernels.json" --commit "$commit" 2>&1 | grep -v '^ ' | tail -3
timeout 100 python benchmarks/engine_smoke.py --out "$out/engine_smoke.json" --commit "$commit" 2>&1 | grep -E "^(recompute|unlimited)" | cut -c1-200
