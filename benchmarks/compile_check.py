"""The engine's Triton kernels compiled for the H200 on a machine without a GPU: registers, spills, shared memory.

    python benchmarks/compile_check.py [--sass] [--out compile_check.json]

Triton's compiler and the ``ptxas`` shipped in the triton wheel build each kernel for sm_90 at the shapes the engine
launches for the bench's model (bf16, 4 heads x 128, pages of 32 tokens, d_model 512): ``hstu_triton``'s attention in
its default launch shape, with a time bias and in decode tiles (two programs an SM), and the 64 x 64 shape
``tile_sweep.py`` times two programs an SM; the append; the LayerNorm (with and without the residual shift), the
gate and the projection with its SiLU (both tile shapes); the device tile plan of a cold visit's and a serving step's
graph. For each: ``ptxas -v``'s registers, spill
stores and loads (bytes), the shared memory and how many programs fit on an SM (:func:`programs_per_sm`); with
``--sass``, how many local-memory loads and stores (``LDL``/``STL``, spills) sit in the basic blocks that hold the MMAs
(``HGMMA``: the key loops). A kernel that does not compile is reported with its error. No GPU is needed, so compile
errors and spills show before a device session; how fast a kernel runs still takes the GPU (``tile_sweep.py``).

It must import Triton without ``TRITON_INTERPRET`` (it removes the variable before importing anything).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: compiled kernels, not the interpreter

import argparse
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attention_backends import AttentionSpec
from attention_backends import hstu_triton_device_plan as device_plan
from attention_backends import hstu_triton_kernels as attention
from attention_backends.hstu_triton_plan import (
    MIN_TILES_PER_SPLIT,
    SPLIT_OVERHEAD_KEYS,
    TileConfig,
    default_tile_config,
    own_rows_block_n,
    padded_capacities,
)
from gr_engine.models import fused_linear, fused_ops

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HEADS, DIM, PAGE, D_MODEL = 4, 128, 32, 512
SPEC = AttentionSpec(kind="hstu", num_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.bfloat16,
                     device_type="cuda", alpha=DIM**-0.5, scaling_seqlen=20_000)


@dataclass
class Build:
    """One kernel at one shape: ``types`` maps argument names to Triton types (pointers ``*bf16``, ``fp32``; every
    other non-constexpr argument is ``i32``), ``constants`` the constexpr values (and integers Triton specialises as
    equal to 1), ``divisible`` the arguments Triton finds divisible by 16 at the engine's launches."""

    label: str
    kernel: Any
    types: dict[str, str]
    constants: dict[str, Any]
    num_warps: int
    num_stages: int = 1
    divisible: tuple[str, ...] = ()
    fp_fusion: bool = True
    report: dict[str, Any] = field(default_factory=dict)

    def source(self) -> ASTSource:
        names = self.kernel.arg_names
        signature = {n: "constexpr" if n in self.constants else self.types.get(n, "i32") for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in self.divisible}
        return ASTSource(self.kernel, signature, self.constants, attrs)


def attention_builds() -> list[Build]:
    """``hstu_paged_attention_kernel`` in the engine's launch shapes for the bench's model."""
    types = {**dict.fromkeys(("Q", "K", "V", "KV", "Out", "TimeBias"), "*bf16"), "Partial": "*fp32",
             **dict.fromkeys(("Tiles", "Items", "QueryStartLoc", "NumHistory", "SeqLens", "KvIndptr", "KvIndices",
                              "QueryTimes", "KeyTimes", "KeyStart"), "*i32"),
             "alpha": "fp32", "inv_scaling": "fp32"}
    divisible = ("Q", "K", "V", "KV", "Out", "Partial", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                 "stride_vt", "stride_vh", "stride_page", "stride_kv", "stride_token", "stride_head", "stride_ot",
                 "stride_oh")

    def build(label: str, tiles: TileConfig, **changes: Any) -> Build:
        constants = {"HEAD_DIM": DIM, "PAGE_SIZE": PAGE, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                     "FAST_SILU": True, "PRECISION": "tf32", "TIME_BIAS": False, "DENSE": False, **changes}
        # the dense read's TMA descriptors (else placeholders, never read)
        block = f"tensordesc<bf16[{tiles.block_n},{DIM}]>" if constants["DENSE"] else "*bf16"
        return Build(label, attention.hstu_paged_attention_kernel, types | {"KDesc": block, "VDesc": block},
                     constants, tiles.num_warps, tiles.num_stages, divisible)

    default = default_tile_config(SPEC)
    biased = default_tile_config(AttentionSpec(**{**SPEC.__dict__, "time_bias_buckets": 32}))
    return [
        build("attention", default),
        build("attention, new rows read densely (attend_new_rows)",
              replace(default, block_n=own_rows_block_n(default)), DENSE=True),
        build("attention time bias", biased, TIME_BIAS=True),
        build("attention decode tiles", default_tile_config(SPEC, max_query_len=20)),
        build("attention 64 x 64, 4 warps, 3 stages (tile_sweep.py's two an SM)", TileConfig(64, 64, 4, 3, 2)),
    ]


