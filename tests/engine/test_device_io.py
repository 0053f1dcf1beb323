"""pdserve.engine.exec.device_io: host lists to the device, and row gathers that skip the identity."""
from __future__ import annotations

import torch

from pdserve.engine.exec.device_io import rows_of, to_device


def test_to_device_keeps_values_and_dtype() -> None:
    t = to_device([[1, 2], [3, 4]], torch.int64, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [[1, 2], [3, 4]]
    assert to_device([True, False], torch.bool, torch.device("cpu")).tolist() == [True, False]


def test_rows_of_gathers_and_returns_x_itself_for_all_rows_in_order() -> None:
    x = torch.arange(12.0).reshape(4, 3)
    assert rows_of(x, [0, 1, 2, 3]) is x
    assert rows_of(x, [2, 0]).tolist() == [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]]
    assert rows_of(x, [0, 1]).tolist() == x[:2].tolist()  # a prefix is not all of x
