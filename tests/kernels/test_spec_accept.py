"""kernels.spec_accept against pdserve.engine.spec.draft_graphs.accept_ref, and both against the host
rule of pdserve.engine.spec.spec_decoder.greedy_accept: device-side greedy acceptance and the chain's
positions after it."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.spec.draft_graphs import accept_ref
from pdserve.engine.spec.spec_decoder import greedy_accept
from pdserve.kernels.spec_accept import spec_accept

BS = 4  # block size: small, so chain positions cross blocks


def _case(B: int, k: int, chain: int, nmax: int, seed: int, device: str):
    """argmax/drafts whose rows accept 0..k drafts; staged chain rows as DraftGraphs.stage
    writes them for n = k (position start + q + s, slot through the table, length + 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = k + 1
    argmax = torch.randint(0, 50, (B, q), generator=gen)
    drafts = argmax[:, :k].clone()
    for i in range(B):  # row i misses at draft i % (k + 1) (k + 1: accepts all)
        miss = i % (k + 1)
        if miss < k:
            drafts[i, miss] = (argmax[i, miss] + 1) % 50
    width = 9
    tables = torch.randperm(nmax * width + 5, generator=gen)[:nmax * width]
    tables = tables.view(nmax, width).to(torch.int32)
    starts = torch.randint(0, 8, (B,), generator=gen)
    cpos = torch.zeros(chain, nmax, dtype=torch.int64)
    for s in range(chain):
        cpos[s, :B] = starts + q + s
    cslots = torch.full((chain, nmax), -1, dtype=torch.int64)
    cseq = torch.zeros(chain, nmax, dtype=torch.int32)
    for s in range(chain):
        for i in range(B):
            p = int(cpos[s, i])
            cslots[s, i] = int(tables[i, p // BS]) * BS + p % BS
            cseq[s, i] = p + 1
    sel = torch.arange(B) * q + q - 1
    ids = torch.full((B * q,), -7, dtype=torch.int64)
    t = [argmax.reshape(-1), drafts, ids, sel, cpos, cslots, cseq, tables]
    return [x.to(device) for x in t]


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("B,k,chain,nmax", [(1, 1, 0, 1), (3, 2, 1, 4), (5, 3, 2, 7),
                                            (2, 4, 3, 2), (1, 3, 0, 256)])
def test_kernel_matches_reference_and_the_host_rule(B, k, chain, nmax, forced, device):
    """Odd batch sizes, q = 2..5 (a non-power-of-2 row), chains of 0..3 steps, padding
    columns (nmax > B) that must stay as staged."""
    args = _case(B, k, chain, nmax, seed=B * 10 + k, device=device)
    ref = [a.clone() for a in args]
    spec_accept(*args, block_size=BS, forced=forced)
    accept_ref(*ref, block_size=BS, forced=forced)
    for name, got, want in zip(("ids", "sel", "cpos", "cslots", "cseq"), args[2:7], ref[2:7]):
        assert torch.equal(got.cpu(), want.cpu()), name
    argmax, drafts, ids, sel = (a.cpu() for a in args[:4])
    q = k + 1
    for i in range(B):
        rows, d = argmax[i * q:(i + 1) * q].tolist(), drafts[i].tolist()
        n = k if forced else len(greedy_accept(d, rows)) - 1
        assert sel[i] == i * q + n
        assert ids[i * q:i * q + n].tolist() == d[:n]
        assert ids[i * q + n:(i + 1) * q].tolist() == rows[n:]
    if chain and nmax > B:  # padding columns keep their staged positions
        staged = _case(B, k, chain, nmax, B * 10 + k, "cpu")[4]
        assert torch.equal(args[4][:, B:].cpu(), staged[:, B:])


def test_chain_moves_back_by_the_rejected_drafts(device):
    """One sequence, k = 3, the first draft rejected: the chain starts 3 positions earlier,
    across a block boundary, with the slot from the earlier block."""
    argmax, drafts, ids, sel, cpos, cslots, cseq, tables = _case(1, 3, 2, 1, 5, device)
    drafts[0, 0] = argmax[0] + 1  # reject at once: n = 0
    before = cpos[:, 0].clone()
    spec_accept(argmax, drafts, ids, sel, cpos, cslots, cseq, tables, block_size=BS)
    assert sel.tolist() == [0]
    assert torch.equal(cpos[:, 0], before - 3)
    p = cpos[:, 0].cpu()
    want = tables[0].cpu().to(torch.int64)[p // BS] * BS + p % BS
    assert torch.equal(cslots[:, 0].cpu(), want)
    assert torch.equal(cseq[:, 0].cpu(), (p + 1).to(torch.int32))


def test_bad_arguments_name_the_field(device):
    args = _case(2, 2, 1, 3, 0, device)
    with pytest.raises(ValueError, match="argmax"):
        spec_accept(args[0][:-1], *args[1:], block_size=BS)
    with pytest.raises(TypeError, match="drafts"):
        spec_accept(args[0], args[1].to(torch.int32), *args[2:], block_size=BS)
    with pytest.raises(ValueError, match="cseq"):
        spec_accept(*args[:6], args[6][:, :1], args[7], block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        spec_accept(*args, block_size=0)
