"""Scheduler: token budget, chunked prefill, preemption, stops, aborts, n > 1, P/D hooks.

The "model" here is FakeKV: it writes each scheduled token into a simulated paged KV pool
through the block table and, when a request samples, reads the whole context back through
the block table and derives the next token from what it read. So a block shared wrongly,
overwritten after eviction, or a bad recompute after preemption changes the output, and
outputs must equal a sequential reference generation.
"""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.core.block_manager import NoFreeBlocksError
from pdserve.engine.core.config import CacheConfig, SchedulerConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import (
    DuplicateRequestError,
    InvalidRequestError,
    SamplingParams,
)
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.scheduler_output import SchedulerOutput

REPO = Path(__file__).resolve().parents[2]
EOS = 2


def next_token(context: list[int]) -> int:
    """Deterministic 'model': a function of the whole context, never EOS (>= 10)."""
    return 10 + sum((i + 1) * t for i, t in enumerate(context)) % 89


def reference(prompt: list[int], max_tokens: int, first: list[int] | None = None) -> list[int]:
    out = list(first or [])
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
    return out


class FakeKV:
    def __init__(self, sched: Scheduler) -> None:
        self.bm = sched.block_manager
        self.slots: list[int | None] = [None] * (self.bm.num_blocks * self.bm.block_size)

    def slot(self, req: Request, pos: int) -> int:
        bs = self.bm.block_size
        return req.block_table[pos // bs] * bs + pos % bs

    def write(self, req: Request, start: int, end: int) -> None:
        for pos in range(start, end):
            block = req.block_table[pos // self.bm.block_size]
            # a shared or cached block holds computed KV: writing it again is a bug
            assert self.bm.ref_counts[block] == 1 and self.bm.block_hashes[block] is None
            self.slots[self.slot(req, pos)] = req.all_token_ids[pos]

    def remote_read(self, req: Request) -> None:
        """What a NIXL read does on a decode worker: the prompt's KV lands in its blocks."""
        for pos in range(req.num_prompt_tokens):
            self.slots[self.slot(req, pos)] = req.prompt_token_ids[pos]

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for s in out.scheduled:
            self.write(s.request, s.start_pos, s.start_pos + s.num_new_tokens)
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                req = s.request
                context = [self.slots[self.slot(req, p)] for p in range(req.num_tokens)]
                assert context == req.all_token_ids, req.request_id
                sampled[req.request_id] = [next_token(context)]
        return sampled


def make_sched(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 16,
               max_len: int = 512, caching: bool = True, policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_len, policy=policy),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 enable_prefix_caching=caching), (EOS,))


def make_req(rid: str, prompt: list[int], max_tokens: int = 4, parent: str | None = None,
             **params: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   parent_id=parent)


def check_state(sched: Scheduler, out: SchedulerOutput | None = None) -> None:
    bm = sched.block_manager
    holders = sched.running + list(sched.waiting_for_kv.values()) + list(sched.held.values())
    refs = [0] * bm.num_blocks
    for req in holders:
        for b in req.block_table:
            refs[b] += 1
    assert refs == bm.ref_counts
    assert all(bm.block_hashes[b] is not None for b in range(bm.num_blocks) if refs[b] > 1)
    used = sum(1 for r in refs if r > 0)
    assert bm.num_free_blocks + used == bm.num_blocks
    assert all(not r.block_table for r in sched.waiting)
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
    if out is None:
        return
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
    # no thrash: a request preempted in this step is not readmitted in the same step
    assert not {r.request_id for r in out.preempted} & {s.request.request_id for s in out.scheduled}
    for s in out.scheduled:
        req = s.request
        assert s.num_new_tokens >= 1 and s.start_pos == req.num_computed_tokens
        assert s.start_pos + s.num_new_tokens <= req.num_tokens
        assert len(req.block_table) * bm.block_size >= s.start_pos + s.num_new_tokens


def step(sched: Scheduler, kv: FakeKV) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    check_state(sched, out)
    changed = sched.update_from_output(out, kv.run(out))
    check_state(sched)
    return out, changed