def layer_builds() -> list[Build]:
    """The append, the row-wise kernels and the projection with its SiLU of an HSTU layer of the bench's model."""
    append = Build("append", attention._append_kernel,
                   dict.fromkeys(("Cache", "Key", "Value"), "*bf16") | dict.fromkeys(("Rows", "Pages", "Entries"),
                                                                                      "*i32"),
                   {"NUM_HEADS": HEADS, "HEADS_POW2": HEADS, "HEAD_DIM": DIM, "ROWS": attention.APPEND_ROWS,
                    "stride_kd": 1, "stride_vd": 1, "stride_dim": 1},
                   attention.APPEND_WARPS, 1,
                   ("Cache", "Key", "Value", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_page",
                    "stride_kv", "stride_token", "stride_head"))
    block, rows = fused_ops._tile(D_MODEL)
    norm_types = dict.fromkeys(("X", "Weight", "Bias", "Out", "Shift", "Shifted"), "*bf16") | {"eps": "fp32"}
    gate_types = dict.fromkeys(("Attn", "U", "Weight", "Bias", "Out"), "*bf16") | {"eps": "fp32"}
    builds = [append]
    for shift in (True, False):
        builds.append(Build(f"layer norm (shift {shift})", fused_ops._layer_norm_kernel, norm_types,
                            {"N": D_MODEL, "BLOCK": block, "ROWS": rows, "SHIFT": shift}, fused_ops.NUM_WARPS, 1,
                            ("X", "Out", "Shifted", "stride_x", "stride_out")))
    for concat in (False, True):
        builds.append(Build(f"gate (concat_ua {concat})", fused_ops._gated_layer_norm_kernel, gate_types,
                            {"N": D_MODEL, "BLOCK": block, "ROWS": rows, "CONCAT_UA": concat},
                            fused_ops.NUM_WARPS, 1, ("Attn", "U", "Out", "stride_attn", "stride_u", "stride_out")))
    for block_m in (fused_linear.BLOCK_M, fused_linear.SMALL_BLOCK_M):  # the projection with its SiLU, both shapes
        descriptors = {"x_desc": f"tensordesc<bf16[{block_m},{fused_linear.BLOCK_K}]>",
                       "w_desc": f"tensordesc<bf16[{fused_linear.BLOCK_N},{fused_linear.BLOCK_K}]>",
                       "out_desc": f"tensordesc<bf16[{block_m},{fused_linear.BLOCK_N}]>", "Bias": "*bf16"}
        builds.append(Build(f"projection with SiLU ({block_m}-row tiles)", fused_linear._linear_silu_kernel,
                            descriptors, {"N": 4 * D_MODEL, "K": D_MODEL, "BLOCK_M": block_m,
                                          "BLOCK_N": fused_linear.BLOCK_N, "BLOCK_K": fused_linear.BLOCK_K,
                                          "GROUP_M": fused_linear.GROUP_M, "NUM_STAGES": fused_linear.NUM_STAGES},
                            fused_linear.NUM_WARPS, fused_linear.NUM_STAGES, ("Bias",)))
    return builds


def plan_builds(num_sms: int = 132) -> list[Build]:
    """The device tile plan (``hstu_triton_device_plan``) of the graph buckets a cold 8,192-event visit (8,704 rows,
    one request) and a serving step (4,096 rows, 64 requests) replay on an H200, the default launch shape."""
    tiles = default_tile_config(SPEC)
    builds = []
    for label, rows, requests in (("cold visit", 8704, 1), ("serving step", 4096, 64)):
        num_tiles, num_items = padded_capacities(rows, requests, tiles.block_m, HEADS,
                                                 num_sms * tiles.programs_per_sm)
        constants = device_plan.plan_constants(requests, tiles, num_tiles, num_items, HEADS, num_sms,
                                               SPLIT_OVERHEAD_KEYS, MIN_TILES_PER_SPLIT)
        builds.append(Build(f"device plan ({label}: {rows} rows, {requests} requests)", device_plan._plan_kernel,
                            dict.fromkeys(("QueryStartLoc", "NumHistory", "SeqLens", "Plan"), "*i32"), constants,
                            device_plan.PLAN_WARPS, fp_fusion=False))
    return builds


