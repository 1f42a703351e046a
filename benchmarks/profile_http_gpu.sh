#!/usr/bin/env bash
# A sampling profile (py-spy) of the HTTP path under load: while bench-serve loads `gr-engine serve --api-servers 6`
# at one rate (serve_gpu.sh's http part), py-spy samples the engine core, two API servers and one load generator.
# Usage: bash benchmarks/profile_http_gpu.sh OUT_DIR (py-spy on the PATH). Environment: RATE (1200), SAMPLE_S (4).
# Writes OUT_DIR/<role>.pyspy.txt (collapsed stacks, idle samples included), the run's results and logs, OUT_DIR.tar.
set -u
out=${1:?usage: profile_http_gpu.sh OUT_DIR}
command -v py-spy > /dev/null || { echo "py-spy is not on the PATH (bring its wheel in the run's carry)"; exit 2; }
mkdir -p "$out"
RATES=${RATE:-1200} bash benchmarks/serve_gpu.sh "$out/run" http > "$out/serve.log" 2>&1 &
for _ in $(seq 600); do
  grep -q "^rate " "$out/run/http_hierarchical.log" 2>/dev/null && break
  sleep 0.5
done
sleep 1
launcher=$(pgrep -f "gr_engine serve" | head -1)
core=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -1)
servers=$(pgrep -f "spawn_main" -P "$launcher" | grep -v "^$core\$" | head -2)  # (not the resource tracker)
bench=$(pgrep -f "^python -m gr_engine bench-serve" | head -1)  # (not the timeout wrapping it)
generator=$(pgrep -f "spawn_main" -P "$bench" | head -1)  # one of its generator processes
echo "launcher $launcher core $core api servers $servers generator $generator"
sample() {  # role, pid
  py-spy record --pid "$2" --duration "${SAMPLE_S:-4}" --rate 200 --nonblocking --idle --format raw \
    --output "$out/$1.pyspy.txt" > "$out/$1.pyspy.log" 2>&1 &
}
sample core "$core"
n=0
for pid in $servers; do
  sample "api_server$n" "$pid"
  n=$((n + 1))
done
sample generator "$generator"
wait
tar -cf "$out.tar" -C "$(dirname "$out")" "$(basename "$out")"