def run_all(sched: Scheduler, kv: FakeKV, max_steps: int = 2000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched, kv)[0])
    return outs


def test_import_is_torch_free() -> None:
    code = ("import sys, pdserve.engine.core.scheduler, engine.core.block_manager; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_chunked_prefill_splits_and_mixes_with_decode() -> None:
    sched = make_sched(budget=16)
    kv = FakeKV(sched)
    a, b = make_req("a", [5, 6, 7, 8], max_tokens=5), make_req("b", list(range(40)))
    sched.add_request(a)
    sched.add_request(b)
    plan = []
    for _ in range(3):
        out, _ = step(sched, kv)
        plan.append([(s.request.request_id, s.start_pos, s.num_new_tokens, s.samples)
                     for s in out.scheduled])
    assert plan == [
        [("a", 0, 4, True), ("b", 0, 12, False)],
        [("a", 4, 1, True), ("b", 12, 15, False)],  # decode first, then the prefill chunk
        [("a", 5, 1, True), ("b", 27, 13, True)],  # last chunk samples b's first token
    ]
    run_all(sched, kv)
    assert a.output_token_ids == reference(a.prompt_token_ids, 5)
    assert b.output_token_ids == reference(b.prompt_token_ids, 4)
    assert sched.block_manager.num_used_blocks == 0


def test_decodes_go_before_an_older_prefill() -> None:
    sched = make_sched(budget=8)
    kv = FakeKV(sched)
    a = make_req("a", list(range(3, 43)))
    sched.add_request(a)
    step(sched, kv)  # a: first 8 of 40 prompt tokens
    b = remote_request("b", [5, 6, 7])
    sched.add_remote_request(b)
    kv.remote_read(b)
    sched.kv_arrived("b")  # b runs after a, but it decodes
    out, _ = step(sched, kv)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1), ("a", 7)]
    run_all(sched, kv)
    assert a.output_token_ids == reference(a.prompt_token_ids, 4)
    assert b.output_token_ids == reference(b.prompt_token_ids, 5)


def test_preempting_a_request_already_scheduled_this_step() -> None:
    sched = make_sched(num_blocks=6, block_size=4, budget=8)
    kv = FakeKV(sched)
    a = make_req("a", list(range(3, 23)))  # 20 + 4 tokens: the whole pool
    sched.add_request(a)
    step(sched, kv)  # a: tokens 0..7, 2 blocks
    b = remote_request("b", [5, 6, 7])
    sched.add_remote_request(b)
    kv.remote_read(b)
    sched.kv_arrived("b")
    step(sched, kv)  # b decodes position 3; a: tokens 8..14 -> 4 blocks; 1 block free
    out, _ = step(sched, kv)  # b takes the last block first, then a needs one: b goes
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert [(s.request.request_id, s.start_pos, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 15, 5)]
    assert out.num_batched_tokens == 5
    run_all(sched, kv)
    assert a.output_token_ids == reference(a.prompt_token_ids, 4)
    assert b.output_token_ids == reference(b.prompt_token_ids, 5)


def test_max_num_seqs_limits_a_step() -> None:
    sched = make_sched(max_seqs=2)
    kv = FakeKV(sched)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", [i + 3] * 5))
    out, _ = step(sched, kv)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    run_all(sched, kv)


def test_preemption_is_lifo_and_keeps_outputs() -> None:
    sched = make_sched(num_blocks=6, block_size=4)
    kv = FakeKV(sched)
    reqs = [make_req(n, [k] * 7, max_tokens=8) for n, k in (("a", 3), ("b", 4), ("c", 5))]
    for r in reqs:
        sched.add_request(r)
    step(sched, kv)  # all three prefill 7 tokens: 2 blocks each, pool full
    step(sched, kv)  # decode position 7 fits in block 1
    c = reqs[2]
    outputs_before = list(c.output_token_ids)
    out, _ = step(sched, kv)  # position 8 needs a new block: the newest (c) is preempted
    assert out.preempted == [c] and c.status == RequestStatus.PREEMPTED
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.waiting.peek() is c and c.num_computed_tokens == 0 and not c.block_table
    assert c.output_token_ids == outputs_before and sched.num_preemptions == 1
    run_all(sched, kv)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference(r.prompt_token_ids, 8)


