"""How pdserve's Triton kernels are built, and the argument checks every launcher shares.

Kernels are compiled for CUDA when a GPU is present. Without one (CI, laptops) they run in
Triton's interpreter (numpy, one program at a time), which Triton only enables when
TRITON_INTERPRET=1 is in the environment before triton is first imported; entry points choose
that by calling kernels/triton_mode.select_triton_mode() (importing this module never touches
the environment). If triton was imported in the wrong mode, launchers raise an error that says
so. Triton 3.6's interpreter breaks on numpy >= 2.4 (loop bounds: triton-lang/triton#9171,
fixed after 3.6), so pyproject pins numpy < 2.4 rather than patch it.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Fixed at import: every kernel below is decorated in this mode (triton.jit reads the knob).
INTERPRET = bool(triton.knobs.runtime.interpret)
jit = triton.jit


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter instead of compiled for CUDA."""
    return INTERPRET


def interpreter_problem() -> str | None:
    """Why kernels cannot run on this machine, or None when they can."""
    if not INTERPRET:
        return None if torch.cuda.is_available() else (
            "no CUDA device, and triton was imported in compiled mode: call "
            "pdserve.kernels.triton_mode.select_triton_mode() before anything imports triton, "
            "or set TRITON_INTERPRET=1 in the environment")
    if type(tl.standard.sum).__name__ != "InterpretedFunction":
        return ("TRITON_INTERPRET=1 was set after triton was imported, so triton's own library "
                "functions are not interpretable; set TRITON_INTERPRET=1 in the environment "
                "before the process starts (or call select_triton_mode() before anything imports triton)")
    return None


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch arguments for programmatic dependent launch (Hopper+; CUDA graphs keep it): the
    kernel may be scheduled while the previous one drains, and waits for it (gdc_wait) at
    entry, before touching memory, so correctness never depends on what came before. Kernels
    take a USE_PDL constexpr and call pdl_enter(USE_PDL) first."""
    on = not INTERPRET and t.is_cuda and _pdl_capable(t.device.index or 0)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}


@jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's memory, then let the next kernel get scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@jit
def _prefetch_l2(addr):
    """prefetch.global.L2 of the 128-byte line holding each int64 address in addr: fire and
    forget (holds no register, waits for nothing). Compiled kernels only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def l2_prefetch_rows(w_ptr, offs_n, N, K, stride_w, part, num_parts,
                     LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for rows offs_n of W [N, K], columns from part * ceil(K / num_parts) on, LINES
    cache lines of LINE elements (128 bytes) each. Addresses are clamped into W, so edge
    programs only fetch lines again. Meant for before a PDL wait behind a latency-bound
    kernel, which leaves HBM idle (kernels.gemv)."""
    start = part * tl.cdiv(K, num_parts)
    cols = tl.minimum(start + tl.arange(0, LINES) * LINE, K - 1)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    _prefetch_l2((w_ptr + rows[:, None] * stride_w + cols[None, :]).to(tl.int64, bitcast=True))


def prefetch_lines(K: int, num_parts: int, share: float, elem_size: int) -> int:
    """LINES for l2_prefetch_rows: a power of two covering `share` of a part's K columns."""
    if share <= 0:
        return 0
    per_line = 128 // elem_size
    return next_pow2(max(1, round(share * triton.cdiv(triton.cdiv(K, num_parts), per_line))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to TF32 in tl.dot (10-bit mantissa breaks 1e-4 checks)."""
    return "ieee" if dtype == torch.float32 else "tf32"


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand type for tl.dot: the storage type on GPU. The interpreter keeps bf16 as raw
    uint16 bits and multiplies those in tl.dot (its documented lack of bf16 support), so there
    bf16 operands are widened to fp32 first -- exact for bf16 values, fp32 accumulate either way."""
    if INTERPRET and dtype == torch.bfloat16:
        return tl.float32
    return _TL_DTYPES[dtype]


def check_tensor(name: str, t: object, *, ndim: int | None = None,
                 shape: Sequence[int | None] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, last_contiguous: bool = False) -> torch.Tensor:
    """Validate one launcher argument; the ValueError/TypeError names it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (all arguments on one device)")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride 1), strides {t.stride()}")
    return t


def check_launchable(name: str, t: torch.Tensor) -> None:
    """Compiled kernels need CUDA memory; the interpreter takes host or device tensors."""
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(f"Triton kernels unavailable: {problem}")
    if not INTERPRET and t.device.type != "cuda":
        raise ValueError(f"{name}: on {t.device}; compiled Triton kernels need CUDA tensors "
                         "(set TRITON_INTERPRET=1 to run them on CPU)")


def check_head_dim(name: str, head_dim: int) -> None:
    if not is_pow2(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"{name}: head_dim {head_dim} must be a power of 2 in [16, 256]")


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
_SCRATCH: dict[torch.device, list[torch.Tensor]] = {}


def _grown(pool: dict[torch.device, list[torch.Tensor]], device: torch.device, n: int,
           dtype: torch.dtype, what: str) -> torch.Tensor:
    bufs = pool.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}: {n} elements needed during CUDA-graph capture; run "
                               "the batch eagerly once first")
        bufs.append(torch.zeros(max(n, 1 << 16), dtype=dtype, device=device))
    return bufs[-1]


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros for kernels whose last-arriving program finishes a reduction (split-K
    decode attention, split-K GEMV): how many programs of a group have stored their partial.
    That program resets its counter, so the buffer is zero between launches (launches on one
    device are stream-ordered; a PDL launch touches it only after its wait). Allocated once
    per device, before any CUDA-graph capture (the warm-up runs first); buffers a graph may
    hold stay alive."""
    return _grown(_COUNTERS, device, n, torch.int32, "arrival counters")


def scratch_fp32(device: torch.device, n: int) -> torch.Tensor:
    """fp32 scratch for split-K partials (written before they are read in the same launch),
    shared by every launch on the device, under the same rules as arrival_counters."""
    return _grown(_SCRATCH, device, n, torch.float32, "split-K scratch")
