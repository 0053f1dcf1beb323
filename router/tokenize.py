"""vLLM's /tokenize and /detokenize: the router's own tokenizer, no worker involved.

    POST /tokenize   {"prompt": "text" | [ids]}                  -> {count, max_model_len,
                     {"messages": [...], tools?, template options} tokens, token_strs?}
    POST /detokenize {"tokens": [ids]}                          -> {prompt}

A chat body renders exactly as /v1/chat/completions renders it (protocol.chat_prompt_ids),
so `count` is the prompt_tokens that a completion would report.
"""
from __future__ import annotations

from pdserve.router.errors import BadRequest
from pdserve.router.frontend import Frontend
from pdserve.router.protocol import chat_prompt_ids
from pdserve.router.structured import parse_tools


def tokenize(body: dict, fe: Frontend) -> dict:
    fe.check_model(body.get("model"))
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("prompt: give either prompt or messages", param="prompt")
    if "messages" in body:
        ids = chat_prompt_ids(body, fe, parse_tools(body), fe.tool_format())
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, (str, list)):
            raise BadRequest("prompt: must be a string or a list of token ids", param="prompt")
        ids = fe.encode_prompt(prompt)
    out: dict = {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids,
                 "token_strs": None}
    strs = body.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise BadRequest("return_token_strs: must be a boolean", param="return_token_strs")
    if strs:
        out["token_strs"] = [fe.token_text(t) for t in ids]
    return out


def detokenize(body: dict, fe: Frontend) -> dict:
    fe.check_model(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise BadRequest("tokens: must be a non-empty list of token ids", param="tokens")
    ids = fe.encode_prompt(tokens, param="tokens")  # range-checks the ids
    if fe.tokenizer is None:
        raise BadRequest("tokens: this model has no tokenizer", param="tokens")
    return {"prompt": fe.tokenizer.decode(ids)}
