"""Structured outputs in the engine (CPU): the compile cache and its deadline, the bitmask in
the sampler (greedy and random rows, neighbours without a grammar untouched), generations
that match a JSON schema / choice / regex, the grammar ending a request, resumed requests
replaying their tokens, and MTP verification masking each draft position (the output equals
non-speculative decoding under the same grammar)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.core.sampling_params import StructuredOutput as SO
from pdserve.engine.exec.sampler import Sampler
from pdserve.engine.llm import LLM
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.matcher import (
    BitmaskFiller,
    GrammarState,
    apply_bitmask,
    batch_bitmask,
    host_bitmask,
)

from tests.engine.tiny_vocab import EOS, tiny_tokenizer

TINY = dict(device="cpu", block_size=4, num_blocks=256)
VOCAB = 512
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(4)]
SCHEMA = {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["color", "count"], "additionalProperties": False}
REGEX = r"(ab|ba|a){1,6}[0-9]{2}"  # bounded: a greedy run cannot loop forever
# seconds to compile (bounded repetitions of character classes, many properties)
SLOW_SCHEMA = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"[a-z]{{1,{i + 3}}}[0-9]{{2,{i + 5}}}"}
    for i in range(80)}}
TOK = tiny_tokenizer()


def tiny_llm(**kw: object) -> LLM:
    llm = LLM("tiny-qwen3", **TINY, **kw)
    llm.engine.tokenizer = llm.tokenizer = TOK  # the presets ship no tokenizer
    return llm


def greedy(structured: SO | None = None, n: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, structured=structured, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny_llm()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOK, VOCAB, (EOS,))


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    return {t for t in range(VOCAB) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


# -- compiler ------------------------------------------------------------------------------------
def test_compile_cache_deadline_and_errors_name_the_field(compiler: GrammarCompiler) -> None:
    spec = SO(json=json.dumps(SCHEMA))
    before = compiler.compiles
    assert compiler.compile(spec) is compiler.compile(SO(json=json.dumps(SCHEMA)))
    assert compiler.compiles == before + 1  # equal specs: one compile
    for bad, param in ((SO(regex="(("), "structured_outputs.regex"),
                       (SO(json='{"type": "objectx"}'), "response_format.json_schema.schema"),
                       (SO(grammar="root ::= nothing"), "structured_outputs.grammar")):
        with pytest.raises(InvalidRequestError) as e:
            compiler.compile(bad, param=param)
        assert e.value.param == param and "cannot be compiled" in str(e.value)
        assert "/project/" not in str(e.value)  # xgrammar's source location is cut
    slow = SO(json=json.dumps(SLOW_SCHEMA))
    with pytest.raises(InvalidRequestError, match="took longer than 0.01 s") as e:
        compiler.compile(slow, timeout_s=0.01, param="tools[0].function.parameters")
    assert e.value.param == "tools[0].function.parameters"
    with pytest.raises(InvalidRequestError) as e:
        SO(choice=["a", ""])
    assert e.value.param == "structured_outputs.choice"


# -- the sampler ---------------------------------------------------------------------------------
def test_bitmask_forbids_tokens_greedy_and_random(compiler: GrammarCompiler) -> None:
    """Rows 0 and 2 allow only "a" / "b" (regex [ab]); the raw argmax is elsewhere. Greedy
    (the all-greedy fast path) and random rows keep to the mask; rows 1 and 3 without a
    grammar sample exactly what they sample in a batch without grammars."""
    a, b = TOK.encode("a")[0], TOK.encode("b")[0]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, 300] = 50.0  # the unconstrained favourite
    logits[:, b] = 5.0
    sampler = Sampler()

    def run(temps: list[float], grammar_rows: tuple[int, ...]) -> list[int]:
        reqs = [Request(f"r{i}", [1], SamplingParams(temperature=t, seed=i))
                for i, t in enumerate(temps)]
        states = [sampler.new_state(r, VOCAB, "cpu") for r in reqs]
        for i in grammar_rows:
            states[i].grammar = GrammarState(compiler.compile(SO(regex="[ab]")), (EOS,))
        return sampler(logits, reqs, states).token_ids

    for temps in ([0.0] * 4, [0.0, 0.0, 1.0, 1.0], [1.5] * 4):
        masked, plain = run(temps, (0, 2)), run(temps, ())
        assert masked[1::2] == plain[1::2] and plain[0] == 300
        assert {masked[0], masked[2]} <= {a, b}
        if temps[0] == 0.0:
            assert masked[0] == b  # the best allowed token
    draws = {run([1.0] * 4, (0, 2))[0] for _ in range(20)}
    assert draws <= {a, b}


def test_apply_bitmask_keeps_dtype_and_marks_forbidden_minus_inf() -> None:
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    bm = host_bitmask(2, VOCAB)
    bm[0] = 0
    bm[0, 1] = 1 << 3  # token 35 only
    out = apply_bitmask(logits, bm)
    assert out.dtype == torch.bfloat16 and torch.equal(out[1], logits[1])
    assert torch.isinf(out[0]).sum() == VOCAB - 1 and out[0, 35] == logits[0, 35]



def test_apply_bitmask_matches_the_unpacked_reference_on_odd_sizes() -> None:
    """The fused mask equals unpacking every bit (torch reference) for a vocabulary that is
    not a multiple of 32, random words (sign bit included), float32 and bfloat16."""
    gen = torch.Generator().manual_seed(3)
    for vocab, dtype in ((77, torch.float32), (1000, torch.bfloat16)):
        words = torch.randint(-(1 << 31), 1 << 31, (3, (vocab + 31) // 32), generator=gen,
                              dtype=torch.int64).to(torch.int32)
        logits = torch.randn(3, vocab, generator=gen).to(dtype)
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [3, W, 32]
        keep = bits.reshape(3, -1)[:, :vocab].bool()
        want = logits.masked_fill(~keep, float("-inf"))
        assert torch.equal(apply_bitmask(logits, words), want)


def test_threaded_filler_equals_row_by_row_fill_with_queued_accepts(
        compiler: GrammarCompiler) -> None:
    """BitmaskFiller (queued accepts, xgrammar's batch fill on 3 threads) gives the masks that
    accepting each token at once and filling row by row gives: rows without a grammar all
    allowed, a grammar that accepted EOS only EOS; a refused token raises at the fill."""
    text = '{"color": "green", "count": 7}'
    spec = compiler.compile(SO(json=json.dumps(SCHEMA)))
    ids = TOK.encode(text)
    cuts = [0, 1, 3, len(ids) // 2, len(ids) - 1, len(ids)]
    grammars: list[GrammarState | None] = []
    reference: list[GrammarState | None] = []
    for n in cuts:
        queued, eager = GrammarState(spec, (EOS,)), GrammarState(spec, (EOS,))
        eager.replay(ids[:n], "p")
        for t in ids[:n]:
            queued.accept(t)  # queued, not yet accepted
        grammars.append(queued)
        reference.append(eager)
        grammars.append(None)
        reference.append(None)
    ended = GrammarState(spec, (EOS,))
    for t in ids + [EOS]:
        ended.accept(t)
    assert ended.terminated  # a queued stop token is accepted on the spot
    grammars.append(ended)
    filler = BitmaskFiller(threads=3)
    got = filler.fill(grammars, VOCAB, torch.device("cpu"))
    want = batch_bitmask(reference, VOCAB)
    assert torch.equal(got[:-1], want) and allowed(got, len(grammars) - 1) == {EOS}
    assert allowed(got, 1) == set(range(VOCAB)) and len(allowed(got, 0)) < VOCAB
    bad = GrammarState(spec, (EOS,))
    bad.accept(TOK.encode("x")[0])  # '{' must come first
    with pytest.raises(RuntimeError, match="does not match the request's grammar"):
        filler.fill([None, bad, GrammarState(spec, (EOS,))], VOCAB, torch.device("cpu"))

# -- generation ----------------------------------------------------------------------------------
def test_json_schema_choice_and_regex_generations(llm: LLM) -> None:
    """A random model under a grammar: the JSON parses and validates, choice returns one of
    the choices, the regex matches; all finish "stop" (the grammar allowed EOS only at its
    end). Requests without a grammar in the same batch are unchanged."""
    plain = [greedy(n=12, ignore_eos=True), SamplingParams(max_tokens=12, temperature=0.8,
                                                          seed=5, ignore_eos=True)]
    want = [r.outputs[0].token_ids for r in llm.generate(PROMPTS[:2], plain)]
    choices = ("alpha", "beta", "gamma delta")
    params = [plain[0], plain[1], greedy(SO(json=json.dumps(SCHEMA))),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                             structured=SO(json=json.dumps(SCHEMA))),
              greedy(SO(choice=choices)), greedy(SO(regex=REGEX))]
    out = [r.outputs[0] for r in llm.generate(PROMPTS[:2] + PROMPTS[:4], params)]
    assert [o.token_ids for o in out[:2]] == want
    for o in out[2:4]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert out[4].text in choices
    assert re.fullmatch(REGEX, out[5].text)
    assert all(o.finish_reason == "stop" and o.token_ids[-1] == EOS for o in out[2:])


def test_grammar_ends_the_request_under_ignore_eos(llm: LLM) -> None:
    [res] = llm.generate(PROMPTS[0], greedy(SO(choice=("yes", "no")), ignore_eos=True))
    out = res.outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] == EOS  # nothing after the stop token the grammar accepted


def test_resumed_request_replays_its_tokens(llm: LLM) -> None:
    """A continued stream (resume_output_ids) rebuilds the matcher from the sent tokens and
    goes on exactly as the uninterrupted run; tokens the grammar rejects are a 400."""
    params = greedy(SO(json=json.dumps(SCHEMA)))
    [full] = llm.generate(PROMPTS[1], params)
    ids = full.outputs[0].token_ids
    rid = llm.engine.add_request(PROMPTS[1], params, resume_output_ids=ids[:5])[0]
    rest = [t for o in llm.engine.generate_until_done() if o.request_id == rid
            for t in o.new_token_ids]
    assert ids[:5] + rest == ids
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(PROMPTS[1], params, resume_output_ids=TOK.encode("nope"))
    assert e.value.param == "resume_output_ids"
    assert not llm.engine.has_unfinished() and not llm.engine.runner._states
    with pytest.raises(InvalidRequestError, match="structured_outputs: this model has no tok"):
        LLM("tiny-llama", **TINY).generate(PROMPTS[0], params)


# -- MTP -----------------------------------------------------------------------------------------
def spec_llm(k: int) -> LLM:
    return tiny_llm(speculative=SpecConfig(num_speculative_tokens=k, batch_k_caps=()))


def oracle(llm: LLM, reference: dict[tuple[int, ...], list[int]], seed: int) -> None:
    """Drafts = the reference continuation for a random number of positions, then tokens the
    grammar forbids (its raw argmax where that is forbidden, else a random id), so verify
    accepts some drafts and rejects forbidden ones (tests/engine/test_spec_decode.py's
    oracle, with the grammar in mind)."""
    runner, rng, real = llm.engine.runner, random.Random(seed), llm.engine.runner.run

    def run(out, *args, **kw):
        result = real(out, *args, **kw)
        for s in out.scheduled:
            rid = s.request.request_id
            if rid in result.drafts:
                seq = reference[tuple(s.request.prompt_token_ids)]
                base = len(s.request.output_token_ids) + len(result.sampled[rid])
                d, right = result.drafts[rid], rng.randint(0, len(result.drafts[rid]))
                result.drafts[rid] = [seq[base + i] if i < right and base + i < len(seq)
                                      else rng.choice((300, 301, 99)) for i in range(len(d))]
        return result

    runner.run = run


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_under_a_grammar_equals_plain_decoding(k: int, llm: LLM) -> None:
    specs = [SO(json=json.dumps(SCHEMA)), SO(regex=REGEX), None, SO(choice=("abc", "abd"))]
    params = [greedy(s, n=40, ignore_eos=s is None) for s in specs]
    want = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    spec = spec_llm(k)
    oracle(spec, {tuple(p): w for p, w in zip(PROMPTS, want)}, seed=k)
    got = [r.outputs[0] for r in spec.generate(PROMPTS, params)]
    assert [o.token_ids for o in got] == want
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    rand = SamplingParams(max_tokens=40, temperature=0.9, seed=2, structured=SO(regex=REGEX))
    [r] = spec.generate(PROMPTS[2], rand)
    assert re.fullmatch(REGEX, r.outputs[0].text)


def verify(llm: LLM, drafts: list[int], favourites: list[int]) -> list[int]:
    """SpecDecoder.verify of one greedy request under the regex "ab", with the target's
    logits made up: a, b, EOS in that order everywhere, and row i's favourite far above."""
    spec, sampler = llm.engine.runner.spec, llm.engine.runner.sampler
    a, b = TOK.encode("a")[0], TOK.encode("b")[0]
    req = Request("v", [1, 2, 3], greedy(SO(regex="ab")))
    state = sampler.new_state(req, VOCAB, "cpu")
    state.grammar = GrammarState(llm.engine.grammars.compile(SO(regex="ab")), (EOS,))
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    logits[:, a], logits[:, b], logits[:, EOS] = 1.0, 0.5, 0.25
    for row, tok in enumerate(favourites):
        logits[row, tok] = 9.0
    spec.model.compute_logits = lambda hidden, **kw: logits
    return spec.verify([(req, drafts, len(drafts))], torch.zeros(len(drafts) + 1, 8),
                       [state])["v"]


def test_verify_rejects_a_forbidden_draft_that_is_the_raw_argmax() -> None:
    """The target's unmasked favourite is forbidden: a draft of it is rejected and the masked
    argmax emitted. A draft that ends the grammar (EOS) is the last token emitted."""
    a, b, z = (TOK.encode(c)[0] for c in "abz")
    k2 = spec_llm(2)
    assert verify(k2, [z, b], [z, b, EOS]) == [a]  # z is the raw argmax, but forbidden
    assert verify(k2, [a, b], [z, b, z]) == [a, b, EOS]  # the bonus under the mask too
    assert verify(k2, [a, z], [a, z, z]) == [a, b]
    # k = 3: the third draft (EOS) ends the grammar; row 3's token is not emitted
    assert verify(spec_llm(3), [a, b, EOS], [a, b, EOS, z]) == [a, b, EOS]


# -- GPU: CUDA graphs, overlapped decode, the Triton argmax, draft graphs, device-side verify ---
GPU = dict(device="cuda", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=8,
           use_triton=True, use_cuda_graphs=True)


@pytest.mark.gpu
def test_gpu_fast_paths_keep_grammars_exact() -> None:
    """The mask on the device after graphed forwards and under overlapped decode: grammar
    requests match their grammars, their unconstrained neighbour is unchanged, and MTP (draft
    graphs; grammar requests skip the device-side verify) equals plain decoding."""
    specs = [SO(json=json.dumps(SCHEMA)), SO(regex=REGEX), None, SO(choice=("abc", "abd"))]
    params = [greedy(s, n=40, ignore_eos=s is None) for s in specs]
    plain = LLM("tiny-qwen3", **GPU)
    plain.engine.tokenizer = TOK
    alone = plain.generate(PROMPTS[2], params[2])[0].outputs[0].token_ids
    ahead = plain.engine.runner.ahead
    hits = ahead.hits
    out = [r.outputs[0] for r in plain.generate(PROMPTS, params)]
    assert ahead.hits > hits and out[2].token_ids == alone
    jsonschema.validate(json.loads(out[0].text), SCHEMA)
    assert re.fullmatch(REGEX, out[1].text) and out[3].text in ("abc", "abd")
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **GPU)
    spec.engine.tokenizer = TOK
    assert spec.engine.runner.spec.draft_graphs is not None
    assert [r.outputs[0].token_ids for r in spec.generate(PROMPTS, params)] == \
        [o.token_ids for o in out]
    assert spec.engine.spec_stats.num_drafts > 0


def test_the_engine_runs_without_xgrammar_installed() -> None:
    """xgrammar is imported on the first grammar request only: an environment without it (the
    GPU image) still loads and runs every engine module."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['xgrammar'] = None\n"
            "from pdserve.engine.llm import build_engine\n"
            "from pdserve.engine.core.sampling_params import SamplingParams\n"
            "import pdserve.router.frontend, pdserve.engine.spec.spec_decoder\n"
            "e = build_engine('tiny-qwen3', device='cpu', num_blocks=64)\n"
            "rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))[0]\n"
            "n = 0\n"
            "while e.has_unfinished():\n"
            "    n += sum(len(o.new_token_ids) for o in e.step())\n"
            "assert n == 3, n\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
