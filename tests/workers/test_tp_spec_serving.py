"""MTP speculative decoding in a serving tensor-parallel worker (worker/tp_worker.py), on a
real local Ray instance with real NIXL (UCX, host memory) between the ranks' transports: a
tiny transformers GLM-4.5 with its own MTP layer (tests/dist/test_tp_spec.py's checkpoint)
served disaggregated, prefill TP 1 or TP 2 -> decode TP 2 drafting with MTP. The decode
worker's rank 0 leads the drafting passes and its follower rank runs them over its shard of
the MTP layer; the prefill worker writes the MTP layer's KV of the prompt and ships the last
hidden state, so the decode worker drafts from its first step. Greedy tokens equal the
offline TP-1 engine's without MTP; the decode worker drafts and accepts exactly what the
offline TP-1 engine with MTP does (so the prompt's MTP KV arrived: drafts over a missing
one would differ); the KV each decode rank holds is bitwise the prefill ranks', every layer
of it (the MTP layer's too) moved; no block leaks."""
from __future__ import annotations

from pathlib import Path

import pytest
import ray

from pdserve.engine.core.config import SpecConfig
from pdserve.proto import pdserve_pb2 as pb

from tests.engine.hf_families import prompt, save_checkpoint
from tests.workers.cluster import (
    decode_stream,
    idle,
    introduce,
    metric_value,
    prefill,
    scrape,
    start_ray,
    tokens_of,
    wait_until,
)
from tests.workers.tp_cluster import ENGINE, head_digests, start_tp_worker, stop

pytest.importorskip("transformers")

K = 2  # drafts per verify
N = 16  # tokens per request
PROMPTS = [prompt(n, 50 + n) for n in (6, 13, 9)]
GREEDY = pb.SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
SPEC = SpecConfig(num_speculative_tokens=K, batch_k_caps=())
OFFLINE = {k: v for k, v in ENGINE.items() if k != "max_num_seqs"}
# one whole block over every KV head: (3 decoder layers + the MTP layer) x K/V x 4 tokens x
# 2 KV heads x 32 dims x float32
BLOCK_BYTES = (3 + 1) * 2 * 4 * 2 * 32 * 4
SPEC_METRICS = ("pdserve:spec_decode_num_drafts_total",
                "pdserve:spec_decode_num_draft_tokens_total",
                "pdserve:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.dist.test_tp_spec import drafting_mtp_layer

    folder = tmp_path_factory.mktemp("glm4-moe-mtp-serve")
    save_checkpoint("glm4_moe", folder, mtp=True)
    drafting_mtp_layer("glm4_moe", folder)  # drafts the target accepts: acceptance > 0
    return folder


def _offline(folder: Path, spec: SpecConfig | None) -> tuple[list[list[int]], tuple]:
    """The offline TP-1 engine, one request at a time as the tests send them: (tokens per
    prompt, (verifies, drafts, accepted) summed; () without MTP)."""
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    with LLM(str(folder), speculative=spec, **OFFLINE) as llm:
        out = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
        s = llm.engine.spec_stats
        return out, () if s is None else (s.num_drafts, s.num_draft_tokens,
                                          s.num_accepted_tokens)


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> tuple[list[list[int]], tuple]:
    """(TP-1 greedy without MTP: what every pair must produce, TP-1 spec stats with MTP)."""
    want, _ = _offline(checkpoint, None)
    with_mtp, stats = _offline(checkpoint, SPEC)
    assert with_mtp == want and stats[1] > 0 and stats[2] > 0, stats
    return want, stats


@pytest.fixture(scope="module")
def workers(checkpoint: Path):
    """MTP workers started on first use and shared by the module's tests: get(role, tp)."""
    start_ray()
    started: dict[tuple[str, int], object] = {}

    def get(role: str, tp: int):
        if (role, tp) not in started:
            started[role, tp] = start_tp_worker(role, f"mtp-tp{tp}-{role}", str(checkpoint), tp,
                                                speculative=SPEC, lease_ttl_s=5.0,
                                                tp_timeout_s=60.0)
        return started[role, tp]
    yield get
    stop(*started.values())


def _spec_counters(w) -> tuple[float, ...]:
    text = scrape(w)
    return tuple(metric_value(text, m) for m in SPEC_METRICS)


@pytest.mark.parametrize("ptp", [1, 2])
def test_decode_tp2_drafts_with_mtp_and_equals_tp1_greedy(workers, offline, ptp) -> None:
    want, want_stats = offline
    p, d = workers("prefill", ptp), workers("decode", 2)
    reply = introduce(p, d)
    assert reply.accepted, reply.reason  # the same MTP head id on both: compatible KV
    pulled_before = metric_value(scrape(d), "pdserve:kv_transfer_bytes_total")
    before = _spec_counters(d)
    blocks = 0
    for i, tokens in enumerate(PROMPTS):
        rid = f"mtp-p{ptp}d2-{i}"
        res = prefill(p, rid, tokens, GREEDY)
        assert len(res.last_hidden_state) > 0  # shipped for the decode worker's first drafts
        # every layer's KV of the prompt but the last position, whose MTP KV the decode
        # worker writes itself from the shipped hidden state (and the first sampled token)
        n = len(tokens) - 1
        heads = head_digests(p, list(res.kv.block_ids), n)
        toks, reason = tokens_of(decode_stream(d, rid, tokens, GREEDY, res))
        assert (toks, reason) == (want[i], "length"), f"P{ptp}->D2 prompt {i}"
        pulls = {r: (loc, m) for r, _, loc, m in ray.get(d.actor.recent_pulls.remote())}
        local, m = pulls[rid]
        assert m == len(tokens)
        assert head_digests(d, local, n) == heads, f"P{ptp}->D2 prompt {i}: KV heads differ"
        blocks += len(local)

    def stats() -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(_spec_counters(d), before))
    # the counters follow the engine on the worker's tick: wait for the last verify's
    wait_until(lambda: stats()[0] >= want_stats[0], 20, "the decode worker's spec counters")
    assert stats() == want_stats  # drafted and accepted exactly as the offline MTP engine
    # whole blocks of every KV head and every layer, the MTP layer's included
    pulled = metric_value(scrape(d), "pdserve:kv_transfer_bytes_total") - pulled_before
    assert pulled == blocks * BLOCK_BYTES
    wait_until(lambda: idle(p) and idle(d), 20, "both workers idle (no leaked blocks)")
