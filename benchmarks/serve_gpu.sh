#!/usr/bin/env bash
# The online-serving results of benchmarks/results/serve/ on one GPU machine (docs/serving.md, "Load benchmark").
# Every run replays the same stretch of the bench's trace (after SKIP steady visits served in its warm-up) with the
# same arrivals, so runs compare at each rate. Usage: bash benchmarks/serve_gpu.sh OUT_DIR PART
#   in-process: bench-serve in process, the bench's hierarchical engine (default), then each serving variant
#               (sync: serving.async_scheduling=false, each step waited for before the next is launched;
#               seqs8: scheduler.max_num_seqs=8 instead of bench-serve's 16, wait0: serving.max_batch_wait_ms=0
#               instead of 1, queue0: serving.max_queue_ms=0, admission by pending requests alone); VARIANTS picks some
#   http:       gr-engine serve --api-servers 6 (step log on) loaded by 8 generator processes with msgpack bodies;
#               the server's processes' CPU seconds before and after the load in server_cpu_{start,end}.txt
#   recompute:  bench-serve in process in recompute mode, at lower rates
# Environment: RATES (default 1000,1200,1400,1600,1800,2000), SKIP (20000), DURATION (s per rate, 5), TIMEOUT (s per
# run, 250), SERVER_SET (http: more --set key=value arguments for the server), API_SERVERS (http: 6) and GENERATORS
# (http: generator processes, 8), WARMUP_CONCURRENCY (http: warm-up visits in flight over all generators, 8 as in
# process; 32 until c9b5cb9, whose HTTP warm-up left more users uncached than the in-process one), PER_RATE=1
# (in-process: each rate in its own run from the same SKIP, named NAME_rRATE, instead of the rates replaying
# consecutive stretches of the trace in one run). Everything under OUT_DIR is also packed into OUT_DIR.tar.
set -u
out=${1:?usage: serve_gpu.sh OUT_DIR in-process|http|recompute}
part=${2:?usage: serve_gpu.sh OUT_DIR in-process|http|recompute}
rates=${RATES:-1000,1200,1400,1600,1800,2000}
skip=${SKIP:-20000}
duration=${DURATION:-5}
mkdir -p "$out"
start=$SECONDS
run_rates() {  # name, rates, then --set overrides
  local name=$1 run_rates=$2
  shift 2
  timeout "${TIMEOUT:-250}" python -m gr_engine bench-serve --in-process --mode hierarchical --skip-steady "$skip" \
    --rates "$run_rates" --duration "$duration" --out "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? at $((SECONDS - start)) s"
  gzip -f "$out/$name/core_steps.jsonl"  # the profile is in bench_serve.json; the whole log, compressed
}
tree_cpu() {  # each process of the tree under pid $1: pid, cumulative CPU time (user + system), command
  local all=$1 level=$1
  while level=$(pgrep -d , -P "$level"); do all="$all,$level"; done
  ps -o pid=,times=,args= -p "$all" | cut -c1-200
}
sweep() {  # name, then --set overrides
  local name=$1
  shift
  if [ "${PER_RATE:-0}" = 1 ]; then
    for rate in ${rates//,/ }; do
      run_rates "${name}_r$rate" "$rate" "$@"
    done
  else
    run_rates "$name" "$rates" "$@"
  fi
}
case $part in
  in-process)
    for variant in ${VARIANTS:-default sync seqs8 wait0 queue0}; do
      case $variant in
        default) sweep in_process_hierarchical ;;
        sync) sweep in_process_sync --set serving.async_scheduling=false ;;
        seqs8) sweep in_process_seqs8 --set scheduler.max_num_seqs=8 ;;
        wait0) sweep in_process_wait0 --set serving.max_batch_wait_ms=0 ;;
        queue0) sweep in_process_queue0 --set serving.max_queue_ms=0 ;;
      esac
    done
    ;;
  http)
    python -c "import aiohttp" || { echo "the load generators need aiohttp (the serve extra; on the GPU machine: its wheels in .whl)"; exit 2; }
    python -m gr_engine bench-serve --write-config "$out/hierarchical.json" --mode hierarchical
    # shellcheck disable=SC2086  # SERVER_SET: more --set overrides for the server, word-split
    python -m gr_engine serve --config "$out/hierarchical.json" --set "serving.step_log=$out/http_core_steps.jsonl" \
      ${SERVER_SET:-} --api-servers "${API_SERVERS:-6}" --host 127.0.0.1 --port 8000 > "$out/server.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
      curl -sf http://127.0.0.1:8000/ready > /dev/null && break
      sleep 1
    done
    tree_cpu $server > "$out/server_cpu_start.txt"  # the core's and API servers' CPU seconds, before the load
    timeout 300 python -m gr_engine bench-serve --url http://127.0.0.1:8000 --processes "${GENERATORS:-8}" --concurrency "${WARMUP_CONCURRENCY:-8}" \
      --body msgpack --skip-steady "$skip" --rates "$rates" --duration "$duration" \
      --core-steps "$out/http_core_steps.jsonl" --out "$out/http_hierarchical" > "$out/http_hierarchical.log" 2>&1
    echo "http: exit $? at $((SECONDS - start)) s"
    tree_cpu $server > "$out/server_cpu_end.txt"  # and after it (warm-up and rates): their CPU a request
    kill -TERM $server
    wait $server
    echo "server: exit $?"
    gzip -f "$out/http_core_steps.jsonl"
    ;;
  recompute)
    timeout 200 python -m gr_engine bench-serve --in-process --mode recompute --skip-steady 0 --rates "${RATES:-50,100,150,200}" \
      --duration "$duration" --out "$out/in_process_recompute" > "$out/in_process_recompute.log" 2>&1
    echo "recompute: exit $? at $((SECONDS - start)) s"
    gzip -f "$out/in_process_recompute/core_steps.jsonl"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
tar -cf "$out.tar" -C "$(dirname "$out")" "$(basename "$out")"