def compile_one(build: Build, sass: bool) -> dict[str, Any]:
    """Compile ``build`` for sm_90 and read ``ptxas -v`` (and, with ``sass``, the cubin's SASS)."""
    try:
        compiled = triton.compile(build.source(), target=TARGET,
                                  options={"num_warps": build.num_warps, "num_stages": build.num_stages,
                                           "enable_fp_fusion": build.fp_fusion})
    except Exception as exc:  # a kernel that does not compile for the GPU: the point of the check
        return {"label": build.label, "ok": False, "error": str(exc)[:1000]}
    report: dict[str, Any] = {"label": build.label, "ok": True, "num_warps": build.num_warps,
                              "num_stages": build.num_stages, "shared_bytes": compiled.metadata.shared}
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx) + ".o"],
                              capture_output=True, text=True).stderr
        for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_store_bytes", r"(\d+) bytes spill stores"),
                             ("spill_load_bytes", r"(\d+) bytes spill loads")):
            match = re.search(pattern, info)
            report[key] = int(match.group(1)) if match else None
        report["programs_per_sm"] = programs_per_sm(report["registers"], report["shared_bytes"], build.num_warps)
        if sass:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            listing = subprocess.run([str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
            report.update(loop_locals(listing))
    return report


def programs_per_sm(registers: int | None, shared_bytes: int, num_warps: int) -> int | None:
    """How many programs of a kernel fit on one H200 SM at once: 65,536 registers (allocated to each warp in
    units of 256, i.e. 8 a thread), 228 KB of shared memory (1 KB more reserved a program), 64 warps."""
    if registers is None:
        return None
    by_registers = 65_536 // (-(-registers // 8) * 8 * 32 * num_warps)
    by_shared = 228 * 1024 // (shared_bytes + 1024)
    return min(by_registers, by_shared, 64 // num_warps)


def loop_locals(listing: str) -> dict[str, Any]:
    """From an ``nvdisasm -c`` listing: local-memory loads and stores (``LDL``/``STL``) in all and in the basic blocks
    (``.L_x_N:`` labels) that hold ``HGMMA`` instructions (the key loops), and per such block its instruction count,
    special-function operations (``MUFU``) and conversions (``F2F``/``F2FP``/``HADD2.F32``)."""
    blocks: list[dict[str, int]] = [{"local": 0, "mma": 0, "instructions": 0, "mufu": 0, "conversions": 0}]
    for line in listing.splitlines():
        if re.match(r"^\s*\.L_x_\d+:", line):
            blocks.append({"local": 0, "mma": 0, "instructions": 0, "mufu": 0, "conversions": 0})
        elif re.search(r"/\*[0-9a-f]{4}\*/", line):
            block = blocks[-1]
            block["instructions"] += 1
            block["local"] += bool(re.search(r"\b(LDL|STL)\b", line))
            block["mma"] += "HGMMA" in line
            block["mufu"] += bool(re.search(r"\bMUFU\b", line))
            block["conversions"] += bool(re.search(r"\b(F2FP?|HADD2\.F32)\b", line))
    loops = [b for b in blocks if b["mma"]]
    return {"local_ops": sum(b["local"] for b in blocks), "local_ops_in_mma_blocks": sum(b["local"] for b in loops),
            "mma_blocks": [{k: b[k] for k in ("instructions", "mma", "mufu", "conversions", "local")} for b in loops]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="count spills inside the MMA loops (nvdisasm)")
    parser.add_argument("--out", default=None, help="write the reports as JSON")
    args = parser.parse_args(argv)
    reports = [compile_one(build, args.sass) for build in attention_builds() + layer_builds() + plan_builds()]
    for r in reports:
        if not r["ok"]:
            print(f"{r['label']}: FAILED {r['error'][:300]}")
            continue
        loop = f", local ops {r['local_ops']} ({r['local_ops_in_mma_blocks']} in MMA loops)" if args.sass else ""
        print(f"{r['label']}: {r['registers']} registers, spills {r['spill_store_bytes']} B stored / "
              f"{r['spill_load_bytes']} B loaded, {r['shared_bytes']} B shared, {r['programs_per_sm']} an SM{loop}")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90", "triton": triton.__version__, "kernels": reports},
                                             indent=2))
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
