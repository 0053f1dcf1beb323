"""logit_bias on both sides of the split: a prefill and a decode Worker in this process over
the in-process KV transport (tests/workers/test_disagg_inproc.py's pair). The prefill worker
samples token 0 and the decode worker the rest; the bias rides in SamplingParams to both."""
from __future__ import annotations

import pytest

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import build_engine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.convert import params_to_proto

from tests.workers.test_disagg_inproc import PROMPTS, TINY, inproc_pair

N = 10


def colocated(model: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = build_engine(model, **TINY)
    [rid] = engine.add_request(prompt, params)
    return [t for o in engine.generate_until_done() if o.request_id == rid for t in o.new_token_ids]


def disagg(ps: pbg.WorkerStub, ds: pbg.WorkerStub, rid: str, prompt: list[int],
           params: SamplingParams) -> tuple[int, list[int]]:
    """(the prefill worker's token 0, the whole decode stream), with params as the router
    sends them (proto/convert.py)."""
    msg = params_to_proto(params)
    res = ps.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=msg,
                                       timeout_s=60), timeout=65)
    assert res.HasField("kv")
    toks: list[int] = []
    for out in ds.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=msg,
                                          prefill=res, timeout_s=60), timeout=65):
        toks += list(out.token_ids)
    return res.first_token_id, toks


@pytest.mark.parametrize("model, engine", [("tiny-llama", {}),
                                           ("tiny-qwen3", {"speculative": "mtp",
                                                           "num_speculative_tokens": 2})])
def test_logit_bias_applies_on_the_prefill_and_the_decode_worker(model, engine) -> None:
    prompt = PROMPTS[1]
    greedy = dict(max_tokens=N, temperature=0.0, ignore_eos=True)
    plain = colocated(model, prompt, SamplingParams(**greedy))
    forced = next(t for t in range(100, 512) if t not in plain)
    # bans the plain run's token 0 (the prefill worker's draw) and a later one (the decode's)
    banned = {plain[0]: -100.0, plain[N // 2]: -100.0}
    with inproc_pair(model, **engine) as (_, _, ps, ds):
        first, toks = disagg(ps, ds, "plain", prompt, SamplingParams(**greedy))
        assert toks == plain and first == plain[0]  # the split itself changes nothing
        # +100: the prefill worker's token 0 and every decode worker token are that id
        first, toks = disagg(ps, ds, "forced", prompt, SamplingParams(**greedy,
                                                                      logit_bias={forced: 100}))
        assert first == forced and toks == [forced] * N
        # -100: token 0 changes on P, the banned ids never appear, and the whole stream is
        # what one colocated engine makes with the same bias
        params = SamplingParams(**greedy, logit_bias=banned)
        first, toks = disagg(ps, ds, "banned", prompt, params)
        assert first != plain[0] and not set(toks) & set(banned)
        assert toks == colocated(model, prompt, params)
        # seeded random: P draws token 0 and D continues the same per-position stream
        params = SamplingParams(max_tokens=N, temperature=0.9, seed=3, ignore_eos=True,
                                logit_bias={**banned, forced: 2.5})
        first, toks = disagg(ps, ds, "seeded", prompt, params)
        assert toks == colocated(model, prompt, params) and not set(toks) & set(banned)
