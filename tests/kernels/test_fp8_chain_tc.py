"""o_proj -> gate_up -> down in one launch (kernels/fp8_chain_tc.py): on CPU its reference is
the three tensor-core GEMVs of kernels/fp8_gemv_tc.py in turn, its argument checks name the
field; on a Hopper GPU the kernel (three phases, two grid syncs) against that reference at
odd and real sizes, launch after launch on one arrival counter."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_chain_tc import fp8_chain_tc
from pdserve.kernels.fp8_gemv_tc import fp8_gemv_tc, tc_available
from pdserve.kernels.reference import fp8_gemv_tc_ref

from tests.kernels.test_fp8_gemv import fp8_weight


def _layer(H: int, Ka: int, I: int, device, seed: int = 0) -> dict:
    """o_proj [H, Ka], gate_up [2I, H], down [H, I] block-FP8; the attention's output
    attn [1, Ka] (bf16), the residual res [1, H] (fp32), the norm's weight [H]."""
    gen = torch.Generator().manual_seed(seed)
    ws = {name: tuple(t.float() if t.dtype != torch.float8_e4m3fn else t
                      for t in fp8_weight(n, k, (128, 128), device, seed + i))
          for i, (name, n, k) in enumerate((("wo", H, Ka), ("wgu", 2 * I, H), ("wd", H, I)))}
    return dict(**ws, attn=torch.randn(1, Ka, generator=gen).to(device, torch.bfloat16),
                res=torch.randn(1, H, generator=gen).to(device),
                norm_weight=(torch.rand(H, generator=gen) + 0.5).to(device, torch.bfloat16))


def _buffers(L: dict, device) -> dict:
    H, I2 = L["wo"][0].shape[0], L["wgu"][0].shape[0]
    return dict(o=torch.zeros(1, H, device=device), gate_up=torch.zeros(1, I2, device=device),
                down=torch.full((1, H), 3.0, device=device),  # zeroed by the launch itself
                counter=torch.zeros(64, dtype=torch.int64, device=device),
                zero=(torch.ones(999, device=device), None))


def _chain(L: dict, b: dict) -> torch.Tensor:
    return fp8_chain_tc(L["attn"], L["wo"], L["wgu"], L["wd"], L["norm_weight"], 1e-6,
                        res=L["res"], o=b["o"], gate_up=b["gate_up"], down=b["down"],
                        counter=b["counter"], zero=(b["zero"][0], b["down"]))


def _three(L: dict, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same products as three tensor-core GEMV references."""
    H, I2 = L["wo"][0].shape[0], L["wgu"][0].shape[0]
    o = fp8_gemv_tc_ref(L["attn"], *L["wo"], out=torch.zeros(1, H, device=device), add=L["res"])
    gu = fp8_gemv_tc_ref(o, *L["wgu"], "norm", L["norm_weight"], 1e-6,
                         out=torch.zeros(1, I2, device=device))
    down = fp8_gemv_tc_ref(gu, *L["wd"], "silu", out=torch.zeros(1, H, device=device), add=o)
    return o, gu, down


def test_reference_is_the_three_gemvs_and_zeroes_its_buffers(device):
    L = _layer(256, 384, 256, device)
    b = _buffers(L, device)
    down = _chain(L, b)
    o, gu, want = _three(L, device)
    assert down is b["down"]
    torch.testing.assert_close(b["o"], o)
    torch.testing.assert_close(b["gate_up"], gu)
    torch.testing.assert_close(down, want)
    assert not b["zero"][0].any()
    # and the same through the one-GEMV launcher, whose kernel the chain's phases share
    o2 = fp8_gemv_tc(L["attn"], *L["wo"], out=torch.zeros_like(o), add=L["res"])
    torch.testing.assert_close(o2, o)


@pytest.mark.parametrize("bad,field", [
    ("wo_bf16", "wo"), ("wd_mismatch", "wd"), ("attn_short", "attn"),
    ("o_bf16", "o"), ("counter_int32", "counter"), ("zero_is_o", "zero[0]"),
])
def test_bad_arguments_name_the_field(bad, field, device):
    L = _layer(256, 384, 256, device)
    b = _buffers(L, device)
    if bad == "wo_bf16":
        L["wo"] = (L["wo"][0].to(torch.bfloat16), L["wo"][1])
    if bad == "wd_mismatch":
        L["wd"] = fp8_weight(256, 128, (128, 128), device, 0)
    if bad == "attn_short":
        L["attn"] = L["attn"][:, :128]
    if bad == "o_bf16":
        b["o"] = b["o"].to(torch.bfloat16)
    if bad == "counter_int32":
        b["counter"] = b["counter"].int()
    if bad == "zero_is_o":
        b["zero"] = (b["o"], None)
    with pytest.raises((ValueError, TypeError), match=field.replace("[", r"\[").replace("]", r"\]")):
        _chain(L, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not tc_available(0),
                    reason="needs a compute capability 9.0 GPU")
@pytest.mark.parametrize("H,Ka,I", [(256, 384, 256), (128, 256, 128), (4096, 4096, 12288)])
def test_kernel_is_the_reference_launch_after_launch(H, Ka, I):
    dev = torch.device("cuda")
    L = _layer(H, Ka, I, dev)
    b = _buffers(L, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for launch in range(3):  # one counter: each launch's syncs wait for the next multiple
        b["o"].zero_()
        b["gate_up"].zero_()
        b["zero"][0].fill_(1.0)
        _chain(L, b)
        torch.cuda.synchronize()
        assert b["counter"][0].item() == 2 * (launch + 1) * 2 * sms
        # each phase against the reference on the kernel's own input (an ulp of o moves
        # some e4m3 roundings of gate_up's activation): the same quantized activations,
        # only summation order and the tensor cores' fp8 accumulation within a 128-column
        # group differ
        o = fp8_gemv_tc_ref(L["attn"], *L["wo"], out=torch.zeros_like(b["o"]), add=L["res"])
        gu = fp8_gemv_tc_ref(b["o"], *L["wgu"], "norm", L["norm_weight"], 1e-6,
                             out=torch.zeros_like(b["gate_up"]))
        down = fp8_gemv_tc_ref(b["gate_up"], *L["wd"], "silu", out=torch.zeros_like(b["o"]),
                               add=b["o"])
        for got, ref in ((b["o"], o), (b["gate_up"], gu), (b["down"], down)):
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
        assert not b["zero"][0].any()
