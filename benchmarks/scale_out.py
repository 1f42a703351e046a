"""Scale-out sizing by simulation (CPU, no GPU): users routed to N replicas by ``gr_engine.routing.HashRing``, each
replica's hierarchical cache simulated by the bench's policy simulator (``gr_engine.bench.simulate.simulate_policy``).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/scale_out.py --out benchmarks/results/scale_out.json

The KuaiRand-like trace (``gr_engine.bench.trace``) scaled to N replicas is N traces of different seeds with disjoint
user ids (trace ``s``'s user ``u`` is ``s * users + u``), first visits first, the steady requests merged by time.

1. Load imbalance (max / mean requests per replica, all requests) for N = 1, 2, 4, 8, 16 and a sweep of virtual node
   counts, at the paper's 1,000 users per replica (only the ring and the per-user request counts: cheap); beside it
   the ring's own share of the hash space per replica (max / mean), the imbalance with infinitely many equal users.
2. Total token hit ratio (steady state, as ``simulate_policy``) per N, each replica with the paper's GPU pages and host
   budget scaled by ``users_per_replica / 1000`` (its users are scaled down by the same factor to keep the run short).
3. At N = ``--change-replicas``, at ``--change-at`` seconds: one replica removed (its users go on to their next
   replica) or one added; the hit ratio of the steady requests in the ``--window`` seconds after, for the moved users
   and the others, beside the same window with no change. A moved user's first request at its new replica misses
   whole (``cold_tokens``); "only the moved users miss" means the others' ratio is the no-change one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from collections.abc import Hashable
from dataclasses import replace

import msgspec
import numpy as np
import torch
from tqdm import tqdm

from gr_engine.bench.runner import BenchSettings, cache_config
from gr_engine.bench.simulate import simulate_policy
from gr_engine.bench.trace import Trace, TraceConfig, generate_trace
from gr_engine.routing import DEFAULT_VIRTUAL_NODES, HashRing

PAPER_USERS = TraceConfig().num_users  # the trace one GPU serves in the paper's setting (docs/design.md section 8)


def replica_names(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


def merged_trace(traces: list[Trace], users: int) -> Trace:
    """The first ``len(traces)`` traces as one: user ids offset by ``users`` per trace, first visits first (trace by
    trace), then every steady request by time."""
    all_users = [u for t in traces for u in t.users]
    warm, steady = [], []
    for s, t in enumerate(traces):
        for r in t.requests:
            (warm if r.warmup else steady).append(replace(r, user=r.user + s * users))
    steady.sort(key=lambda r: r.time)
    return Trace(traces[0].config, all_users, warm + steady)


def sub_trace(trace: Trace, indices: np.ndarray) -> Trace:
    """The requests ``indices`` of ``trace`` (in order), over only their users (renumbered)."""
    local: dict[int, int] = {}
    requests = []
    for i in indices.tolist():
        r = trace.requests[i]
        requests.append(replace(r, user=local.setdefault(r.user, len(local))))
    users = [None] * len(local)
    for user, index in local.items():
        users[index] = trace.users[user]
    return Trace(trace.config, users, requests)


def _simulate(trace: Trace, cache) -> np.ndarray:
    torch.set_num_threads(1)
    per_request = np.zeros((len(trace.requests), 3), dtype=np.int64)
    simulate_policy(trace, cache, per_request)
    return per_request


def simulate_routing(trace: Trace, owner: list[Hashable], cache, pool, label: str) -> np.ndarray:
    """Per request of ``trace`` (history tokens, GPU hits, host hits), each replica simulated over the requests that
    ``owner`` (a replica per request) sends it."""
    owner_array = np.array([str(o) for o in owner])
    out = np.zeros((len(trace.requests), 3), dtype=np.int64)
    jobs = {}
    for replica in sorted(set(owner_array.tolist())):
        indices = np.flatnonzero(owner_array == replica)
        part = sub_trace(trace, indices)
        jobs[pool.submit(_simulate, part, cache) if pool else _Done(_simulate(part, cache))] = indices
    for job in tqdm(concurrent.futures.as_completed(jobs) if pool else jobs, total=len(jobs), desc=label,
                    file=sys.stderr):
        out[jobs[job]] = job.result()
    return out


class _Done:
    """A finished job, for the inline (no pool) path."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def result(self) -> np.ndarray:
        return self.value


def ratio(rows: np.ndarray) -> float | None:
    """Total (GPU + host) token hit ratio of ``rows`` of (history, GPU hits, host hits)."""
    tokens = int(rows[:, 0].sum())
    return float(rows[:, 1:].sum() / tokens) if tokens else None


def imbalance(counts: np.ndarray, owner: list[Hashable], n: int) -> float:
    """Max / mean requests per replica of users with ``counts`` requests routed to ``owner``."""
    per = {}
    for c, o in zip(counts.tolist(), owner):
        per[o] = per.get(o, 0) + c
    loads = [per.get(r, 0) for r in replica_names(n)]
    return float(max(loads) / np.mean(loads))


