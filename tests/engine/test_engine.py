"""End-to-end engine tests on the embedded SmolLM2-135M-Instruct (CPU, float32)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from pdserve.engine.core.sampling_params import (
    DuplicateRequestError,
    InvalidRequestError,
    SamplingParams,
)
from pdserve.engine.llm import LLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three primary colors:",
    "Water boils at",
    "The quick brown fox",
    "In machine learning, a transformer is",
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def hf_greedy(llm: LLM, hf_smollm2_dir) -> list[list[int]]:
    """transformers' own greedy generate() on the same GGUF (dequantised by transformers)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_smollm2_dir, dtype=torch.float32)
    hf.eval()
    outs = []
    for p in PROMPTS:
        outs.append(_hf_greedy(hf, llm.tokenizer.encode(p), 32))
    return outs


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' forward and its own KV cache; EOS does not stop
    it (like ignore_eos), so the 32 tokens compare one to one."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_greedy_matches_transformers_one_at_a_time(llm: LLM, hf_greedy: list[list[int]]) -> None:
    for prompt, expected in zip(PROMPTS, hf_greedy):
        [res] = llm.generate(prompt, GREEDY)
        assert res.outputs[0].token_ids == expected, prompt


def test_greedy_matches_transformers_as_one_batch(llm: LLM, hf_greedy: list[list[int]]) -> None:
    results = llm.generate(PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in results] == hf_greedy


def test_generate_cli_answers_paris() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.router.cli", "generate", "--chat",
                          "--device", "cpu", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_shared_prefix_computes_only_the_suffix(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    prefix = list(range(1000, 1200))  # 200 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [first] = llm.generate([prefix + [5, 6, 7]], params)
    hits_before, queries_before = bm.prefix_cache_hits, bm.prefix_cache_queries
    second_prompt = prefix + [9, 10, 11, 12]
    [second] = llm.generate([second_prompt], params)
    bs = llm.engine.config.cache.block_size
    cached = (200 // bs) * bs
    assert bm.prefix_cache_hits - hits_before == cached
    assert second.num_cached_tokens == cached
    assert bm.prefix_cache_queries > queries_before
    # identical output to a run with a cold cache
    cold = LLM(device="cpu", dtype="float32", enable_prefix_caching=False)
    [reference] = cold.generate([second_prompt], params)
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert first.outputs[0].token_ids  # the first request really ran


def test_tiny_kv_pool_preempts_and_still_matches(llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    small = LLM(device="cpu", dtype="float32", num_blocks=12, block_size=4)
    results = small.generate(PROMPTS, params)
    assert [r.outputs[0].token_ids for r in results] == reference
    assert small.engine.scheduler.num_preemptions > 0


def test_n4_shares_the_prompt_blocks(llm: LLM) -> None:
    bs = llm.engine.config.cache.block_size
    prompt = list(range(2000, 2000 + 4 * bs + 3))  # 4 full blocks + a partial one
    bm = llm.engine.scheduler.block_manager
    before = bm.num_allocations
    [res] = llm.generate([prompt], SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=7,
                                                  ignore_eos=True))
    assert len(res.outputs) == 4
    assert all(len(c.token_ids) == 4 for c in res.outputs)
    allocated = bm.num_allocations - before
    # the 4 full prompt blocks once, then one partial tail block per completion: 4 + 4
    assert allocated == 4 + 4
    assert allocated < 4 * math.ceil(len(prompt) / bs)  # what 4 separate requests would take
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1  # siblings sample independently


def test_seeded_sampling_reproduces(llm: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    a = llm.generate(PROMPTS[:3], p)
    b = llm.generate(PROMPTS[:3][::-1], p)[::-1]
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]


def test_a_live_request_id_is_refused_and_the_first_request_unharmed(llm: LLM) -> None:
    """A second request under a live id is refused before it builds any state: its grammar
    (keyed by the id) would otherwise replace the first one's mid-generation."""
    from pdserve.engine.core.sampling_params import StructuredOutput

    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                       structured=StructuredOutput(regex="[a-z ]+"))
    [want] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS[:1], p)]
    e = llm.engine
    e.add_request(PROMPTS[0], p, request_id="dup")
    first = [t for o in e.step() + e.step() if o.request_id == "dup" for t in o.new_token_ids]
    other = SamplingParams(max_tokens=12, structured=StructuredOutput(regex="[0-9]+"))
    for add in (lambda: e.add_request(PROMPTS[1], other, request_id="dup"),
                lambda: e.add_remote_request("dup", [1, 2, 3], 5, other)):
        with pytest.raises(DuplicateRequestError, match="request_id: 'dup' is already in use"):
            add()
    rest = [t for o in e.generate_until_done(deadline_s=120) if o.request_id == "dup"
            for t in o.new_token_ids]
    assert first and first + rest == want  # still under its own grammar


def test_stop_string_ends_output_and_is_not_included(llm: LLM) -> None:
    [full] = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, temperature=0))
    text = full.outputs[0].text
    assert " 7," in text
    [stopped] = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, temperature=0,
                                                           stop=(" 7,",)))
    assert stopped.outputs[0].text == text[: text.index(" 7,")]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == " 7,"
    assert full.outputs[0].stop_reason is None


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and field in str(e.value)


def test_top_k_zero_is_off_as_in_vllm() -> None:
    assert SamplingParams(top_k=0).top_k == SamplingParams().top_k == -1
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_k=False)


def test_bad_prompts_name_the_field(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate("", SamplingParams())
    max_len = llm.engine.config.scheduler.max_model_len
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([1] * (max_len - 4), SamplingParams(max_tokens=16))
    assert e.value.param in ("max_tokens", "prompt")
    assert not llm.engine.has_unfinished()  # nothing half-admitted


def test_unknown_preset_names_the_model() -> None:
    with pytest.raises(ValueError, match="model"):
        LLM("no-such-preset-xyz", device="cpu")
