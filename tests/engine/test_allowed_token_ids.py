"""vLLM's allowed_token_ids through the engine on a tiny random model (CPU): only those ids
are ever sampled (greedy and seeded random, the list applied after logit_bias), validation
names the field, the list crosses the wire, and MTP speculation leaves such requests token
for token equal to plain decoding (they are not drafted for)."""
from __future__ import annotations

import pytest

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.llm import LLM
from pdserve.proto.convert import params_from_proto, params_to_proto

TINY = dict(device="cpu", block_size=4, num_blocks=256)
VOCAB = 512  # tiny-qwen3's
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(4)]
ALLOWED = (11, 200, 321, 400, 501)


def params(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True, **{"temperature": 0.0, **kw})


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-qwen3", **TINY)


def test_only_allowed_ids_are_sampled(llm: LLM) -> None:
    plain = tokens(llm.generate(PROMPTS, params()))
    assert any(t not in ALLOWED for out in plain for t in out)  # the model would say others
    greedy = tokens(llm.generate(PROMPTS, params(allowed_token_ids=ALLOWED)))
    hot = tokens(llm.generate(PROMPTS, params(allowed_token_ids=list(ALLOWED),
                                              temperature=1.0, seed=5)))
    assert all(t in ALLOWED for out in greedy + hot for t in out)
    assert len({t for out in hot for t in out}) > 1  # sampled among them, not one forced id
    # after logit_bias: +100 on an id off the list cannot bring it back
    biased = tokens(llm.generate(PROMPTS[:1], params(allowed_token_ids=(321,),
                                                     logit_bias={7: 100.0})))
    assert biased == [[321] * 12]


def test_bad_allowed_token_ids_name_the_field(llm: LLM) -> None:
    for bad in ((), (-1,), (1.5,), (True,)):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(allowed_token_ids=bad)
        assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError) as e:  # refused before the request is admitted
        llm.generate(PROMPTS[0], params(allowed_token_ids=(3, VOCAB)))
    assert e.value.param == "allowed_token_ids" and str(VOCAB) in str(e.value)
    assert not llm.engine.has_unfinished()
    p = params(allowed_token_ids=ALLOWED)
    assert params_from_proto(params_to_proto(p)) == p
    assert params_from_proto(params_to_proto(params())).allowed_token_ids is None


def test_speculation_leaves_allow_listed_requests_equal_to_plain_decoding(llm: LLM) -> None:
    want = tokens(llm.generate(PROMPTS[:2], [params(allowed_token_ids=ALLOWED), params()]))
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **TINY)
    alone = spec.generate(PROMPTS[0], params(allowed_token_ids=ALLOWED))
    assert tokens(alone) == want[:1] and spec.engine.spec_stats.num_drafts == 0
    assert tokens(spec.generate(PROMPTS[:2], [params(allowed_token_ids=ALLOWED),
                                               params()])) == want
