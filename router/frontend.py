"""The model as the router sees it: name, shape, context length and the one tokenizer.

The router tokenizes at the edge (DESIGN: Request flow, step 1) and never loads weights:
GGUF metadata and HF config.json / tokenizer.json are enough. A preset (random weights)
has no tokenizer, so it takes token-id prompts only.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.core.config import ModelConfig
from pdserve.engine.core.detokenizer import IncrementalDetokenizer
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from pdserve.engine.model.loader import EMBEDDED_HF_ID, EMBEDDED_MODEL, ModelSource, resolve_model
from pdserve.engine.model.tokenizer import Tokenizer, TokenizerError
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.router.errors import BadRequest, NotFound
from pdserve.router.tools import ToolFormat, pick_format

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat request renders (vLLM's chat extensions): with the assistant's generation
    prompt, or continuing the final (assistant) message; `variables` are extra template
    variables (chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: tuple[tuple[str, object], ...] = ()


@dataclass
class Frontend:
    model_id: str
    config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    aliases: frozenset[str] = field(default_factory=frozenset)
    tool_call_parser: str = ""  # hermes | llama3_json; "" / auto: from the chat template
    grammar_timeout_s: float = 10.0  # a spec that takes longer to compile is a 400
    _grammars: GrammarCompiler | None = field(default=None, init=False, repr=False,
                                              compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def check_model(self, name: object) -> None:
        if name is None:
            return  # like vLLM: a missing model means the served one
        if not isinstance(name, str):
            raise BadRequest("model: must be a string", param="model")
        if name != self.model_id and name not in self.aliases:
            raise NotFound(f"model: the model {name!r} does not exist; this server serves "
                           f"{self.model_id!r}", param="model")

    # -- text -> token ids ---------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], param: str = "prompt",
                      add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (text: with the tokenizer's BOS and the like
        unless add_special_tokens is false, vLLM's switch)."""
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest(f"{param}: must not be empty", param=param)
            if self.tokenizer is None:
                raise BadRequest(f"{param}: this model has no tokenizer; send token ids", param=param)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            vocab = self.config.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise BadRequest(f"{param}: token ids must be integers in [0, {vocab})", param=param)
        if not ids:
            raise BadRequest(f"{param}: must not be empty", param=param)
        return ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    options: TemplateOptions | None = None) -> list[int]:
        """Apply the model's chat template (the tools when given: router/structured.py
        decides; `options`: the generation prompt, continuing the final message, template
        variables) and tokenize."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise BadRequest("messages: this model has no chat template; use /v1/completions",
                             param="messages")
        opts = options or TemplateOptions()
        extra: dict = dict(opts.variables)
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=opts.add_generation_prompt,
                continue_final_message=opts.continue_final_message, **extra)
        except TokenizerError as e:  # continue_final_message on a template that hides it
            raise BadRequest(str(e), param="continue_final_message") from e
        except Exception as e:  # jinja's TemplateError (the template's raise_exception) and kin
            raise BadRequest(f"messages: the chat template rejected them: {e}", param="messages") from e
        # the template already wrote any BOS/special tokens (transformers does the same)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("messages: the rendered prompt is empty", param="messages")
        return ids

    def check_length(self, prompt_len: int, max_tokens: int, pool_tokens: int | None,
                     prompt_param: str = "prompt") -> None:
        """Reject what can never finish: over the context, or over the decode KV pool (ANCHORS
        #7); an over-long prompt is named prompt_param ("messages" for chat)."""
        limits = [(self.max_model_len, "the model's context length")]
        if pool_tokens:
            limits.append((pool_tokens, "the decode workers' KV cache pool"))
        for limit, what in limits:
            if prompt_len >= limit:  # every request runs at least one token past its prompt
                raise BadRequest(
                    f"{prompt_param}: the prompt's {prompt_len} tokens leave no room in {what} "
                    f"of {limit} tokens (at most {limit - 1}: one token is generated after the "
                    f"prompt, even to score it with max_tokens 0)", param=prompt_param)
            if prompt_len + max_tokens > limit:
                raise BadRequest(
                    f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                    f"{prompt_len + max_tokens} exceeds {what} of {limit} tokens",
                    param="max_tokens")

    # -- structured outputs and tools ----------------------------------------------------
    def tool_format(self) -> ToolFormat:
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return pick_format(self.tool_call_parser, template)

    def grammars(self, param: str) -> GrammarCompiler:
        """The router's grammar compiler (made on first use; BadRequest naming `param` for
        a model without a tokenizer)."""
        with self._lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise BadRequest(f"{param}: this model has no tokenizer, which structured "
                                     "outputs need", param=param)
                self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size,
                                                 self.config.eos_token_ids)
            return self._grammars

    async def check_grammars(self, checks: Sequence[tuple[StructuredOutput, str]]) -> None:
        """Compile each spec (cached, on the compiler's threads, within grammar_timeout_s):
        a bad or too slow one is a 400 naming its field. The workers compile the request's
        spec again (their own cache); this refuses it before any worker sees it."""
        if not checks:
            return
        # the first call builds xgrammar's view of the vocabulary: a thread's work too
        compiler = await asyncio.to_thread(self.grammars, checks[0][1])
        for spec, param in checks:
            try:
                await compiler.compile_async(spec, self.grammar_timeout_s, param)
            except InvalidRequestError as e:
                raise BadRequest.from_invalid(e) from e

    def check_grammars_sync(self, checks: Sequence[tuple[StructuredOutput, str]]) -> None:
        """check_grammars for a caller on its own thread (the gRPC face)."""
        for spec, param in checks:
            try:
                self.grammars(param).compile(spec, self.grammar_timeout_s, param)
            except InvalidRequestError as e:
                raise BadRequest.from_invalid(e) from e

    # -- token ids -> text ---------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens kept visible)."""
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def detokenizer(self, prompt_ids: Sequence[int], params: SamplingParams
                    ) -> IncrementalDetokenizer | None:
        """The request's detokenizer, as the engine makes it (its text options included)."""
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer.for_params(self.tokenizer, prompt_ids, params)


def load_frontend(model: str | None, max_model_len: int | None = None,
                  served_name: str | None = None, tool_call_parser: str = "") -> Frontend:
    """Read the model's config and tokenizer only (no weights)."""
    from pdserve.engine.model.gguf_weights import config_from_gguf, open_gguf
    from pdserve.engine.model.presets import get_preset
    from pdserve.engine.model.weights import read_hf_config

    source: ModelSource = resolve_model(model)
    tokenizer: Tokenizer | None = None
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        config, tokenizer = config_from_gguf(reader), Tokenizer.from_gguf(reader)
    elif source.kind == "hf":
        config = read_hf_config(source.path)
        try:
            tokenizer = Tokenizer.from_hf_dir(source.path)
        except TokenizerError:
            tokenizer = None
    else:
        config = get_preset(source.preset)
    # the same rule the engine applies (engine.llm.build_engine)
    max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    aliases = {source.name}
    if model:
        aliases.add(model)
    if source.name == EMBEDDED_MODEL:
        aliases.add(EMBEDDED_HF_ID)
    model_id = served_name or source.name
    return Frontend(model_id, config, tokenizer, max_len, frozenset(aliases - {model_id}),
                    tool_call_parser)