def hash_space_imbalance(ring: HashRing, n: int) -> float:
    """Max / mean share of the hash space per replica (the imbalance with infinitely many equal users)."""
    positions = np.array([int(p) for p in ring._positions], dtype=np.float64) / 2.0**64
    arcs = np.diff(np.concatenate([[positions[-1] - 1.0], positions]))  # the arc ending at a point is its owner's
    shares: dict[str, float] = {}
    for arc, owner in zip(arcs.tolist(), ring._owners):
        shares[owner] = shares.get(owner, 0.0) + arc
    values = np.array([shares.get(r, 0.0) for r in replica_names(n)])
    return float(values.max() / values.mean())


def change_window(trace: Trace, base: np.ndarray, owner_before: list, owner_after: list, cache, pool, at: float,
                  window: float, label: str) -> dict:
    """Hit ratios in ``[at, at + window)`` when routing switches from ``owner_before`` to ``owner_after`` (per user)
    at time ``at``, against ``base`` (the per-request results without the switch)."""
    steady = np.array([not r.warmup for r in trace.requests])
    times = np.array([r.time for r in trace.requests])
    users = np.array([r.user for r in trace.requests])
    switched = steady & (times >= at)
    owner = [owner_after[u] if s else owner_before[u] for u, s in zip(users.tolist(), switched.tolist())]
    changed = simulate_routing(trace, owner, cache, pool, label)
    moved_users = np.array([b != a for b, a in zip(owner_before, owner_after)])
    in_window = switched & (times < at + window)
    moved = in_window & moved_users[users]
    first = np.zeros(len(users), dtype=bool)  # each moved user's first request after the switch
    seen: set[int] = set()
    for i in np.flatnonzero(moved_users[users] & switched).tolist():
        if users[i] not in seen:
            seen.add(int(users[i]))
            first[i] = True
    others = in_window & ~moved_users[users]
    return {"moved_users": int(moved_users.sum()), "users": len(owner_before),
            "window_requests": int(in_window.sum()), "moved_requests": int(moved.sum()),
            "hit_ratio": ratio(changed[in_window]), "hit_ratio_no_change": ratio(base[in_window]),
            "moved_hit_ratio": ratio(changed[moved]), "moved_hit_ratio_no_change": ratio(base[moved]),
            "moved_hit_ratio_after_first_request": ratio(changed[moved & ~first]),
            "others_hit_ratio": ratio(changed[others]), "others_hit_ratio_no_change": ratio(base[others]),
            "window_tokens": int(changed[in_window, 0].sum()),
            "missed_tokens": int(changed[in_window, 0].sum() - changed[in_window, 1:].sum()),
            "missed_tokens_no_change": int(base[in_window, 0].sum() - base[in_window, 1:].sum()),
            "moved_missed_tokens": int(changed[moved, 0].sum() - changed[moved, 1:].sum()),
            "moved_cold_tokens": int(changed[moved & first, 0].sum()),
            "others_missed_tokens": int(changed[others, 0].sum() - changed[others, 1:].sum()),
            "others_missed_tokens_no_change": int(base[others, 0].sum() - base[others, 1:].sum())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/scale_out.json")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--users-per-replica", type=int, default=100, help="of the hit-ratio simulations")
    parser.add_argument("--imbalance-users", type=int, default=PAPER_USERS, help="per replica, for the imbalance")
    parser.add_argument("--virtual-nodes", type=int, default=DEFAULT_VIRTUAL_NODES)
    parser.add_argument("--sweep", type=int, nargs="+", default=[50, 100, 200, 400, 600, 800, 1600],
                        help="virtual nodes")
    parser.add_argument("--target-replicas", type=int, default=8, help="imbalance <= 1.10 up to this N")
    parser.add_argument("--change-replicas", type=int, default=8, help="N of the removal and addition")
    parser.add_argument("--change-at", type=float, default=19_500.0, help="seconds into the trace")
    parser.add_argument("--window", type=float, default=3_600.0, help="seconds after the change")
    parser.add_argument("--workers", type=int, default=2, help="simulation processes (0: inline)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    settings = BenchSettings(device="cpu")
    scale = args.users_per_replica / PAPER_USERS
    cache = cache_config(settings, "hierarchical", num_gpu_pages=max(1, round(settings.gpu_pages * scale)),
                         host_budget_bytes=max(1, round(settings.host_budget_bytes * scale)))
    top = max(args.replicas + [args.change_replicas])

    # 1. Imbalance at the paper's users per replica: per-user request counts of top traces.
    counts = []
    for s in tqdm(range(max(args.replicas)), desc="imbalance traces", file=sys.stderr):
        trace = generate_trace(TraceConfig(num_users=args.imbalance_users, seed=s))
        counts.append(np.bincount([r.user for r in trace.requests], minlength=args.imbalance_users))
    sweep = sorted(set(args.sweep) | {args.virtual_nodes})
    by_nodes = {}
    for nodes in sweep:
        by_nodes[nodes] = {}
        for n in args.replicas:
            c = np.concatenate(counts[:n])
            by_nodes[nodes][n] = imbalance(c, HashRing(replica_names(n), nodes).route_many(range(len(c))), n)
    targeted = [n for n in args.replicas if 1 < n <= args.target_replicas]
    meeting = [v for v in sweep if all(by_nodes[v][n] <= 1.10 for n in targeted)]
    space = {v: {n: hash_space_imbalance(HashRing(replica_names(n), v), n) for n in args.replicas} for v in sweep}

    # 2. Hit ratio per N at users_per_replica.
    traces = [generate_trace(TraceConfig(num_users=args.users_per_replica, seed=s)) for s in range(top)]
    pool = None
    if args.workers:
        pool = concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
    hit, sim_imbalance, results, unadmitted = {}, {}, {}, {}
    for n in args.replicas:
        trace = merged_trace(traces[:n], args.users_per_replica)
        ring = HashRing(replica_names(n), args.virtual_nodes)
        owner_of_user = ring.route_many(range(len(trace.users)))
        owner = [owner_of_user[r.user] for r in trace.requests]
        per = simulate_routing(trace, owner, cache, pool, f"N={n}")
        steady = np.array([not r.warmup for r in trace.requests])
        hit[n] = ratio(per[steady])
        unadmitted[n] = int((per[:, 0] == 0).sum())  # too long for the scaled GPU pages: not in the ratios
        sim_imbalance[n] = imbalance(np.bincount([r.user for r in trace.requests]), owner_of_user, n)
        results[n] = (trace, ring, owner_of_user, per)

    # 3. Removal and addition at change_replicas.
    n = args.change_replicas
    if n in results:
        trace, ring, before, base = results[n]
    else:
        trace = merged_trace(traces[:n], args.users_per_replica)
        ring = HashRing(replica_names(n), args.virtual_nodes)
        before = ring.route_many(range(len(trace.users)))
        base = simulate_routing(trace, [before[r.user] for r in trace.requests], cache, pool, f"N={n}")
    removed = HashRing(replica_names(n), args.virtual_nodes)
    removed.remove(replica_names(n)[n // 2] if n > 1 else "r0")
    added = HashRing(replica_names(n + 1), args.virtual_nodes)
    window = {}
    if n > 1:
        window["removal"] = change_window(trace, base, before, removed.route_many(range(len(trace.users))), cache,
                                          pool, args.change_at, args.window, f"N={n} remove")
        window["removal"]["replica"] = replica_names(n)[n // 2]
    window["add"] = change_window(trace, base, before, added.route_many(range(len(trace.users))), cache, pool,
                                  args.change_at, args.window, f"N={n} add")
    window["add"]["replica"] = f"r{n}"
    if pool:
        pool.shutdown()

    command = "PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/scale_out.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    out = {"command": command.strip(),
           "imbalance": {str(k): round(v, 4) for k, v in by_nodes[args.virtual_nodes].items()},
           "hit_ratio": {str(k): v if v is None else round(v, 6) for k, v in hit.items()},
           "hit_ratio_after_removal": window.get("removal", {}).get("hit_ratio"),
           "hit_ratio_after_add": window["add"]["hit_ratio"],
           "hit_ratio_points_vs_1": {str(k): round((v - hit[min(hit)]) * 100, 4) for k, v in hit.items()
                                     if v is not None and hit[min(hit)] is not None},
           "removal": window.get("removal"), "add": window["add"],
           "imbalance_by_virtual_nodes": {str(v): {str(k): round(x, 4) for k, x in d.items()}
                                          for v, d in by_nodes.items()},
           "smallest_virtual_nodes_meeting_1_10": meeting[0] if meeting else None,
           "imbalance_target": f"<= 1.10 at 1 < N <= {args.target_replicas}",
           "hash_space_imbalance_by_virtual_nodes": {str(v): {str(k): round(x, 4) for k, x in d.items()}
                                                     for v, d in space.items()},
           "unadmitted_requests": {str(k): v for k, v in unadmitted.items()},
           "imbalance_simulated_users": {str(k): round(v, 4) for k, v in sim_imbalance.items()},
           "settings": {"virtual_nodes": args.virtual_nodes, "replicas": args.replicas,
                        "imbalance_users_per_replica": args.imbalance_users,
                        "users_per_replica": args.users_per_replica,
                        "scaled_down": f"hit ratios at {args.users_per_replica} users per replica (paper: "
                                       f"{PAPER_USERS}); GPU pages and host budget scaled by the same factor",
                        "cache": msgspec.to_builtins(cache),
                        "change_replicas": n, "change_at_s": args.change_at, "window_s": args.window,
                        "trace": "KuaiRand-like (gr_engine.bench.trace defaults), seeds 0..N-1, disjoint user ids",
                        "hit_ratio": "steady-state token hit ratio (GPU + host), as simulate_policy"},
           "seconds": round(time.perf_counter() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps({k: out[k] for k in ("imbalance", "hit_ratio", "hit_ratio_after_removal", "hit_ratio_after_add",
                                          "seconds")}, indent=1))


if __name__ == "__main__":
    main()
