"""What the serving modules know of the model they serve, as values: its context and vocabulary sizes, whether its
chat template renders tools, its grammar check and its tokenizer's few operations. Built once from the `LLM` by
the server (`ServedModel.of`); the modules that turn bodies into plans and outputs into answers read this and
never the `LLM` or its engine, so they can be tested on a stub and cannot reach into engine state.

The functions that tokenize or compile run on the engine thread (tokenizers are not safe to share across
threads); `token_text` (one token's text, for logprobs) is cached and safe to read from the event loop.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.config import SamplingParams, SpecdecError
from specdec.llm import LLM, unicode_text


@dataclass(frozen=True, eq=False)  # hashed by identity: token_text caches per model
class ServedModel:
    name: str  # the name clients send as `model`
    max_model_len: int  # the context a prompt and its output share, in tokens
    vocab_size: int
    renders_tools: bool  # the chat template renders `tools` itself (else tool_calls writes them as messages)
    check_structured_output: Callable[[SamplingParams], None]  # compiles a constraint; SpecdecError when bad
    encode: Callable[[str], list[int]]  # a prompt's ids, with the special tokens a prompt gets
    chat: Callable[[list[dict], list[dict] | None], list[int]]  # a conversation's ids, the assistant's turn opened
    tokenizer: object = field(repr=False, default=None)  # the Hugging Face tokenizer (tokenize, detokenize)
    max_token_chars: int = 1  # the most characters one token stands for

    @classmethod
    def of(cls, llm: LLM, name: str) -> ServedModel:
        tokenizer = llm.tokenizer
        return cls(name=name, max_model_len=llm.max_model_len, vocab_size=llm.vocab_size,
                   renders_tools=llm.renders_tools, check_structured_output=llm.check_structured_output,
                   encode=lambda prompt: llm.encode(prompt)[1], chat=llm.apply_chat_template, tokenizer=tokenizer,
                   max_token_chars=max(map(len, tokenizer.get_vocab()), default=1))

    @functools.lru_cache(maxsize=65536)  # noqa: B019  one per server; a token's text never changes
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # -- /tokenize and /detokenize (vLLM's): the tokenizer's own switches -----------------------------------
    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        unicode_text(text, "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, conversation: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                    add_special_tokens: bool) -> list[int]:
        """A conversation's ids through the chat template, the assistant's turn opened or not."""
        if add_generation_prompt and not add_special_tokens:
            return self.chat(conversation, tools)  # exactly what a chat request is given
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpecdecError(f"model {self.name!r} has no chat template; tokenize a plain prompt instead")
        text = self.tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenize(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
