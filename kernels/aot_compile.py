"""Compile every uvic_kernels Triton kernel / config for sm_90 without a GPU.

The launcher (uvic_kernels.launch.forward / backward) is run on CPU
tensors with the kernels replaced by recorders, so the argument lists are exactly
the launcher's.  Each recorded launch is then specialised by Triton's own binder
(the code a real launch runs) against a GPUTarget("cuda", 90, 32) backend and
compiled with triton.compile for every autotune config.  ptxas -v (sm_90a) on the
PTX gives registers / spills.

usage: TRITON_INTERPRET=0 python -m uvic_kernels.aot_compile [--dtypes fp16] [--dims 64]

Run as a program it compiles (never interprets) and caches under /tmp/aot/cache unless
TRITON_CACHE_DIR is set; importing it changes no environment variable.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ProcessPoolExecutor

if __name__ == "__main__":  # before triton is imported: it reads these once
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/aot/cache")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from uvic_kernels import launch, tiles
from uvic_kernels import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
H100_MAX_SMEM = 232448  # 227 KB opt-in per block
H100_SMS = 132

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = [32, 64, 72, 128]
MODES = tuple(ta.MODE_IDS)


class Recorder:
    def __init__(self, name, kernel):
        self.name, self.kernel, self.calls = name, kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))

        return launch


def record_launches(mode, head_dim, dtype, n_q=334, n_kv=334):
    names = ["_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"]
    saved = {n: getattr(ta, n) for n in names}
    recs = {n: Recorder(n, saved[n]) for n in names}
    cache = launch.CACHE
    try:
        launch.CACHE = False  # every launch through kernel[grid], i.e. to the recorders
        for n in names:
            setattr(ta, n, recs[n])
        q = torch.randn(2, 3, n_q, head_dim, dtype=dtype)
        k = torch.randn(2, 3, n_kv, head_dim, dtype=dtype)
        v = torch.randn_like(k)
        launch.forward(q, k, v, mode, head_dim**-0.5)
        lse = torch.zeros(2, 3, n_q)
        launch.backward(q, k, v, torch.randn_like(q), lse, torch.randn_like(q), mode,
                        head_dim**-0.5)
        # Delta has a kernel of its own only when dQ is not needed
        launch.backward(q, k, v, torch.randn_like(q), lse, torch.randn_like(q), mode,
                        head_dim**-0.5, need_dq=False)
    finally:
        launch.CACHE = cache
        for n in names:
            setattr(ta, n, saved[n])
    # sigmoid attention has no Delta: its backward never launches the Delta kernel
    return {n: r.calls[0] for n, r in recs.items() if r.calls}


def jit_fn(kernel):
    return kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel


KIND = {"_attn_fwd": "fwd", "_attn_bwd_dkdv": "dkdv", "_attn_bwd_dq": "dq"}


class FakeQ:
    """Stands in for the Q tensor in _prune: a CUDA tensor on an H100."""

    def __init__(self, dtype):
        self.dtype, self.is_cuda = dtype, True
        self.device = type("D", (), {"index": 0})()

    def element_size(self):
        return torch.empty(0, dtype=self.dtype).element_size()


def configs_of(kernel, kname, args, kwargs, dtype):
    """The configs the launcher can pick for this dtype, and which _prune keeps at N=334."""
    if not isinstance(kernel, triton.runtime.Autotuner):
        return [(triton.Config({}, num_warps=4, num_stages=3), True, True)]
    kind = KIND[kname]
    t16, t32 = tiles.TILES[kind]
    wanted = t32 if dtype == torch.float32 else t16
    cfgs = [c for c in kernel.configs if tiles.tile_of(c) in set(wanted)]
    named = dict(zip(kernel.fn.arg_names, args))
    named["Q"] = FakeQ(dtype)
    tiles.max_shared_mem = lambda index: H100_MAX_SMEM
    tiles.multiprocessor_count = lambda index: H100_SMS
    kept = tiles.prune(list(kernel.configs), named, kind=kind, **kwargs)
    kept_t = [tiles.tile_of(c) for c in kept]
    return [(c, tiles.tile_of(c) in kept_t, bool(kept_t) and tiles.tile_of(c) == kept_t[0])
            for c in cfgs]


def compile_one(job):
    kname, mode, dname, head_dim, cfg_kwargs, num_warps, num_stages, kept, first = job
    args, kwargs = record_launches(mode, head_dim, DTYPES[dname])[kname]
    kernel = getattr(ta, kname)
    fn = jit_fn(kernel)
    kw = dict(kwargs)
    kw.update(cfg_kwargs)
    kw.update(num_warps=num_warps, num_stages=num_stages)
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(
        BACKEND, kw, bound_args, specialization, options)
    row = dict(kernel=kname, mode=mode, dtype=dname, D=head_dim, **cfg_kwargs,
               warps=num_warps, stages=num_stages, kept=kept, first=first)
    if kname in KIND:
        block_d = launch._block_d(head_dim)
        tile = (cfg_kwargs["BLOCK_M"], cfg_kwargs["BLOCK_N"], num_stages, num_warps)
        row["smem_est"] = tiles.smem_bytes(KIND[kname], tile, block_d, DTYPES[dname].itemsize)
    try:
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                            options=options.__dict__)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        row["tb"] = traceback.format_exc()[-3000:]
        return row
    row["shared"] = ck.metadata.shared
    ptx = ck.asm["ptx"]
    # ptxas resource usage
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
        path = f.name
    arch = "sm_90a"
    res = subprocess.run([PTXAS, "-v", f"--gpu-name={arch}", path, "-o", path + ".cubin"],
                         capture_output=True, text=True)
    os.unlink(path)
    if os.path.exists(path + ".cubin"):
        os.unlink(path + ".cubin")
    out = res.stderr + res.stdout
    m = re.search(r"Used (\d+) registers", out)
    row["regs"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    row["spill_st"], row["spill_ld"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"(\d+) bytes stack frame", out)
    row["stack"] = int(m.group(1)) if m else None
    row["wgmma"] = "wgmma" in ptx
    row["mma"] = "mma.sync" in ptx
    row["ptxas_rc"] = res.returncode
    if res.returncode:
        row["error"] = out[-1500:]
    row["fits_h100"] = row["shared"] <= H100_MAX_SMEM
    return row


def jobs(dtypes, modes, head_dims, tile_list=None):
    out = []
    for mode, dname, head_dim in itertools.product(modes, dtypes, head_dims):
        launches = record_launches(mode, head_dim, DTYPES[dname])
        for kname, (args, kwargs) in launches.items():
            kernel = getattr(ta, kname)
            cfgs = configs_of(kernel, kname, args, kwargs, DTYPES[dname])
            if tile_list and isinstance(kernel, triton.runtime.Autotuner):
                cfgs = [(triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_stages=st, num_warps=w),
                         None, None) for m, n, st, w in tile_list]
            for c, kept, first in cfgs:
                out.append((kname, mode, dname, head_dim, dict(c.kwargs), c.num_warps, c.num_stages,
                            kept, first))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="fp16,bf16,fp32")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dims", default="32,64,72,128")
    p.add_argument("--kernels", default="")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tiles", default="", help="M,N,stages,warps;... for the autotuned kernels")
    p.add_argument("--json", default="runs/aot/results.json")
    a = p.parse_args()
    tile_list = ([tuple(int(x) for x in t.split(",")) for t in a.tiles.split(";")]
                 if a.tiles else None)
    todo = jobs(a.dtypes.split(","), a.modes.split(","), [int(x) for x in a.dims.split(",")],
                tile_list)
    if a.kernels:
        todo = [j for j in todo if j[0] in a.kernels.split(",")]
    print(f"{len(todo)} compilations", file=sys.stderr)
    with ProcessPoolExecutor(a.workers) as ex:
        rows = list(ex.map(compile_one, todo))
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=1)
    bad = 0
    for r in rows:
        flag = ""
        if "error" in r:
            flag = "ERROR"
            bad += 1
        elif r["spill_st"] or not r["fits_h100"]:
            flag = "SPILL/SMEM"
        if r.get("smem_est") is not None and r.get("shared") and r["smem_est"] < r["shared"]:
            flag += " EST<SMEM"
        flag += " kept" if r["kept"] else ""
        flag += " FIRST" if r["first"] else ""
        print(f"{r['kernel']:22s} {r['mode']:7s} {r['dtype']} D={r['D']:3d} "
              f"M={r.get('BLOCK_M', '-')!s:>3} N={r.get('BLOCK_N', '-')!s:>3} "
              f"w={r['warps']} s={r['stages']} smem={r.get('shared')} regs={r.get('regs')} "
              f"spill={r.get('spill_st')}/{r.get('spill_ld')} "
              f"wgmma={r.get('wgmma')} {flag}")
        if "error" in r:
            print("   ", r["error"][-600:].replace("\n", "\n    "))
    print(f"{len(rows)} compiled, {bad} errors", file=sys.stderr)


if __name__ == "__main__":
    main()
