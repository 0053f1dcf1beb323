"""GPU micro-benchmarks of the kernels at 8B-model shapes: `python -m bench.lab.kernel_bench [--out F]`.

Decode attention is reported as achieved KV bandwidth (bytes of K and V read / time, timed as
CUDA-graph replays like the engine's decode) next to a device-to-device copy's; prefill
attention as causal TFLOP/s next to torch SDPA (flash) on contiguous K/V; the elementwise
kernels as GB/s (graph replays too). Needs CUDA; prints one JSON object.
"""
from __future__ import annotations

import argparse
import json

import torch

HQ, HKV, D, BS, LAYERS = 32, 8, 128, 16, 4  # Llama-3-8B / Qwen3-8B attention shape


def _time_us(fn, graph: bool = False) -> float:
    """GPU time per call in us. graph=True replays a CUDA graph of the call, as the engine's
    decode does, so host-side launch cost (tens of us per Triton launch) is left out."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()  # compile outside the timing (and the graph capture)
    if graph:
        return do_bench_cudagraph(fn, rep=100) * 1e3
    return do_bench(fn, warmup=25, rep=100) * 1e3


def _paged(seq_lens: list[int], dtype: torch.dtype):
    """A multi-layer cache (big block stride, as in the engine) with shuffled block tables."""
    need = [-(-s // BS) for s in seq_lens]
    kv = torch.randn(sum(need), LAYERS, 2, BS, HKV, D, device="cuda", dtype=dtype)
    order = torch.randperm(sum(need)).tolist()
    width, rows, used = max(need), [], 0
    for n in need:
        rows.append(order[used:used + n] + [0] * (width - n))
        used += n
    tables = torch.tensor(rows, dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return kv[:, 1, 0], kv[:, 1, 1], tables, lens


def bench_copy() -> dict:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = _time_us(lambda: y.copy_(x))
    return {"bytes": 2 * x.numel(), "us": us, "GBps": 2 * x.numel() / us / 1e3}


def bench_decode(dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    from pdserve.kernels.ops import paged_decode_attention

    rows = []
    for batch in (1, 8, 32, 64):
        for ctx in (1024, 4096, 10240):
            k, v, tables, lens = _paged([ctx] * batch, dtype)
            q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
            us = _time_us(lambda: paged_decode_attention(q, k, v, tables, lens, D ** -0.5),
                          graph=True)
            nbytes = 2 * batch * ctx * HKV * D * k.element_size()
            rows.append({"batch": batch, "context": ctx, "us": round(us, 2),
                         "GBps": round(nbytes / us / 1e3, 1)})
    return rows


def bench_prefill(dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    from pdserve.kernels.ops import paged_prefill_attention

    rows = []
    for prompt in (1024, 4096, 10240):
        k, v, tables, lens = _paged([prompt], dtype)
        q = torch.randn(prompt, HQ, D, device="cuda", dtype=dtype)
        qsl = torch.tensor([0, prompt], dtype=torch.int32, device="cuda")
        us = _time_us(lambda: paged_prefill_attention(q, k, v, qsl, lens, tables, prompt,
                                                      D ** -0.5))
        flops = 2 * 2 * HQ * D * prompt * prompt / 2  # QK^T and PV over the causal half
        # Baseline: flash SDPA on contiguous [1, H, T, D] K/V (no paging, no gather).
        qc = q.transpose(0, 1)[None]
        kc = torch.randn(1, HKV, prompt, D, device="cuda", dtype=dtype)
        sdpa = _time_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            qc, kc, kc, is_causal=True, enable_gqa=True))
        rows.append({"prompt": prompt, "us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1),
                     "sdpa_us": round(sdpa, 1), "sdpa_TFLOPs": round(flops / sdpa / 1e6, 1)})
    return rows


def bench_elementwise(dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    from pdserve.kernels.ops import fused_add_rmsnorm, fused_qk_norm_rope_kv, silu_and_mul
    from pdserve.kernels.reference import rope_cos_sin

    rows = []
    for T in (1, 64, 8192):
        x = torch.randn(T, 4096, device="cuda", dtype=dtype)
        r, w = torch.randn_like(x), torch.ones(4096, device="cuda", dtype=dtype)
        us = _time_us(lambda: fused_add_rmsnorm(x, r, w, 1e-6), graph=True)
        rows.append({"kernel": "add_rmsnorm", "T": T, "us": round(us, 2),
                     "GBps": round(4 * x.numel() * 2 / us / 1e3, 1)})
        g = torch.randn(T, 2 * 14336, device="cuda", dtype=dtype)
        us = _time_us(lambda: silu_and_mul(g), graph=True)
        rows.append({"kernel": "silu_and_mul", "T": T, "us": round(us, 2),
                     "GBps": round(1.5 * g.numel() * 2 / us / 1e3, 1)})
        qkv = torch.randn(T, (HQ + 2 * HKV) * D, device="cuda", dtype=dtype)
        q, kk, vv = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, kk, vv = q.view(T, HQ, D), kk.view(T, HKV, D), vv.view(T, HKV, D)
        k, v, _, _ = _paged([T], dtype)
        cos, sin = rope_cos_sin(torch.rand(D // 2, device="cuda"), 16384)
        pos = torch.randint(0, 16384, (T,), device="cuda")
        slots = torch.randperm(T, device="cuda")
        nw = torch.ones(D, device="cuda", dtype=dtype)
        us = _time_us(lambda: fused_qk_norm_rope_kv(q, kk, vv, pos, cos, sin, k, v, slots, nw,
                                                    nw), graph=True)
        rows.append({"kernel": "qk_norm_rope_kv", "T": T, "us": round(us, 2),
                     "GBps": round(2 * qkv.numel() * 2 / us / 1e3, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.lab.kernel_bench needs a CUDA device")
    result = {"device": torch.cuda.get_device_name(), "copy": bench_copy(),
              "decode": bench_decode(), "prefill": bench_prefill(),
              "elementwise": bench_elementwise()}
    emit(result, args.out)


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON, and write it to `out` too when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
