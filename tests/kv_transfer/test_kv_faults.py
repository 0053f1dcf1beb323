"""FaultInjector: which transfers fail, delays, dropped releases; config validation."""
from __future__ import annotations

import pytest

from pdserve.kv_transfer.faults import FaultConfig, FaultInjector


def _fails(inj: FaultInjector, n: int) -> list[int]:
    return [f.number for f in (inj.on_transfer() for _ in range(n)) if f.fail]


def test_fail_nth_fails_exactly_that_one():
    inj = FaultInjector(FaultConfig(fail_nth=3))
    assert _fails(inj, 10) == [3]
    assert inj.transfers == 10 and inj.failed == 1


def test_fail_every_nth():
    assert _fails(FaultInjector(FaultConfig(fail_every=4)), 12) == [4, 8, 12]


def test_fail_prob_is_seeded_and_roughly_p():
    a = _fails(FaultInjector(FaultConfig(fail_prob=0.3, seed=11)), 1000)
    b = _fails(FaultInjector(FaultConfig(fail_prob=0.3, seed=11)), 1000)
    assert a == b and 200 < len(a) < 400


def test_delay_and_no_faults_by_default():
    inj = FaultInjector()
    f = inj.on_transfer()
    assert not f.fail and f.delay_s == 0 and not inj.config.enabled
    assert FaultInjector(FaultConfig(delay_s=0.25)).on_transfer().delay_s == 0.25


def test_drop_release():
    inj = FaultInjector(FaultConfig(drop_release_prob=1.0))
    assert all(inj.drop_release() for _ in range(5)) and inj.dropped_releases == 5
    assert not FaultInjector().drop_release()


@pytest.mark.parametrize("kwargs, field", [
    ({"fail_nth": -1}, "fail_nth"), ({"fail_prob": 1.5}, "fail_prob"),
    ({"delay_s": float("nan")}, "delay_s"), ({"drop_release_prob": -0.1}, "drop_release_prob"),
    ({"stall_loop_s": -1.0}, "stall_loop_s"), ({"stall_loop_s": True}, "stall_loop_s"),
])
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FaultConfig(**kwargs)


def test_the_loop_stall_is_taken_once():
    inj = FaultInjector(FaultConfig(stall_loop_s=2.5))
    assert inj.config.enabled and inj.take_loop_stall() == 2.5
    assert inj.take_loop_stall() == 0.0 and inj.loop_stalls == 1
    assert FaultInjector().take_loop_stall() == 0.0


def test_from_dict_refuses_unknown_switch():
    assert FaultConfig.from_dict({"fail_nth": 2}).fail_nth == 2
    assert FaultConfig.from_dict(None) == FaultConfig()
    with pytest.raises(ValueError, match="faults.fail_first"):
        FaultConfig.from_dict({"fail_first": 1})