@pytest.mark.parametrize("caching", [True, False])
def test_tiny_pool_preempts_then_finishes_everything(caching: bool) -> None:
    sched = make_sched(num_blocks=6, block_size=4, budget=10, caching=caching)
    kv = FakeKV(sched)
    reqs = [make_req(f"r{i}", [i + 3, 7, 7, 9, i, 1], max_tokens=18) for i in range(6)]
    for r in reqs:  # 6 + 18 = 24 tokens = the whole pool: admissible
        sched.add_request(r)
    run_all(sched, kv)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 18)
    assert sched.block_manager.num_used_blocks == 0


def test_stop_conditions() -> None:
    sched = make_sched()
    eos = make_req("eos", [1, 3])
    ignore = make_req("ignore", [1, 3], ignore_eos=True)
    stop_id = make_req("stop_id", [1, 3], max_tokens=10, stop_token_ids=(77,))
    multi = make_req("multi", [1, 3], max_tokens=10, stop_token_ids=(77,))
    length = make_req("length", [1, 3], max_tokens=2)
    for r in (eos, ignore, stop_id, multi, length):
        sched.add_request(r)
    out = sched.schedule()
    sampled = {"eos": [EOS], "ignore": [EOS], "stop_id": [77], "multi": [5, 77, 6],
               "length": [5, 6, 7]}  # multi-token accepts, as speculative decoding gives
    changed = sched.update_from_output(out, sampled)
    assert len(changed) == 5
    assert (eos.status, eos.stop_reason, eos.output_token_ids) == (
        RequestStatus.FINISHED_STOPPED, None, [EOS])
    assert ignore.status == RequestStatus.RUNNING
    assert (stop_id.status, stop_id.stop_reason) == (RequestStatus.FINISHED_STOPPED, 77)
    assert multi.output_token_ids == [5, 77] and multi.status.finish_reason == "stop"
    assert length.output_token_ids == [5, 6] and length.status == RequestStatus.FINISHED_LENGTH
    assert sched.running == [ignore]
    assert sched.get_request("eos") is None  # finished requests are forgotten
    while ignore.status == RequestStatus.RUNNING:
        sched.update_from_output(sched.schedule(), {"ignore": [EOS]})
    assert ignore.output_token_ids == [EOS] * 4 and ignore.status == RequestStatus.FINISHED_LENGTH
    assert sched.block_manager.num_used_blocks == 0


def test_update_requires_a_token_for_each_sampling_request() -> None:
    sched = make_sched()
    r = make_req("r", [4, 5, 6])
    sched.add_request(r)
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled"):
        sched.update_from_output(out, {})
    assert r.num_computed_tokens == 0  # nothing was applied


def test_finish_request_for_stop_string() -> None:
    sched = make_sched()
    kv = FakeKV(sched)
    r = make_req("r", [4, 5, 6], max_tokens=50)
    sched.add_request(r)
    step(sched, kv)
    with pytest.raises(ValueError, match="status"):
        sched.finish_request("r", RequestStatus.RUNNING)
    assert sched.finish_request("r", RequestStatus.FINISHED_STOPPED, "\n\n")
    assert r.stop_reason == "\n\n" and r.status.finish_reason == "stop"
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0
    assert not sched.finish_request("r", RequestStatus.FINISHED_STOPPED)


