"""``guide: llguidance``: constrained decoding with llguidance (the Rust engine behind Guidance): grammars compile
almost instantly, with no dependencies. Grammars are written in Lark. Needs ``pip install "infer[llguidance]"``; the
library is imported only when a config selects this guide."""

from __future__ import annotations

import json

from pydantic import Field

from infer.guide import (
    Constraint,
    Guide,
    GuideConfig,
    GuideError,
    Matcher,
    TokenizerInfo,
    choice_regex,
    close_objects,
    require_library,
)


class LLGuidanceConfig(GuideConfig):
    any_whitespace: bool = Field(False, description="JSON may put any whitespace between tokens.")


class LLGuidanceMatcher(Matcher):
    """llguidance's ``is_stopped`` already holds before the stop token; ``is_terminated`` here means what the
    contract says (a stop token accepted), so both built-ins end sequences the same way."""

    def __init__(self, matcher, torch_helpers, stop_token_ids: frozenset[int]):
        self._matcher = matcher
        self._torch = torch_helpers
        self._stop_token_ids = stop_token_ids
        self._num_accepted = 0
        self._terminated_at: int | None = None  # tokens accepted when a stop token was

    def accept(self, token_ids):
        matcher = self._matcher
        for count, token in enumerate(token_ids):
            if token in self._stop_token_ids:
                # validate_tokens does not count a stop token, even where consume_token takes it.
                if self._terminated_at is not None or not matcher.is_accepting() or not matcher.consume_token(token):
                    return count
                self._terminated_at = self._num_accepted + 1
            elif matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
                return count
            self._num_accepted += 1
        return len(token_ids)

    def fill_bitmask(self, bitmask, row):
        self._torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens):
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens
            if self._terminated_at is not None and self._terminated_at > self._num_accepted:
                self._terminated_at = None

    def is_terminated(self):
        return self._terminated_at is not None

    def forced_tokens(self):
        return list(self._matcher.compute_ff_tokens())


class LLGuidanceGuide(Guide):
    config_model = LLGuidanceConfig
    grammar_syntax = "Lark"

    def __init__(self, tokenizer: TokenizerInfo, config: LLGuidanceConfig | None = None):
        super().__init__(tokenizer, config)
        self._llg = require_library("llguidance", "llguidance", "llguidance")
        hf = require_library("llguidance.hf", "llguidance", "llguidance")
        self._torch = require_library("llguidance.torch", "llguidance", "llguidance")
        self._tokenizer = hf.from_tokenizer(
            tokenizer.tokenizer, n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )
        self._stop_token_ids = frozenset(tokenizer.eos_token_ids)

    def _compile(self, constraint: Constraint) -> str:
        matcher, kind = self._llg.LLMatcher, constraint.kind
        options = {"whitespace_flexible": self.config.any_whitespace}
        try:
            if kind == "json_schema":
                schema = json.loads(constraint.json_schema)
                schema = close_objects(schema) if self.config.strict else schema
                grammar = matcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
            elif kind == "json_object":
                grammar = matcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=options)
            elif kind == "regex":
                grammar = matcher.grammar_from_regex(constraint.regex)
            elif kind == "choice":
                grammar = matcher.grammar_from_regex(choice_regex(constraint.choice))
            else:
                grammar = matcher.grammar_from_lark(constraint.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            raise GuideError(f"invalid {kind} constraint: {str(error).strip().splitlines()[0]}") from None
        problem = matcher.validate_grammar(grammar, self._tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise GuideError(f"invalid {kind} constraint: {problem.strip().splitlines()[0]}")
        return grammar

    def matcher(self, compiled: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._llg.LLMatcher(self._tokenizer, compiled), self._torch, self._stop_token_ids)
