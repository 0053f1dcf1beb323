"""End to end: `pdserve serve --model <a tiny Qwen3-MoE folder>` (1 prefill + 1 decode CPU
worker), answered through the official openai client. The folder is what transformers'
save_pretrained writes (Qwen3MoeForCausalLM with random weights) plus the SmolLM2 tokenizer,
so the served greedy text can be checked against transformers' own generate()."""
from __future__ import annotations

import openai
import pytest
import torch

from tests.router.harness import ServeProcess, metric_sum, wait_until

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tok = transformers.AutoTokenizer.from_pretrained(hf_smollm2_dir)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # O(1) weights, so greedy text depends on every layer
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


@pytest.fixture(scope="module")
def server(folder):
    srv = ServeProcess(["--model", str(folder[0]), "--prefill", "1", "--decode", "1",
                        "--max-model-len", "256"])
    yield srv
    srv.stop()


def test_tiny_qwen3_moe_served_disaggregated_to_the_openai_client(folder, server):
    _, hf, tok = folder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    [model] = client.models.list().data
    prompt = "The capital of France is"
    out = client.completions.create(model=model.id, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, ids.shape[1]:]
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert out.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, stream=True)
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content) >= 1
    # the prompts were prefilled on the prefill worker: the split was used
    workers = {w["worker_id"]: w for w in server.health()["workers"]}
    wait_until(lambda: metric_sum(workers["prefill-0"]["metrics_address"],
                                  "prompt_tokens_total") >= ids.shape[1], 10,
               "the prefill worker to count the prompt")