def test_abort_frees_blocks() -> None:
    sched = make_sched(budget=8)
    kv = FakeKV(sched)
    running, waiting = make_req("run", list(range(3, 11))), make_req("wait", [3, 4])
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched, kv)
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.abort_request("wait") and sched.num_waiting == 0
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    out = sched.schedule()
    assert sched.abort_request("run")  # aborted between schedule() and update
    assert sched.block_manager.num_used_blocks == 0 and not running.block_table
    assert sched.update_from_output(out, {}) == []
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert not sched.abort_request("run") and not sched.abort_request("nope")
    check_state(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_n_siblings_share_full_prompt_blocks(caching: bool) -> None:
    sched = make_sched(block_size=16, budget=24 if caching else 200, caching=caching)
    kv = FakeKV(sched)
    prompt = [(7 * i) % 50 + 3 for i in range(40)]  # 2 full blocks + 8 tokens
    leader = make_req("r-0", prompt)
    sibs = [make_req(f"r-{i}", prompt, parent="r-0") for i in (1, 2, 3)]
    other = make_req("x", [9] * 8)  # queued behind the siblings
    last = make_req("y", [8] * 20)  # step 2's budget is spent when y's turn comes
    for r in [leader, *sibs, other, last]:
        sched.add_request(r)
    out, _ = step(sched, kv)
    if not caching:  # siblings compute normally: 4 x 3 blocks
        assert len(out.scheduled) == 6
        run_all(sched, kv)
        assert sched.block_manager.num_allocations == 4 * 3 + 1 + 2
        return
    assert [s.request.request_id for s in out.scheduled] == ["r-0"]
    out, _ = step(sched, kv)  # leader's last chunk; siblings wait, x goes past them
    assert [s.request.request_id for s in out.scheduled] == ["r-0", "x"]
    assert list(sched.waiting) == [*sibs, last]  # siblings kept their place
    out, _ = step(sched, kv)  # leader's prompt is cached: siblings hit 32 tokens
    assert {s.request.request_id for s in out.scheduled} >= {"r-1", "r-2"}
    for s in sibs:
        if s.block_table:
            assert s.num_cached_tokens == 32 and s.block_table[:2] == leader.block_table[:2]
    run_all(sched, kv)
    # leader: 3 blocks; each sibling: 1 private block; x: 1 block; y: 2 blocks
    assert sched.block_manager.num_allocations == 3 + 3 + 1 + 2
    for r in [leader, *sibs]:
        assert r.output_token_ids == reference(prompt, 4)


def test_sibling_proceeds_when_leader_aborted() -> None:
    sched = make_sched(budget=4)
    kv = FakeKV(sched)
    prompt = list(range(3, 15))
    leader, sib = make_req("r-0", prompt), make_req("r-1", prompt, parent="r-0")
    sched.add_request(leader)
    sched.add_request(sib)
    step(sched, kv)
    sched.abort_request("r-0")
    out, _ = step(sched, kv)
    assert [s.request.request_id for s in out.scheduled] == ["r-1"]
    run_all(sched, kv)
    assert sib.output_token_ids == reference(sib.prompt_token_ids, 4)


def test_oversize_requests_rejected_naming_the_field() -> None:
    sched = make_sched(num_blocks=4, block_size=4, max_len=64)  # pool: 16 tokens
    cases = [(list(range(10)), 7, "max_tokens"), (list(range(16)), 1, "prompt")]
    small_ctx = make_sched(num_blocks=64, max_len=12)
    for prompt, max_tokens, param in cases:
        with pytest.raises(InvalidRequestError) as err:
            sched.add_request(make_req("r", prompt, max_tokens=max_tokens))
        assert err.value.param == param and "KV cache pool" in str(err.value)
    for prompt, max_tokens, param in [(list(range(8)), 5, "max_tokens"),
                                      (list(range(12)), 1, "prompt")]:
        with pytest.raises(InvalidRequestError) as err:
            small_ctx.add_request(make_req("r", prompt, max_tokens=max_tokens))
        assert err.value.param == param and "max_model_len" in str(err.value)
    assert not sched.has_unfinished() and not small_ctx.has_unfinished()
    fits = make_req("fits", list(range(3, 13)), max_tokens=6)  # exactly 16 tokens
    sched.add_request(fits)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(make_req("fits", [3]))
    assert err.value.param == "request_id"
    run_all(sched, FakeKV(sched))
    assert fits.output_token_ids == reference(fits.prompt_token_ids, 6)


def remote_request(rid: str, prompt: list[int], max_tokens: int = 5) -> Request:
    req = make_req(rid, prompt, max_tokens=max_tokens)
    req.append_token(next_token(prompt))  # sampled by the prefill worker
    return req


def test_remote_request_decodes_after_kv_arrives() -> None:
    sched = make_sched(block_size=4)
    kv = FakeKV(sched)
    prompt = list(range(20, 30))
    req = remote_request("d", prompt)
    blocks = sched.add_remote_request(req)
    assert blocks == req.block_table and len(blocks) == 3
    assert req.status == RequestStatus.WAITING_FOR_KV and sched.num_waiting_for_kv == 1
    assert sched.schedule().is_empty  # nothing runnable until the read lands
    kv.remote_read(req)
    assert sched.kv_arrived("d") and not sched.kv_arrived("d")
    local = make_req("local", prompt + [1])  # the read blocks entered the prefix cache
    assert sched.block_manager.get_computed_blocks(local) == blocks[:2]
    out, _ = step(sched, kv)
    assert [(s.start_pos, s.num_new_tokens, s.samples) for s in out.scheduled] == [(10, 1, True)]
    run_all(sched, kv)
    assert req.output_token_ids == reference(prompt, 5)


def test_remote_request_kv_failure_recomputes() -> None:
    sched = make_sched(block_size=4)
    kv = FakeKV(sched)
    prompt = list(range(20, 30))
    req = remote_request("d", prompt)
    sched.add_remote_request(req)
    other = make_req("w", [3, 4])
    sched.add_request(other)
    assert sched.kv_failed("d") and not sched.kv_failed("d")
    assert list(sched.waiting) == [req, other]  # it has waited already: front of the queue
    assert req.status == RequestStatus.WAITING and sched.num_kv_recomputes == 1
    assert sched.block_manager.num_used_blocks == 0
    out, _ = step(sched, kv)  # prompt + the remote first token, all computed locally
    assert [(s.request.request_id, s.start_pos, s.num_new_tokens, s.samples)
            for s in out.scheduled] == [("d", 0, 11, True), ("w", 0, 2, True)]
    run_all(sched, kv)
    assert req.output_token_ids == reference(prompt, 5)


def test_remote_request_admission_and_abort() -> None:
    sched = make_sched(num_blocks=4, block_size=4)
    a = remote_request("a", list(range(10)), max_tokens=4)
    sched.add_remote_request(a)  # 3 of 4 blocks
    with pytest.raises(NoFreeBlocksError):
        sched.add_remote_request(remote_request("b", list(range(8)), max_tokens=4))
    assert sched.get_request("b") is None
    with pytest.raises(InvalidRequestError) as err:
        sched.add_remote_request(make_req("c", [1, 2]))
    assert err.value.param == "output_token_ids"
    assert sched.abort_request("a") and sched.block_manager.num_used_blocks == 0
    assert not sched.kv_arrived("a") and not sched.has_unfinished()


def test_prefill_role_holds_blocks_until_released() -> None:
    sched = make_sched(block_size=4)
    kv = FakeKV(sched)
    reqs = [make_req(f"p{i}", list(range(10 + i)), max_tokens=1) for i in range(2)]
    for r in reqs:
        r.hold_blocks_on_finish = True
        sched.add_request(r)
    _, changed = step(sched, kv)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in changed) and len(changed) == 2
    assert not sched.has_unfinished()
    assert sched.held_request_ids() == ["p0", "p1"]
    # a held id is still in use: a new request under it would orphan the held blocks
    for add, again in ((sched.add_request, make_req("p0", [1, 2])),
                       (sched.add_remote_request, remote_request("p1", [1, 2], max_tokens=4))):
        with pytest.raises(DuplicateRequestError) as err:
            add(again)
        assert err.value.param == "request_id"
    assert sched.get_request("p0") is reqs[0] and len(reqs[0].block_table) == 3
    assert sched.block_manager.num_used_blocks == 6
    check_state(sched)
    assert sched.release_held("p0") and not sched.release_held("p0")
    assert sched.abort_request("p1")  # a cancel also releases
    assert not sched.release_held("p1") and not sched.release_held("unknown")
    assert sched.held_request_ids() == [] and sched.block_manager.num_used_blocks == 0
    # aborted before it finished: nothing to hand over, blocks are freed at once
    cut = make_req("cut", list(range(10)), max_tokens=1)
    cut.hold_blocks_on_finish = True
    sched.add_request(cut)
    sched.schedule()
    assert sched.abort_request("cut")
    assert sched.held_request_ids() == [] and sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_finish_with_reference_outputs(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    policy = "priority" if seed % 2 else "fcfs"  # priorities drawn from -2..2 below
    sched = make_sched(num_blocks=rng.randint(4, 16), block_size=bs, budget=rng.randint(1, 40),
                       max_seqs=rng.randint(1, 6), caching=rng.random() < 0.8, policy=policy)
    pool = sched.block_manager.num_blocks * bs
    kv = FakeKV(sched)
    stems = [[rng.randrange(3, 9) for _ in range(pool)] for _ in range(2)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    reqs: list[Request] = []
    for i in range(rng.randint(3, 12)):
        plen = rng.randint(1, pool - 1)
        prompt = rng.choice(stems)[:plen]
        max_tokens = rng.randint(1, pool - plen)
        n = rng.choice([1, 1, 2, 3])
        priority = rng.randint(-2, 2) if policy == "priority" else 0
        for j in range(n):
            req = make_req(f"q{i}-{j}", prompt, max_tokens, parent=None if j == 0 else f"q{i}-0",
                           priority=priority)
            sched.add_request(req)
            reqs.append(req)
            expected[req.request_id] = reference(prompt, max_tokens)
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        if rng.random() < 0.02:
            live = [r.request_id for r in reqs if not r.is_finished]
            victim = rng.choice(live)
            assert sched.abort_request(victim)
            aborted.add(victim)
            check_state(sched)
        step(sched, kv)
    assert not sched.has_unfinished(), "a request never finished"
    for r in reqs:
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == expected[r.request_id]
    assert sched.block_manager.num_used_blocks == 0


def test_priority_policy_admits_lower_values_first_and_preempts_the_highest() -> None:
    """vLLM's priority scheduling: waiting requests go in (priority, arrival) order; under
    memory pressure the running request with the largest (priority, arrival) is preempted,
    whatever the admission order, and goes back to the queue by its key."""
    sched = make_sched(num_blocks=4, block_size=4, max_seqs=2, policy="priority")
    kv = FakeKV(sched)
    reqs = {n: make_req(n, [k] * 7, max_tokens=8, priority=p)
            for n, k, p in (("low", 3, 5), ("high", 4, -1), ("mid", 5, 0))}
    for r in reqs.values():
        sched.add_request(r)
    out, _ = step(sched, kv)  # two seats: the two lowest values, in value order
    assert [s.request.request_id for s in out.scheduled] == ["high", "mid"]
    sched.add_request(urgent := make_req("urgent", [6] * 3, max_tokens=4, priority=-9))
    assert [r.request_id for r in sched.waiting] == ["urgent", "low"]
    step(sched, kv)  # position 7 fits in block 1 for both running
    out, _ = step(sched, kv)  # position 8 needs a block, none is free: "mid" (value 0) goes
    assert [r.request_id for r in out.preempted] == ["mid"]
    assert [r.request_id for r in sched.waiting] == ["urgent", "mid", "low"]
    run_all(sched, kv)
    for r in [*reqs.values(), urgent]:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)


def test_fcfs_refuses_a_priority_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="priority") as e:
        make_sched().add_request(make_req("a", [1, 2], priority=3))
    assert e.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority=2**31)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_sched(policy="lifo")
