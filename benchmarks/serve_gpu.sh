#!/usr/bin/env bash
# The online-serving results of benchmarks/results/serve/ on one GPU machine (docs/serving.md, "Load benchmark"):
# bench-serve in process and over HTTP (several API-server processes, msgpack bodies) on the bench's hierarchical
# engine, at the same offered rates. Usage: bash benchmarks/serve_gpu.sh OUT_DIR [RATES]
set -u
out=${1:?usage: serve_gpu.sh OUT_DIR [RATES]}
rates=${2:-1200,1600,2000}
mkdir -p "$out"
python -m gr_engine bench-serve --in-process --mode hierarchical --rates "$rates" --duration 8 \
  --out "$out/in_process_hierarchical" > "$out/in_process_hierarchical.log" 2>&1
echo "in process: exit $?"
python -m gr_engine bench-serve --write-config "$out/hierarchical.json" --mode hierarchical
python -m gr_engine serve --config "$out/hierarchical.json" --api-servers 6 --host 127.0.0.1 --port 8000 \
  > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do
  curl -sf http://127.0.0.1:8000/ready > /dev/null && break
  sleep 1
done
python -m gr_engine bench-serve --url http://127.0.0.1:8000 --processes 4 --concurrency 32 --body msgpack \
  --rates "$rates" --duration 8 --out "$out/http_hierarchical" > "$out/http_hierarchical.log" 2>&1
echo "http: exit $?"
kill -TERM $server
wait $server
echo "server: exit $?"
