"""Disaggregation core on a real local Ray instance: prefill and decode actors, gRPC on
loopback, KV pulled over NIXL (UCX, host memory) between the two processes."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import ray

from pdserve.kv_transfer.faults import FaultConfig
from pdserve.proto import pdserve_pb2 as pb

from tests.workers.cluster import (
    decode_stream,
    idle,
    introduce,
    metric_value,
    prefill,
    scrape,
    start_ray,
    start_worker,
    tokens_of,
    wait_until,
)

LEASE_TTL_S = 10.0
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three primary colors:",
    "Water boils at",
    "The quick brown fox jumps over",
    "In machine learning, a transformer is",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def pair():
    start_ray()
    # Long enough that a pull on a loaded 2-core CI runner finishes inside it (2 s did not:
    # "lease of dis-3 was not valid for the whole read"), short enough for the expiry test.
    p = start_worker("prefill", "smol-p0", lease_ttl_s=LEASE_TTL_S)
    d = start_worker("decode", "smol-d0")
    assert introduce(p, d).accepted
    yield p, d
    for w in (p, d):
        ray.kill(w.actor, no_restart=True)


def _tokenize(texts: list[str]) -> list[list[int]]:
    from pdserve.engine.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    return [tok.encode(t) for t in texts]


def test_disaggregated_equals_colocated_and_kv_is_bitwise_equal(pair) -> None:
    p, d = pair
    greedy = pb.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    before = _transfer_samples(d)
    for i, prompt in enumerate(_tokenize(PROMPTS)):
        colocated, _ = tokens_of(decode_stream(d, f"col-{i}", prompt, greedy))
        res = prefill(p, f"dis-{i}", prompt, greedy)
        assert res.kv.block_ids and res.kv.num_tokens == len(prompt)
        remote_digests = ray.get(p.actor.kv_digests.remote(list(res.kv.block_ids), len(prompt)))
        disagg, reason = tokens_of(decode_stream(d, f"dis-{i}", prompt, greedy, res))
        assert disagg == colocated, PROMPTS[i]
        assert reason == "length"
        pulls = {r: (rem, loc, n) for r, rem, loc, n in ray.get(d.actor.recent_pulls.remote())}
        remote, local, n = pulls[f"dis-{i}"]
        assert remote == list(res.kv.block_ids)
        assert ray.get(d.actor.kv_digests.remote(local, n)) == remote_digests
    # vLLM's nixl_* names, scraped from the decode worker that read over NIXL: one
    # observation per read, the same bytes as kv_transfer_bytes
    got = {k: v - before[k] for k, v in _transfer_samples(d).items()}
    assert got["pdserve:nixl_xfer_time_seconds_count"] == len(PROMPTS)
    assert got["pdserve:nixl_num_descriptors_count"] == len(PROMPTS)
    assert got["pdserve:nixl_num_descriptors_sum"] >= len(PROMPTS)
    assert got["pdserve:nixl_bytes_transferred_sum"] == got["pdserve:kv_transfer_bytes_total"] > 0
    wait_until(lambda: idle(p) and idle(d), 10, "both workers idle")


TRANSFER_SAMPLES = ("pdserve:nixl_xfer_time_seconds_count", "pdserve:nixl_num_descriptors_count",
                    "pdserve:nixl_num_descriptors_sum", "pdserve:nixl_bytes_transferred_sum",
                    "pdserve:kv_transfer_bytes_total", "pdserve:nixl_num_failed_transfers_total",
                    "pdserve:kv_transfer_failures_total", "pdserve:nixl_num_kv_expired_reqs_total",
                    "pdserve:kv_lease_expired_total")


def _transfer_samples(w) -> dict[str, float]:
    text = scrape(w)
    return {name: metric_value(text, name) for name in TRANSFER_SAMPLES}


def test_prompt_logprobs_come_from_whichever_worker_prefills(pair) -> None:
    """The prefill worker returns them in its PrefillResult; a decode worker that prefills a
    request itself sends them on its first message: the same values either way."""
    p, d = pair
    [prompt] = _tokenize(["Score every token of this prompt, please"])
    params = pb.SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    res = prefill(p, "plp-p", prompt, params)
    msgs = list(decode_stream(d, "plp-d", prompt, params))
    assert [x.token_id for x in res.prompt_logprobs] == prompt[1:]
    here = msgs[0].prompt_logprobs
    assert [x.token_id for x in here] == prompt[1:] and not any(m.prompt_logprobs for m in msgs[1:])
    assert [x.logprob for x in here] == pytest.approx([x.logprob for x in res.prompt_logprobs],
                                                      abs=1e-5)
    assert all(len(x.top) == 2 for x in here)
    assert p.stub.Abort(pb.AbortRequest(request_id="plp-p"), timeout=5).found  # free its lease
    wait_until(lambda: idle(p) and idle(d), 10, "both workers idle")


LATENCY_HISTOGRAMS = ("request_queue_time_seconds", "request_prefill_time_seconds",
                      "time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "stage_decode_queue_seconds")


def _latency_samples(w) -> dict[str, float]:
    """_count and _sum of each worker latency histogram, plus finished requests."""
    text = scrape(w)
    out = {f"{h}_{s}": metric_value(text, f"pdserve:{h}_{s}")
           for h in LATENCY_HISTOGRAMS for s in ("count", "sum")}
    out["success"] = metric_value(text, "pdserve:request_success_total")
    return out


def test_worker_latency_histograms_observe_each_request(pair) -> None:
    """Each worker observes its own view of a request: queue, prefill, TTFT, ITL, e2e."""
    p, d = pair
    [prompt] = _tokenize(["Worker latency histograms count this request"])
    params = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    p0, d0 = _latency_samples(p), _latency_samples(d)
    colocated, _ = tokens_of(decode_stream(d, "lat-col", prompt, params))
    res = prefill(p, "lat-dis", prompt, params)
    disagg, _ = tokens_of(decode_stream(d, "lat-dis", prompt, params, res))
    assert len(colocated) == len(disagg) == 6
    p1, d1 = _latency_samples(p), _latency_samples(d)
    dp = {k: p1[k] - p0[k] for k in p0}
    dd = {k: d1[k] - d0[k] for k in d0}
    # P: one prefill (max_tokens 1 there), no inter-token gaps, no decode admission
    assert {h: dp[h + "_count"] for h in LATENCY_HISTOGRAMS} == {
        "request_queue_time_seconds": 1, "request_prefill_time_seconds": 1,
        "time_to_first_token_seconds": 1, "inter_token_latency_seconds": 0,
        "e2e_request_latency_seconds": 1, "stage_decode_queue_seconds": 0}
    # D: the colocated request (6 tokens: 5 gaps) and the disaggregated one, whose first
    # token came from P: D's own first token is its TTFT, then 4 gaps
    assert {h: dd[h + "_count"] for h in LATENCY_HISTOGRAMS} == {
        "request_queue_time_seconds": 2, "request_prefill_time_seconds": 2,
        "time_to_first_token_seconds": 2, "inter_token_latency_seconds": 5 + 4,
        "e2e_request_latency_seconds": 2, "stage_decode_queue_seconds": 1}
    assert dp["success"] == 1 and dd["success"] == 2
    for delta in (dp, dd):  # queue and prefill are the first token's prefix; e2e covers it
        assert 0 < delta["request_queue_time_seconds_sum"] + \
            delta["request_prefill_time_seconds_sum"] <= delta["time_to_first_token_seconds_sum"]
        assert delta["time_to_first_token_seconds_sum"] <= delta["e2e_request_latency_seconds_sum"]
    assert dd["inter_token_latency_seconds_sum"] > 0
    wait_until(lambda: idle(p) and idle(d), 10, "both workers idle")


def test_lease_expiry_frees_blocks_when_decode_never_pulls(pair) -> None:
    p, _ = pair
    [prompt] = _tokenize(["A request whose decode never comes"])
    res = prefill(p, "orphan", prompt, pb.SamplingParams(max_tokens=8, temperature=0))
    assert p.health().num_pinned_blocks == len(res.kv.block_ids) > 0
    wait_until(lambda: idle(p), LEASE_TTL_S + 30, "the lease to expire")
    metrics = scrape(p)
    assert 'pdserve:kv_lease_expired_total{role="prefill",worker="smol-p0"}' in metrics
    assert metric_value(metrics, "pdserve:kv_lease_expired_total") >= 1


def test_abort_before_pull_frees_at_once(pair) -> None:
    p, _ = pair
    [prompt] = _tokenize(["Abort me before the pull"])
    prefill(p, "abort-early", prompt, pb.SamplingParams(max_tokens=8, temperature=0))
    assert p.health().num_pinned_blocks > 0
    assert p.stub.Abort(pb.AbortRequest(request_id="abort-early"), timeout=5).found
    assert idle(p)  # at once, not after the lease


def test_decode_cancel_after_pull_frees_both_sides(pair) -> None:
    p, d = pair
    [prompt] = _tokenize(["Cancel me after a few tokens please"])
    params = pb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    res = prefill(p, "cancel-late", prompt, params)
    stream = decode_stream(d, "cancel-late", prompt, params, res)
    got = 0
    for out in stream:
        got += len(out.token_ids)
        if got >= 4:
            stream.cancel()
            break
    assert p.health().num_pinned_blocks == 0  # released right after the pull
    wait_until(lambda: idle(d), 5, "decode to free the cancelled request")


def _taken(d, rid: str, prompt: list[int], params: pb.SamplingParams) -> list[int] | None:
    """The tokens of a Decode under `rid`, or None while the worker still has the id."""
    try:
        return tokens_of(decode_stream(d, rid, prompt, params))[0]
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        return None


def test_a_request_id_in_use_is_refused_and_its_owner_unharmed(pair) -> None:
    """A second Decode or Prefill under an id the worker is serving (or holding) gets
    ALREADY_EXISTS: taken over, the first stream's outputs would go to the second one and
    its blocks could be freed under it or leaked."""
    p, d = pair
    [prompt] = _tokenize(["Only one stream may own this id"])
    params = pb.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want, _ = tokens_of(decode_stream(d, "dup-ref", prompt, params))
    first = decode_stream(d, "dup", prompt, params)
    got = list(next(first).token_ids)  # running on D now
    with pytest.raises(grpc.RpcError) as e:
        tokens_of(decode_stream(d, "dup", prompt, params))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in e.value.details()
    for out in first:
        got += out.token_ids
    assert got == want  # the owner streamed every token, none went to the refused call
    # a cancelled stream lets go of its id at once (its handler is woken, not left waiting
    # to its deadline): the router's next attempt under the id is taken
    cancelled = decode_stream(d, "dup-again", prompt, params, timeout_s=120)
    next(cancelled)
    cancelled.cancel()
    again = wait_until(lambda: _taken(d, "dup-again", prompt, params), 10,
                       "the cancelled stream's id to be free again")
    assert again == want
    res = prefill(p, "dup-held", prompt, params)  # held on P for its decode worker
    pinned = p.health().num_pinned_blocks
    with pytest.raises(grpc.RpcError) as e:
        prefill(p, "dup-held", prompt, params)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert p.health().num_pinned_blocks == pinned == len(res.kv.block_ids)  # lease kept
    toks, _ = tokens_of(decode_stream(d, "dup-held", prompt, params, res))
    assert toks == want  # the held blocks were still the owner's to read
    wait_until(lambda: idle(p) and idle(d), 10, "both workers idle")


@contextlib.contextmanager
def _tiny_pair(name: str, prefill_kw: dict, decode_kw: dict) -> Iterator[tuple]:
    """A tiny-llama prefill and decode worker (4-token blocks), introduced; killed on exit."""
    start_ray()
    p = start_worker("prefill", f"{name}-p", model="tiny-llama", block_size=4, **prefill_kw)
    d = start_worker("decode", f"{name}-d", model="tiny-llama", block_size=4, **decode_kw)
    try:
        assert introduce(p, d).accepted
        yield p, d
    finally:
        for w in (p, d):
            ray.kill(w.actor, no_restart=True)


TINY_PROMPT = list(range(5, 30))  # 25 tokens: 7 blocks of 4


def _six(policy: str | None = None) -> pb.SamplingParams:
    """6 greedy tokens past EOS, with a transfer_failure_policy if given."""
    extra = {"transfer_failure_policy": policy} if policy else {}
    return pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **extra)


def test_lost_release_cannot_hang_a_request() -> None:
    with _tiny_pair("lossy", dict(num_blocks=64, lease_ttl_s=1.0,
                                  faults=FaultConfig(drop_release_prob=1.0)),
                    dict(num_blocks=64)) as (p, d):
        prompt = TINY_PROMPT
        for policy in ("recompute", "fail"):
            params = _six(policy)
            res = prefill(p, f"lost-{policy}", prompt, params)
            start = time.monotonic()
            if policy == "recompute":  # completes by prefilling locally
                toks, reason = tokens_of(decode_stream(d, f"lost-{policy}", prompt, params, res,
                                                       timeout_s=20))
                assert len(toks) == 6 and reason == "length"
            else:  # ends with a clear error, not a hang
                with pytest.raises(grpc.RpcError) as e:
                    tokens_of(decode_stream(d, f"lost-{policy}", prompt, params, res, timeout_s=20))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "kv_transfer" in e.value.details()
            assert time.monotonic() - start < 20
        # the local re-prefill is visible (ANCHORS #5): once, for the "recompute" request
        wait_until(lambda: metric_value(scrape(d), "pdserve:kv_recompute_fallbacks_total") >= 1,
                   10, "the recompute fallback counted on the decode worker")
        assert metric_value(scrape(d), "pdserve:kv_recompute_fallbacks_total") == 1
        wait_until(lambda: idle(p) and idle(d), 10, "leases to expire on both")


def test_a_lease_that_expires_during_the_read_is_never_decoded_from() -> None:
    """ANCHORS #6: decode's read takes longer (2.5 s, injected) than prefill's lease (1 s).
    Meanwhile the lease expires, prefill frees the blocks and another request writes over
    them. Decode must not decode from what it read: "recompute" gives the tokens decode
    alone gives, "fail" a clear UNAVAILABLE naming the transfer; prefill counts both
    expiries."""
    with _tiny_pair("expiry", dict(num_blocks=16, lease_ttl_s=1.0),
                    dict(num_blocks=64, faults=FaultConfig(delay_s=2.5))) as (p, d):
        prompt, greedy = TINY_PROMPT, _six()  # 7 of prefill's 16 blocks
        want = tokens_of(decode_stream(d, "expiry-alone", prompt, greedy))
        before = _transfer_samples(p)
        for policy in ("recompute", "fail"):
            params = _six(policy)
            res = prefill(p, f"expiry-{policy}", prompt, params)
            got: list = []
            reader = threading.Thread(target=lambda: got.append(_outcome(
                decode_stream(d, f"expiry-{policy}", prompt, params, res, timeout_s=30))))
            reader.start()
            time.sleep(1.5)  # past the lease: 15 blocks of other tokens over the freed ones
            other = list(range(100, 160))
            prefill(p, f"expiry-other-{policy}", other, greedy)
            p.stub.Abort(pb.AbortRequest(request_id=f"expiry-other-{policy}"), timeout=10)
            reader.join(40)
            assert not reader.is_alive()
            if policy == "recompute":
                assert got == [want]
            else:
                assert got[0][0] == grpc.StatusCode.UNAVAILABLE and "kv_transfer" in got[0][1]
        after = _transfer_samples(p)
        for name in ("pdserve:kv_lease_expired_total", "pdserve:nixl_num_kv_expired_reqs_total"):
            assert after[name] == before[name] + 2, name
        wait_until(lambda: idle(p) and idle(d), 10, "nothing held on either side")


def test_a_read_past_the_transfer_timeout_ends_at_it() -> None:
    """ANCHORS #1 at the worker: a read that would take 60 s (injected) ends at decode's
    transfer_timeout_s (1 s), not at the request's deadline: "fail" is UNAVAILABLE naming the
    transfer within a few seconds, "recompute" decodes what decode alone gives; nothing
    stays held."""
    # the lease outlives the 1 s read, and frees the blocks after it
    with _tiny_pair("slow", dict(num_blocks=64, lease_ttl_s=10.0),
                    dict(num_blocks=64, transfer_timeout_s=1.0,
                         faults=FaultConfig(delay_s=60.0))) as (p, d):
        prompt, greedy = TINY_PROMPT, _six()
        want = tokens_of(decode_stream(d, "slow-alone", prompt, greedy))
        before = _transfer_samples(d)
        for policy in ("fail", "recompute"):
            params = _six(policy)
            res = prefill(p, f"slow-{policy}", prompt, params)
            start = time.monotonic()
            got = _outcome(decode_stream(d, f"slow-{policy}", prompt, params, res,
                                         timeout_s=120))
            assert time.monotonic() - start < 15  # 1 s and the local prefill, not 60 or 120
            if policy == "fail":
                assert got[0] == grpc.StatusCode.UNAVAILABLE and "kv_transfer" in got[1]
            else:
                assert got == want
        after = _transfer_samples(d)  # both reads failed, under both names
        for name in ("pdserve:kv_transfer_failures_total",
                     "pdserve:nixl_num_failed_transfers_total"):
            assert after[name] == before[name] + 2, name
        wait_until(lambda: idle(p) and idle(d), 30, "nothing held on either side")


def _outcome(stream) -> tuple:
    """(tokens, finish reason) of a decode stream, or (its gRPC code, details)."""
    try:
        return tokens_of(stream)
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_mismatched_decode_is_refused_at_handshake(pair) -> None:
    p, _ = pair
    other_block = start_worker("decode", "smol-d-bs32", block_size=32)
    other_model = start_worker("decode", "tiny-d", model="tiny-llama")
    try:
        reply = introduce(p, other_block)
        assert not reply.accepted and "block_size: 32 != 16" in reply.reason  # local != peer
        reply = introduce(p, other_model)
        assert not reply.accepted and "model." in reply.reason
    finally:
        for w in (other_block, other_model):
            ray.kill(w.actor, no_restart=True)


def test_killed_prefill_gives_typed_error_within_deadline() -> None:
    start_ray()
    p = start_worker("prefill", "doomed-p", max_num_batched_tokens=32)
    prompt = list(range(100, 1900))  # ~56 chunks of 32 tokens: long enough to kill mid-way
    errors: list[grpc.RpcError] = []

    def run() -> None:
        try:
            prefill(p, "doomed", prompt, pb.SamplingParams(max_tokens=4), timeout_s=30)
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    start = time.monotonic()
    t.start()
    wait_until(lambda: p.health().num_running > 0, 30, "the prefill to start")
    ray.kill(p.actor, no_restart=True)
    t.join(35)
    assert not t.is_alive()
    assert errors and errors[0].code() in (grpc.StatusCode.UNAVAILABLE,
                                           grpc.StatusCode.CANCELLED)
    assert time.monotonic() - start < 35


def test_killed_decode_leaves_pins_to_the_lease() -> None:
    start_ray()
    p = start_worker("prefill", "survivor-p", model="tiny-llama", block_size=4, num_blocks=64,
                     lease_ttl_s=1.5)
    d = start_worker("decode", "victim-d", model="tiny-llama", block_size=4, num_blocks=64,
                     faults=FaultConfig(delay_s=30.0))  # the read hangs until we kill D
    try:
        assert introduce(p, d).accepted
        prompt = list(range(5, 40))
        params = pb.SamplingParams(max_tokens=8, temperature=0)
        res = prefill(p, "orphaned", prompt, params)
        stream = decode_stream(d, "orphaned", prompt, params, res, timeout_s=60)
        next(stream)  # the first token: D admitted it and is now reading
        ray.kill(d.actor, no_restart=True)
        with pytest.raises(grpc.RpcError):
            list(stream)
        wait_until(lambda: idle(p), 10, "the prefill side's lease to expire")
    finally:
        ray.kill(p.actor, no_restart=True)


def test_cancel_during_the_pull_frees_both_sides_once_the_read_returns() -> None:
    """ANCHORS #2: a client that leaves while decode's NIXL read is in flight. Decode's
    blocks are being written, so they stay held until the read returns (freed earlier, they
    could already belong to another request); then both sides free at once, long before P's
    lease would have expired."""
    start_ray()
    p = start_worker("prefill", "pull-cancel-p", model="tiny-llama", block_size=4,
                     num_blocks=64, lease_ttl_s=120.0)
    d = start_worker("decode", "pull-cancel-d", model="tiny-llama", block_size=4,
                     num_blocks=64, faults=FaultConfig(delay_s=5.0))
    try:
        assert introduce(p, d).accepted
        prompt = TINY_PROMPT
        params = pb.SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        res = prefill(p, "pull-cancel", prompt, params)
        stream = decode_stream(d, "pull-cancel", prompt, params, res)
        next(stream)  # the first token (P's): the read is posted right after it
        time.sleep(0.5)
        start = time.monotonic()
        stream.cancel()
        h = d.health()  # the read (5 s) is still in flight: its blocks are still held
        assert time.monotonic() - start < 4 and h.num_free_blocks < h.num_total_blocks
        assert p.health().num_pinned_blocks > 0
        wait_until(lambda: idle(p) and idle(d), 20, "both sides to free after the read")
        assert time.monotonic() - start < 60  # the release, not the 120 s lease
        assert metric_value(scrape(d), "pdserve:kv_recompute_fallbacks_total") == 0
    finally:
        for w in (p, d):
            ray.kill(w.actor, no_restart=True)


def test_worker_processes_freeze_their_startup_heap(pair) -> None:
    """Each worker actor, once serving, moved its start-up heap (torch, the model, Triton)
    out of the garbage collector's scans (engine/exec/heap.py), so a full collection's
    pause no longer lands in a decode step; the tests above ran on these frozen workers.
    The test process, which only calls the library, is not frozen."""
    import gc

    for w in pair:
        frozen = ray.get(w.actor.gc_frozen_objects.remote(), timeout=30)
        assert frozen > 10_000, (w.cfg.worker_id, frozen)
    assert gc.get_freeze_count() == 0
