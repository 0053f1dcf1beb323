"""Structured outputs across the prefill/decode split: a prefill and a decode Worker in this
process over the in-process KV transport (test_disagg_inproc.py's pair), the grammar riding
in SamplingParams. P samples token 0 under the grammar; D rebuilds the matcher by replaying
it (or a continued stream's resume_output_ids) and goes on: the same greedy tokens as one
colocated engine, with MTP on D's side too."""
from __future__ import annotations

import json

import grpc
import pytest

from pdserve.engine.core.sampling_params import SamplingParams, StructuredOutput
from pdserve.engine.llm import build_engine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.convert import params_to_proto

from tests.engine.test_structured import REGEX, SCHEMA
from tests.engine.tiny_vocab import EOS, tiny_tokenizer
from tests.workers.test_disagg_inproc import PROMPTS, TINY, inproc_pair
from tests.workers.test_logit_bias_disagg import disagg

TOK = tiny_tokenizer()
SPECS = [StructuredOutput(json=json.dumps(SCHEMA)), StructuredOutput(regex=REGEX),
         StructuredOutput(choice=("abc", "abd", "xyz"))]


def colocated(model: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = build_engine(model, **TINY)
    engine.tokenizer = TOK
    [rid] = engine.add_request(prompt, params)
    return [t for o in engine.generate_until_done() if o.request_id == rid for t in o.new_token_ids]


@pytest.mark.parametrize("model, engine", [("tiny-llama", {}),
                                           ("tiny-qwen3", {"speculative": "mtp",
                                                           "num_speculative_tokens": 2})])
def test_grammar_on_both_sides_of_the_split_equals_colocated(model: str, engine: dict) -> None:
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, structured=s)
              for s in SPECS]
    want = [colocated(model, PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
    with inproc_pair(model, **engine) as (P, D, ps, ds):
        P.engine.tokenizer = D.engine.tokenizer = TOK
        for i, (p, w) in enumerate(zip(params, want)):
            first, toks = disagg(ps, ds, f"g{i}", PROMPTS[i % len(PROMPTS)], p)
            assert first == w[0] and toks == w and toks[-1] == EOS  # the grammar ended it
        if engine:
            assert D.engine.spec_stats.num_drafts > 0  # D drafted and verified under it
        # a continued stream: D replays the sent tokens into the matcher and goes on
        sent = want[0][:6]
        msg = params_to_proto(params[0])
        rest = [t for out in ds.Decode(pb.DecodeRequest(
            request_id="cont", prompt_token_ids=PROMPTS[0], params=msg, resume_output_ids=sent,
            timeout_s=60), timeout=65) for t in out.token_ids]
        assert sent + rest == want[0]
        # a first token the grammar rejects (not what P sampled) is refused, naming it
        res = ps.Prefill(pb.PrefillRequest(request_id="bad", prompt_token_ids=PROMPTS[1],
                                           params=msg, timeout_s=60), timeout=65)
        res.first_token_id = TOK.encode("z")[0]
        with pytest.raises(grpc.RpcError) as e:
            list(ds.Decode(pb.DecodeRequest(request_id="bad", prompt_token_ids=PROMPTS[1],
                                            params=msg, prefill=res, timeout_s=60), timeout=65))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("prefill.first_token_id: ")
