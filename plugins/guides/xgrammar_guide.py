"""``guide: xgrammar``: constrained decoding with xgrammar (vLLM's, SGLang's and TensorRT-LLM's default): grammars
compiled against the vocabulary ahead of time, token masks in microseconds. Grammars are written in EBNF (GBNF).
Needs ``pip install "infer[xgrammar]"``; the library is imported only when a config selects this guide."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from infer.guide import (
    Constraint,
    Guide,
    GuideConfig,
    GuideError,
    Matcher,
    TokenizerInfo,
    choice_regex,
    require_library,
)


class XGrammarConfig(GuideConfig):
    any_whitespace: bool = Field(
        False,
        description="JSON may put any whitespace between tokens (off: one space "
        "after , and :, which keeps a small model from looping on "
        "newlines).",
    )
    max_threads: int = Field(2, ge=1, description="Threads compiling a grammar against the vocabulary.")


class XGrammarMatcher(Matcher):
    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token_ids):
        for count, token in enumerate(token_ids):
            if not self._matcher.accept_token(token):
                return count
        return len(token_ids)

    def fill_bitmask(self, bitmask, row):
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens):
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self):
        return self._matcher.is_terminated()

    def forced_tokens(self):
        return (
            list(self._matcher.find_jump_forward_tokens()) if hasattr(self._matcher, "find_jump_forward_tokens") else []
        )


class XGrammarGuide(Guide):
    config_model = XGrammarConfig
    matcher_class: ClassVar[type[XGrammarMatcher]] = XGrammarMatcher
    grammar_syntax = "EBNF (GBNF)"

    def __init__(self, tokenizer: TokenizerInfo, config: XGrammarConfig | None = None):
        super().__init__(tokenizer, config)
        self._xgr = require_library("xgrammar", "xgrammar", "xgrammar")
        info = self._xgr.TokenizerInfo.from_huggingface(
            tokenizer.tokenizer, vocab_size=tokenizer.vocab_size, stop_token_ids=list(tokenizer.eos_token_ids)
        )
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=self.config.max_threads)

    def _compile(self, constraint: Constraint):
        compiler, kind = self._compiler, constraint.kind
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(
                    constraint.json_schema, any_whitespace=self.config.any_whitespace, strict_mode=self.config.strict
                )
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(constraint.regex)
            if kind == "choice":
                return compiler.compile_regex(choice_regex(constraint.choice))
            return compiler.compile_grammar(constraint.grammar)
        except (RuntimeError, ValueError) as error:
            raise GuideError(f"invalid {kind} constraint: {_first_line(error)}") from None

    def matcher(self, compiled) -> XGrammarMatcher:
        return self.matcher_class(self._xgr.GrammarMatcher(compiled))


def _first_line(error: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location; keep what the user needs."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
