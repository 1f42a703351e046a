#!/usr/bin/env bash
# The GPU code's checks on one GPU machine, in parts that each fit one device command (10 minutes), results under
# $OUT. kernel_bench.py, tile_sweep.py (attention kernels) and `gr-engine bench` run on their own.
#   tests    every GPU test except the warm-up ones (about 4-6 minutes)
#   warmup   tests/test_gpu_warmup.py: after warm-up nothing compiles or captures, each case in a fresh process with
#            an empty Triton cache (about 4-5 minutes)
#   kernels  the Triton kernels' own tests, compiled on CUDA (not marked gpu: on CPU they run in the interpreter), then
#            cache_bench (the host tier's transfer bandwidth)
#   cold     kernel_profile.py --cold-history 8192 (the bench's cold first visit) as configured ("default"), and with the visit on
#            step graphs: one step in an 8448-row graph (156 rows padded), with graphs up to 16384 rows (its bucket
#            then 8704 rows; the warm-up's time and memory recorded), or an 8192-row graph and a small one (about 2-4
#            minutes)
#   ab       kernel_ab.py and plan_ab.py against baseline copies made before the tree travels, untracked in the
#            repository root: ab_kernels.py (git show REV:attention_backends/hstu_triton_kernels.py) and ab_plan.py
#            (git show REV:attention_backends/hstu_triton_device_plan.py); either may be absent (about 2-3 minutes)
#   bench    gr-engine bench --modes recompute,hierarchical (issue 29's figures and the headline's two modes; about
#            7 minutes: a command of its own), its folder packed as bench_<commit>.tgz
#   kernelbench  kernel_bench.py -> kernels.json (about 2-3 minutes)
#   dense    dense_ab.py (hstu_triton's paged read against attend_new_rows on the steps with no cached keys) and
#            dense_attention_probe.py (a prefill's attention over the dense projection, pointer loads and TMA, against
#            the paged kernel; about 3-4 minutes together)
#   firstvisits  cold_visits.py: the bench's cold first visits alone, recompute and gpu_only alternating, two rounds
#            (about 3-5 minutes: each round builds and warms up both engines)
# Parts that write folders (cold, bench) pack them into one .tgz each: a command returns only a few files.
# Usage (device tool, with .whl carried):
#   bash benchmarks/gpu_checks.sh <commit> [tests|warmup|kernels|cold|ab|bench|kernelbench|dense|firstvisits ...]
#   (default: tests; one part a command)
set -uo pipefail
commit=${1:?usage: gpu_checks.sh <commit> [tests|warmup|kernels|cold|ab|bench|kernelbench|dense|firstvisits ...]}
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
          tests/test_fused_linear.py -p no:cacheprovider > "$out/kernel_tests.log" 2>&1
        tail -2 "$out/kernel_tests.log"
        timeout 200 python benchmarks/cache_bench.py --out "$out/cache_bench.json" --commit "$commit" \
          > "$out/cache_bench.log" 2>&1
        echo "cache_bench exit $?" ;;
      cold)
        variants=("default" "graphs8448 cuda_graph_max_rows=8448" "graphs16384 cuda_graph_max_rows=16384"
                  "chunks8192 cuda_graph_max_rows=8192 scheduler.max_chunk_tokens=8092")
        for variant in "${variants[@]}"; do
          read -r name overrides <<< "$variant"
          sets=()
          for setting in $overrides; do sets+=(--set "$setting"); done
          timeout 150 python benchmarks/kernel_profile.py --out "$out/cold_$name" --cold-history 8192 --batches 5 \
            --commit "$commit" "${sets[@]}" > "$out/cold_$name.log" 2>&1
          echo "cold $name: exit $?"
          grep -m1 "wall per visit" "$out/cold_$name/kernel_profile.md"
          grep -m1 "warm-up" "$out/cold_$name/kernel_profile.md"
        done
        (cd "$out" && tar czf "cold_$commit.tgz" cold_* --remove-files) ;;
      ab)
        if [ -f ab_kernels.py ]; then
          (cd benchmarks && timeout 200 python kernel_ab.py --baseline ../ab_kernels.py --out "$out/kernel_ab.json" \
            --commit "$commit") > "$out/kernel_ab.log" 2>&1
          echo "kernel_ab exit $?"; tail -2 "$out/kernel_ab.log"
        fi
        if [ -f ab_plan.py ]; then
          timeout 120 python benchmarks/plan_ab.py --baseline ab_plan.py --out "$out/plan_ab.json" --commit "$commit" \
            > "$out/plan_ab.log" 2>&1
          echo "plan_ab exit $?"; tail -15 "$out/plan_ab.log"
        fi ;;
      dense)
        (cd benchmarks && timeout 200 python dense_ab.py --out "$out/dense_ab.json" --commit "$commit") \
          > "$out/dense_ab.log" 2>&1
        echo "dense_ab exit $?"; tail -5 "$out/dense_ab.log"
        timeout 300 python benchmarks/dense_attention_probe.py --out "$out/dense_attention_probe.json" \
          --commit "$commit" > "$out/dense_attention_probe.log" 2>&1
        echo "dense_attention_probe exit $?"; tail -12 "$out/dense_attention_probe.log" ;;
      bench)
        timeout 520 python -m gr_engine bench --modes recompute,hierarchical --out "$out/bench_$commit" \
          --commit "$commit" > "$out/bench_$commit.log" 2>&1
        echo "bench exit $?"
        grep -E "^(recompute|hierarchical) " "$out/bench_$commit.log"
        grep -E '"(cold_8192_ms|cold_8192_ms_gpu_only|recompute_mfu_bs8|recompute_prepare_strip_ms_bs8|speedup_bs8_mean|speedup_bs8)"' \
          "$out/bench_$commit/summary.json"
        (cd "$out" && tar czf "bench_$commit.tgz" "bench_$commit" --remove-files) ;;
      kernelbench)
        timeout 330 python benchmarks/kernel_bench.py --out "$out/kernels.json" --commit "$commit" \
          > "$out/kernel_bench.log" 2>&1
        echo "kernel_bench exit $?"
        python -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d[k] for k in d if 'prefill' in k})" \
          "$out/kernels.json" ;;
      firstvisits)
        timeout 400 python benchmarks/cold_visits.py --out "$out/cold_visits.json" --commit "$commit" \
          > "$out/cold_visits.log" 2>&1
        echo "cold_visits exit $?"; tail -5 "$out/cold_visits.log" ;;
      *) echo "unknown part $part"; exit 2 ;;
    esac
done
