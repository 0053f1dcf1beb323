"""vLLM's chat extensions on /v1/chat/completions, parsed by router/protocol.py and rendered
by the default model's own template (engine/model/tokenizer.py): continue_final_message
(an assistant prefill the model continues), add_generation_prompt, chat_template_kwargs.
The rendered prompt is compared with transformers' apply_chat_template on the same template.
Bad combinations are refused naming the field (tests/router/test_http_fake.py BAD)."""
from __future__ import annotations

import dataclasses

import pytest

from pdserve.router.protocol import parse_chat

PREFILL = [{"role": "user", "content": "Capital of France?"},
           {"role": "assistant", "content": "The capital is "}]


def _rendered(frontend, body: dict) -> str:
    req = parse_chat(body, frontend, lambda n: 8)
    return frontend.tokenizer.decode(req.prompts[0], skip_special_tokens=False)


def _transformers_render(frontend, messages: list[dict], **kw: object) -> str:
    """The same template through transformers' own renderer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Backend

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Backend.from_str(frontend.tokenizer.backend.to_str()))
    tok.chat_template = frontend.tokenizer.chat_template
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_continue_final_message_ends_inside_the_assistant_turn(frontend) -> None:
    text = _rendered(frontend, {"messages": PREFILL, "continue_final_message": True,
                                "add_generation_prompt": False})
    want = _transformers_render(frontend, PREFILL, continue_final_message=True,
                                add_generation_prompt=False)
    assert text == want
    assert text.endswith("The capital is ")  # no end-of-turn, no new assistant turn


def test_without_it_the_prefill_is_a_closed_turn_and_a_new_one_opens(frontend) -> None:
    text = _rendered(frontend, {"messages": PREFILL})
    assert text == _transformers_render(frontend, PREFILL, add_generation_prompt=True)
    assert not text.endswith("The capital is ")


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(frontend) -> None:
    msgs = PREFILL[:1]
    with_prompt = _rendered(frontend, {"messages": msgs})
    without = _rendered(frontend, {"messages": msgs, "add_generation_prompt": False})
    assert without == _transformers_render(frontend, msgs, add_generation_prompt=False)
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)


def test_chat_template_kwargs_reach_the_template(frontend) -> None:
    """A template variable (as Qwen3's enable_thinking is) changes the rendered prompt."""
    from pdserve.engine.model.tokenizer import Tokenizer

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% if not enable_thinking %} "
                "<think></think>{% endif %}{% endif %}")
    tok = frontend.tokenizer
    fe = dataclasses.replace(frontend, tokenizer=Tokenizer(
        tok.backend, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
        chat_template=template))
    msgs = PREFILL[:1]
    plain = _rendered(fe, {"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})
    off = _rendered(fe, {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    assert plain.endswith("assistant:") and off.endswith("assistant: <think></think>")
