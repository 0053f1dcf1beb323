"""StaticInputs: a CUDA-graph set's input tensors as views of one device buffer.

A replayed graph reads fixed buffers (input_ids, positions, slot_mapping, seq_lens,
block_tables). A step writes its values into the first B rows of a pinned host mirror
(numpy views: straight from the scheduler's lists, no torch dispatch) and sends the mirror
over in ONE async copy. Every torch call releases and retakes the GIL, and in a worker the
gRPC stream threads hold it between a step's calls: five copies plus device-side padding
fills cost a decode step several ms of waiting for the GIL (bench/lab/diag_serving.py); one copy
costs one retake.

Layout (bytes, each field 16-byte aligned), with n_tokens = n_seqs * q:
    input_ids, positions, slot_mapping   int64 [n_tokens]
    seq_lens                             int32 [n_seqs]
    block_tables                         int32 [n_seqs, width]     last: a step copies the
                                                                   prefix its bucket reads
Host rows past the step's batch hold padding (slot -1 writes no KV, seq_len `seq_pad`,
table row 0), so the same copy pads the rest of the bucket.
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.model.attention import HostBatch

_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")


class StaticInputs:
    def __init__(self, n_seqs: int, q: int, width: int, seq_pad: int,
                 device: torch.device) -> None:
        self.n_seqs, self.q, self.width, self.seq_pad = n_seqs, q, width, seq_pad
        n_tok = n_seqs * q
        shapes = [(torch.int64, (n_tok,))] * 3 + [(torch.int32, (n_seqs,)),
                                                  (torch.int32, (n_seqs, width))]
        offsets, total = [], 0
        for dtype, shape in shapes:
            offsets.append(total)
            total += -(-int(np.prod(shape)) * dtype.itemsize // 16) * 16
        self.table_offset = offsets[-1]
        pin = device.type == "cuda"
        self.raw = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        host_np = self.host.numpy()
        for name, (dtype, shape), off in zip(_FIELDS, shapes, offsets):
            nbytes = int(np.prod(shape)) * dtype.itemsize
            setattr(self, name, self.raw[off:off + nbytes].view(dtype).view(shape))
            np_dtype = np.int64 if dtype == torch.int64 else np.int32
            setattr(self, "np_" + name, host_np[off:off + nbytes].view(np_dtype).reshape(shape))
        self._copied = torch.cuda.Event() if pin else None  # the mirror is free again
        self._rows = n_seqs  # host rows that may hold a step's values
        self.reset()

    def _pad_host(self, start: int) -> None:
        """Padding into the host rows [start, rows written before)."""
        q, end = self.q, self._rows
        if start < end:
            self.np_input_ids[start * q:end * q] = 0
            self.np_positions[start * q:end * q] = 0
            self.np_slot_mapping[start * q:end * q] = -1
            self.np_seq_lens[start:end] = self.seq_pad
            self.np_block_tables[start:end] = 0
        self._rows = start

    def reset(self) -> None:
        """Every row padding, on the host and the device (before a capture, whose warm-up
        forwards must write no KV)."""
        if self._copied is not None:
            self._copied.synchronize()
        self._rows = self.n_seqs
        self._pad_host(0)
        self.raw.copy_(self.host)

    def stage(self, batch: HostBatch, bucket: int) -> None:
        """The step's values into the first host rows, padding after them, then one async
        copy of everything the bucket's graph reads."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the mirror
        B, T = len(batch.seq_lens), len(batch.input_ids)
        self._pad_host(B)
        self.np_input_ids[:T] = batch.input_ids
        self.np_positions[:T] = batch.positions
        self.np_slot_mapping[:T] = batch.slots
        self.np_seq_lens[:B] = batch.seq_lens
        for i, table in enumerate(batch.block_tables):  # entries past a table are not read
            self.np_block_tables[i, :len(table)] = table
        self._rows = B
        end = self.table_offset + bucket * self.width * 4
        self.raw[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
