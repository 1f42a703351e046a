#!/usr/bin/env bash
# A sampling profile (py-spy) of the engine-core process while bench-serve drives it in process at one rate, after
# the same warm-up as serve_gpu.sh. Usage: bash benchmarks/profile_core_gpu.sh OUT_DIR (py-spy on the PATH).
# Environment: RATE (default 2000), DURATION (s of load, 12), SAMPLE_S (s profiled, 8), SKIP (20000).
# Writes OUT_DIR/core.pyspy.txt (collapsed stacks, idle samples included), the run's results and log, OUT_DIR.tar.
set -u
out=${1:?usage: profile_core_gpu.sh OUT_DIR}
command -v py-spy > /dev/null || { echo "py-spy is not on the PATH (bring its wheel in the run's carry)"; exit 2; }
mkdir -p "$out"
python -m gr_engine bench-serve --in-process --mode hierarchical --skip-steady "${SKIP:-20000}" \
  --rates "${RATE:-2000}" --duration "${DURATION:-12}" --out "$out/run" > "$out/run.log" 2>&1 &
bench=$!
for _ in $(seq 400); do
  grep -q "^rate " "$out/run.log" && break
  sleep 0.5
done
sleep 1
core=$(pgrep -f "spawn_main" -P "$bench" | head -1)
echo "bench $bench, core $core"
py-spy record --pid "$core" --duration "${SAMPLE_S:-8}" --rate 250 --nonblocking --idle --format raw \
  --output "$out/core.pyspy.txt" > "$out/pyspy.log" 2>&1
echo "py-spy: exit $?"
wait $bench
echo "bench: exit $?"
tar -cf "$out.tar" -C "$(dirname "$out")" "$(basename "$out")"
