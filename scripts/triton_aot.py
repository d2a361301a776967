"""Ahead-of-time sm_90 compilation of Triton kernels without a GPU, shared by the
scripts/triton_*_sm90*.py reports: signatures from argument names, the divisibility the
launchers' specialisation sees, the compile call, and ptxas / nvdisasm from the triton
package (registers, spills, SASS loop lengths). Imports no minipaged module.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# opt-in shared memory per block on sm_90 (H100/H200): a kernel above it fails at launch
SM90_MAX_SHARED = 232448
ELEM = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8e4nv", "fp32": "fp32"}


def signature(fn, constexprs: dict, pointer_types: dict) -> dict:
    """Triton signature of `fn`: constexprs by name, pointers from `pointer_types`
    (argument name -> element type, e.g. "bf16"), qk_scale_log2 fp32, every other int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = f"*{pointer_types[name]}"
        elif name == "qk_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def divisible16(fn, constexprs: dict, names) -> dict:
    """The tt.divisibility=16 attributes of the (non-constexpr) arguments in `names`."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
            if n in names and n not in constexprs}


def compile_sm90(fn, sig: dict, constexprs: dict, attrs: dict, num_warps: int, num_stages: int, **options):
    """options: more compile options, as a launch passes them (e.g. enable_fp_fusion=False).
    A constexpr parameter left out of `constexprs` takes its default, as at a launch (signature()
    alone would make it a runtime int and compile both sides of every branch on it)."""
    defaults = {p.name: p.default for p in fn.params
                if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}
    sig = {**sig, **dict.fromkeys(defaults, "constexpr")}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


def programs_per_sm(regs_per_thread: int, num_warps: int, shared_bytes: int) -> int:
    """Resident programs of a kernel per sm_90 SM: registers are allocated in units of 256 per
    warp (a 102-register thread costs its warp 104 x 32), shared memory in 228 KB with 1 KB
    reserved per program."""
    warp_regs = -(-regs_per_thread * 32 // 256) * 256
    return min(65536 // (warp_regs * num_warps), (228 * 1024) // (shared_bytes + 1024))


def kv_in_flight(k, regs, num_warps: int, block_n: int, elem: str, tile_bytes: int) -> str:
    """'buffers=.. programs/SM=.. KV KB in flight/SM=..' of compiled kernel `k`: its K/V tile
    buffers are the leading dimension of the TTGIR's memdesc<N x block_n x .. x elem> (the
    pipeliner's ring), tile_bytes one K plus one V tile."""
    bufs = max([int(n) for n in re.findall(rf"memdesc<(\d+)x{block_n}x\d+x{elem}", k.asm["ttgir"])] or [0])
    programs = programs_per_sm(regs, num_warps, k.metadata.shared) if isinstance(regs, int) else 0
    return f"buffers={bufs} programs/SM={programs} KV KB in flight/SM={programs * bufs * tile_bytes // 1024}"


def tool(name: str) -> str | None:
    """`name` (ptxas, nvdisasm) from the triton package, or None."""
    import triton.backends.nvidia as nv

    path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    return path if os.access(path, os.X_OK) else None


def ptxas_usage(ptx: str, toolkit_fallback: bool = False) -> dict:
    """{"regs", "spill_bytes"} from ptxas -v (sm_90a): triton's ptxas, then (toolkit_fallback)
    the one on PATH; {} when none is there, regs None when none reads this PTX version."""
    tools = [tool("ptxas")] + ([shutil.which("ptxas")] if toolkit_fallback else [])
    tools = [t for t in tools if t]
    if not tools:
        return {}
    for ptxas in tools:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            res = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
        text = res.stdout + res.stderr
        regs = re.search(r"Used (\d+) registers", text)
        if regs:
            spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", text)
            return {"regs": int(regs.group(1)), "spill_bytes": sum(map(int, spills))}
    return {"regs": None, "spill_bytes": None}


def _sass(cubin: bytes) -> tuple[list[str], list[tuple[int, int]]] | None:
    """(instructions, backward-branch loops as (first, last) instruction indices) of the SASS,
    or None without triton's nvdisasm."""
    nvdisasm = tool("nvdisasm")
    if nvdisasm is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True)
    labels, ins, loops = {}, [], []
    for line in res.stdout.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    for j, text in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), j + 1) < j:
            loops.append((labels[m.group(1)], j))
    return ins, loops


def sass_loops(cubin: bytes) -> list[int]:
    """Instruction counts of the backward-branch loops in the SASS, in program order
    ([] without triton's nvdisasm)."""
    sass = _sass(cubin)
    return [] if sass is None else [last + 1 - first for first, last in sass[1]]


def sass_report(cubin: bytes) -> dict:
    """From one disassembly: the loops' instruction counts (sass_loops), the local-memory
    (spill) instructions in each loop and in all, and the index of the second global load, how
    long a program computes before its first data load past the first (a decode program's
    context length) is issued. Only {"sass_loops": []} without triton's nvdisasm."""
    sass = _sass(cubin)
    if sass is None:
        return {"sass_loops": []}
    ins, loops = sass
    local = [bool(re.search(r"\b(LDL|STL)", t)) for t in ins]
    loads = [i for i, t in enumerate(ins) if re.search(r"\bLDG", t)]
    return {"sass_loops": [last + 1 - first for first, last in loops],
            "local_in_loops": [sum(local[a:b + 1]) for a, b in loops], "local_total": sum(local),
            "second_load_at": loads[1] if len(loads) > 1 else None}


def compiled_info(k, num_warps: int, num_stages: int, loops: bool = False) -> dict:
    """What the sm_90 reports print for one compiled kernel: shared memory, warps, stages,
    wgmma and cp.async counts of its PTX, ptxas registers / spills, and (loops) the SASS
    loop lengths."""
    ptx = k.asm["ptx"]
    info = {"shared": k.metadata.shared, "warps": num_warps, "stages": num_stages,
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "cp_async": len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))}
    info.update(ptxas_usage(ptx))
    if loops:
        info["sass_loops"] = sass_loops(k.asm["cubin"]) if "cubin" in k.asm else []
    return info


def report_line(name: str, info: dict) -> str:
    """'ok  name: key=value ...', or 'SMEM ...' when the kernel needs more shared memory than sm_90 has."""
    ok = "ok  " if info["shared"] <= SM90_MAX_SHARED else "SMEM"
    return f"{ok} {name}: " + " ".join(f"{a}={b}" for a, b in info.items())

