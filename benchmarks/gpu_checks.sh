#!/usr/bin/env bash
# One device command that validates the GPU code and re-measures the component benchmarks (about 7-8 minutes
# on the H200): the GPU tests, then cache_bench, kernel_bench and engine_smoke, each under its own time
# limit, results under $OUT. Usage (device tool, with .whl carried): bash benchmarks/gpu_checks.sh <commit>
set -uo pipefail
commit=${1:?usage: gpu_checks.sh <commit>}
out=${OUT:?set OUT to the results folder}
source .whl/activate.sh
timeout 330 python -m pytest -q -ra -m gpu tests/ -p no:cacheprovider 2>&1 | tail -40 > "$out/gpu_tests.log"
tail -3 "$out/gpu_tests.log"
timeout 120 python benchmarks/cache_bench.py --out "$out/cache_bench.json" --commit "$commit" 2>&1 | tail -3
timeout 120 python benchmarks/kernel_bench.py --out "$out/kernels.json" --commit "$commit" 2>&1 | grep -v '^ ' | tail -3
timeout 100 python benchmarks/engine_smoke.py --out "$out/engine_smoke.json" --commit "$commit" 2>&1 | grep -E "^(recompute|unlimited)" | cut -c1-200
