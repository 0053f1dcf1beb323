"""The tensor-core FP8 GEMV (kernels/fp8_gemv_tc.py) compiled for sm_90 without a GPU, its SASS
written out: where the prologues' loads issue against their math, barriers and stores (session
36 found two to five dependent L2 round trips after the PDL wait this way; docs/design.md).

    python -m bench.lab.sass_tc PROLOGUE KTS SPLIT STAGES GROUP [SPLITS] [--out DIR]
    # e.g. 1 4 8 8 4 (Qwen3-8B's q/k/v: norm, 4 tiles a CTA, 8 K splits, 8 stages, 4 in flight)
    #      1 8 4 12 4 (gate_up), 2 8 12 12 4 (down: silu), 3 4 8 8 4 16 (o_proj: merge, 16 splits)

Pointers carry the 16-byte alignment the launcher's arguments get, so loads vectorize as on
the GPU. Prints the prologue's global loads, stores, shuffles and barriers after the PDL wait
(ACQBULK) in issue order; DIR gets the cubin and the full SASS (cuobjdump from Triton's
bundled CUDA tools). `diag_decode --cubins` writes the cubins a GPU run compiled.
"""
from __future__ import annotations

import argparse
import os
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from pdserve.kernels import fp8_gemv_tc as tc

DESC = ("tensordesc<fp8e4nv[64, 128],NVMMASharedLayout(swizzle_byte_width=128, "
        "element_bitwidth=8, rank=2, transposed=False, fp4_padded=False, cga_layout=[])>")
SIGNATURE = {"w_desc": DESC, "x_ptr": "*fp32", "nw_ptr": "*bf16", "res_ptr": "*fp32",
             "s_ptr": "*fp32", "out_ptr": "*fp32", "add_ptr": "*fp32", "z1_ptr": "*fp32",
             "z1_n": "i32", "z2_ptr": "*fp32", "z2_n": "i32", "lse_ptr": "*fp32",
             "len_ptr": "*i32", "N": "i32", "stride_s": "i32", "eps": "fp32"}
SHOWN = ("LDG", "STG", "RED", "SHFL", "BAR.SYNC", "STS", "HGMMA", "MUFU")


def compile_sm90(prologue: int, kts: int, split: int, stages: int, group: int,
                 splits: int) -> bytes:
    """The cubin of one specialisation: q/k/v's ("norm" with 4 tiles a CTA) copies the
    residual (RES_OUT), as the decoder's launch does."""
    fn = tc._fp8_gemv_tc_kernel
    k = kts * split * 128
    const = dict(K=k, KTS=kts, SPLIT=split, STAGES=stages, GROUP=group, PROLOGUE=prologue,
                 HAS_ADD=True, RES_OUT=prologue == 1 and kts == 4, ZCH=128, HAS_Z=True,
                 PREFILL=stages, KROW=triton.next_power_of_2(k), SPLITS=splits, HD=128,
                 KEYS=64)
    sig = {**SIGNATURE, **{name: "constexpr" for name in const}}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in SIGNATURE.items()
             if t.startswith("*") or a in ("N", "stride_s")}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()},
                         attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": 128}).asm["cubin"]


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("prologue", "kts", "split", "stages", "group"):
        ap.add_argument(name, type=int)
    ap.add_argument("splits", type=int, nargs="?", default=1)
    ap.add_argument("--out", default="/tmp/sass_tc")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stem = f"{args.out}/tc_p{args.prologue}_k{args.kts}_s{args.split}"
    with open(f"{stem}.cubin", "wb") as f:
        f.write(compile_sm90(args.prologue, args.kts, args.split, args.stages, args.group,
                             args.splits))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f"{stem}.cubin"],
                          check=True, capture_output=True, text=True, timeout=120).stdout
    with open(f"{stem}.sass", "w") as f:
        f.write(sass)
    after_wait = sass.split("ACQBULK", 1)[-1].splitlines()
    shown = [line.split(";")[0].split("*/")[-1].strip() for line in after_wait
             if any(op in line for op in SHOWN)]
    print(f"{stem}.sass; after the PDL wait, in issue order:")
    print("\n".join(shown[:60]))


if __name__ == "__main__":
    main()
