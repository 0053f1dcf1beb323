"""NixlKVTransport between processes on two GPUs (VRAM to VRAM): needs 2 CUDA devices."""
from __future__ import annotations

import time

import pytest
import torch
from kv_peer_proc import SHAPE, PeerProc
from test_kv_transport import COMPAT, LOCAL, REMOTE

from pdserve.kv_transfer import NixlKVTransport, PeerInfo, coalesce_pairs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
def test_vram_read_across_gpus_is_bitwise_exact(mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    peer = PeerProc("p0", COMPAT, device="cuda:0")
    kv = torch.zeros(SHAPE, dtype=torch.float32, device="cuda:1")
    t = NixlKVTransport(kv, "d0", COMPAT, descriptor_mode=mode)
    try:
        expected = peer.call("fill", REMOTE, 1)
        info = PeerInfo.from_bytes(peer.info_bytes)
        assert info.kv_mem_type == "VRAM" and info.kv_device_id == 0
        t.add_peer(info)
        t.warm_up("p0", info.incarnation, time.monotonic() + 60)
        stats = t.read_blocks("p0", info.incarnation, REMOTE, LOCAL, time.monotonic() + 60)
        assert [kv[b].cpu().numpy().tobytes() for b in LOCAL] == expected
        assert stats.descriptors == len(coalesce_pairs(LOCAL, REMOTE))
    finally:
        t.close()
        peer.stop()
