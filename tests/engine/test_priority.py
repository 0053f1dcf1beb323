"""vLLM's priority scheduling through a real engine (tiny random Qwen3, CPU): with
scheduling_policy="priority" and one sequence per step, requests finish in priority order
whatever their arrival; the default fcfs policy refuses a priority, naming the field."""
from __future__ import annotations

import pytest

from pdserve.engine.core.config import ConfigError
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.llm import LLM

TINY = dict(device="cpu", block_size=4, num_blocks=64, max_num_seqs=1)


def params(priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, priority=priority)


def test_requests_finish_in_priority_order() -> None:
    engine = LLM("tiny-qwen3", scheduling_policy="priority", **TINY).engine
    for rid, priority in (("batch", 5), ("vip", -1), ("chat", 0)):
        engine.add_request([7, 8, 9, 10], params(priority), request_id=rid)
    finished = [o.request_id for _ in range(40) for o in engine.step() if o.finished]
    assert finished == ["vip", "chat", "batch"]


def test_fcfs_refuses_a_priority_and_a_bad_policy_is_named() -> None:
    engine = LLM("tiny-qwen3", **TINY).engine
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'") as e:
        engine.add_request([1, 2], params(2))
    assert e.value.param == "priority"
    with pytest.raises(ConfigError, match="^scheduling_policy"):
        EngineArgs(scheduling_policy="lifo")
