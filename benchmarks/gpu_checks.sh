#!/usr/bin/env bash
# The GPU code's checks on one GPU machine, in parts that each fit one device command (10 minutes), results under
# $OUT. kernel_bench.py, tile_sweep.py (attention kernels) and `gr-engine bench` run on their own.
#   tests    every GPU test except the warm-up ones (about 4-6 minutes)
#   warmup   tests/test_gpu_warmup.py: after warm-up nothing compiles or captures, each case in a fresh process with
#            an empty Triton cache (about 4-5 minutes)
#   kernels  the Triton kernels' own tests, compiled on CUDA (not marked gpu: on CPU they run in the interpreter), then
#            cache_bench (the host tier's transfer bandwidth)
# Usage (device tool, with .whl carried):
#   bash benchmarks/gpu_checks.sh <commit> [tests|warmup|kernels ...]   (default: tests; one part a command)
set -uo pipefail
commit=${1:?usage: gpu_checks.sh <commit> [tests|warmup|kernels ...]}
shift
out=${OUT:?set OUT to the results folder}
source .whl/activate.sh
[ $# -gt 0 ] || set -- tests
for part in "$@"; do
    case $part in
      tests)
        timeout 420 python -m pytest -q -ra -m gpu tests/ --ignore tests/test_gpu_warmup.py -p no:cacheprovider \
          > "$out/gpu_tests.log" 2>&1
        tail -2 "$out/gpu_tests.log" ;;
      warmup)
        timeout 420 python -m pytest -q -ra -m gpu tests/test_gpu_warmup.py -p no:cacheprovider \
          > "$out/gpu_warmup_tests.log" 2>&1
        tail -2 "$out/gpu_warmup_tests.log" ;;
      kernels)
        # The device tile plan's random steps compile a kernel each: about 3 minutes.
        timeout 330 python -m pytest -q -ra tests/test_offload_kernel.py tests/test_onload_kernel.py \
          tests/test_hstu_triton_device_plan.py tests/test_hstu_triton_uncut.py tests/test_fused_ops.py \
          -p no:cacheprovider > "$out/kernel_tests.log" 2>&1
        tail -2 "$out/kernel_tests.log"
        timeout 200 python benchmarks/cache_bench.py --out "$out/cache_bench.json" --commit "$commit" \
          > "$out/cache_bench.log" 2>&1
        echo "cache_bench exit $?" ;;
      *) echo "unknown part $part"; exit 2 ;;
    esac
done
