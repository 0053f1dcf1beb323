"""prompt_logprobs through the engine (CPU): every prompt token's logprob given the tokens
before it, and the top N there, equal to one unchunked forward over the prompt; across
prefill chunks, with a warm prefix cache (such requests skip it), next to plain requests in
the same batch; validation naming the field and the wire round trip."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.llm import LLM
from pdserve.proto.convert import (
    params_from_proto,
    params_to_proto,
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
)

from tests.engine.hf_families import BLOCK, Paged

PROMPT = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12, 13, 14, 200, 31, 77, 6]  # 17 tokens


@pytest.mark.parametrize("n", [-1, 21, 1.0, True])
def test_bad_prompt_logprobs_names_the_field(n: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=n)
    assert e.value.param == "prompt_logprobs"


def test_prompt_logprobs_cross_the_wire() -> None:
    assert params_from_proto(params_to_proto(SamplingParams(prompt_logprobs=3))).prompt_logprobs == 3
    assert params_from_proto(params_to_proto(SamplingParams())).prompt_logprobs is None
    entries = [(5, -1.25, [(5, -1.25), (9, -2.5)], 1), (9, -3.0, [], 7)]
    assert prompt_logprobs_from_proto(prompt_logprobs_to_proto(entries)) == entries


def _reference(model, prompt: list[int], top: int
               ) -> tuple[list[float], list[list[int]], list[int]]:
    """One forward over the whole prompt: logprob of token i + 1 at row i, the top ids, and
    the token's rank (its place in the row sorted by logprob, 1 = the top)."""
    paged = Paged(model, num_blocks=-(-len(prompt) // BLOCK) + 1)
    logits = paged.step([(prompt, 0, list(range(-(-len(prompt) // BLOCK))))])[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    chosen = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    order = logp.argsort(dim=-1, descending=True)
    ranks = [row.tolist().index(t) + 1 for row, t in zip(order, prompt[1:])]
    return chosen, logp.topk(top, dim=-1).indices.tolist(), ranks


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 5-token prefill chunks: the 17-token prompt spans four, boundaries inside blocks
    return LLM("tiny-qwen3", device="cpu", dtype="float32", block_size=4, num_blocks=256,
               max_num_batched_tokens=5)


def test_equal_to_one_forward_across_chunks_and_a_warm_cache(llm: LLM) -> None:
    want, want_top, want_rank = _reference(llm.engine.runner.model, PROMPT, 3)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=3, temperature=0)
    for _ in range(2):  # the second run finds the prompt's blocks cached, and must not use them
        first, other = llm.generate([PROMPT, PROMPT[:9]], [params, plain])
        got = first.prompt_logprobs
        assert [t for t, *_ in got] == PROMPT[1:]
        assert [c for _, c, *_ in got] == pytest.approx(want, abs=1e-4)
        assert [[i for i, _ in top] for _, _, top, _ in got] == want_top
        assert [r for *_, r in got] == want_rank  # random weights: no ties
        assert all(len(top) == 3 and top[0][1] >= top[-1][1] for _, _, top, _ in got)
        assert other.prompt_logprobs is None
    assert first.outputs[0].token_ids == llm.generate([PROMPT], plain)[0].outputs[0].token_ids


def test_zero_top_gives_the_tokens_own_logprobs_only(llm: LLM) -> None:
    [r] = llm.generate([PROMPT[:6]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert [t for t, *_ in r.prompt_logprobs] == PROMPT[1:6]
    assert all(top == [] and c <= 0 for _, c, top, _ in r.prompt_logprobs)


@pytest.mark.gpu
def test_gpu_fast_paths_equal_the_torch_path() -> None:
    """Triton prefill/decode kernels, CUDA graphs and overlapped decode, 16-token prefill
    chunks: the same prompt logprobs and top ids as the torch path on the same GPU (same
    preset weights) in one chunk, and a plain request beside it unchanged."""
    gpu = dict(device="cuda", dtype="float32", block_size=16, num_blocks=64)
    fast = LLM("tiny-qwen3", max_num_batched_tokens=16, use_triton=True, use_cuda_graphs=True,
               **gpu)
    ref = LLM("tiny-qwen3", max_num_batched_tokens=64, use_triton=False, use_cuda_graphs=False,
              **gpu)
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=4, temperature=0)
    prompt = PROMPT * 3  # 51 tokens: four 16-token chunks on the fast path
    [want] = ref.generate([prompt], params)
    got, other = fast.generate([prompt, PROMPT[:9]], [params, plain])
    assert [t for t, *_ in got.prompt_logprobs] == prompt[1:]
    assert ([c for _, c, *_ in got.prompt_logprobs]
            == pytest.approx([c for _, c, *_ in want.prompt_logprobs], abs=1e-3))
    assert ([[i for i, _ in top] for _, _, top, _ in got.prompt_logprobs]
            == [[i for i, _ in top] for _, _, top, _ in want.prompt_logprobs])
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert other.prompt_logprobs is None
    assert other.outputs[0].token_ids == ref.generate([PROMPT[:9]], plain)[0].outputs[0].token_ids
