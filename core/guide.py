"""The guide contract: constrained decoding (structured output) from a grammar engine.

A request may carry a ``Constraint`` (a JSON schema, any JSON object, a regex, a choice among strings, or a grammar).
The configured guide compiles it once (``Guide.compile``, cached by the constraint), and every sample of the request
gets its own ``Matcher`` over the compiled grammar. Each step the engine asks the matchers of constrained rows for a
token bitmask, masks those rows' logits before sampling (other rows cost nothing), then feeds the committed tokens
to ``accept``. With speculative decoding the mask of a verification row is the state after the drafts before it:
the engine accepts drafts tentatively to fill the rows, then rolls them back (``rollback``), so a draft the grammar
forbids is rejected and the output equals undrafted constrained decoding.

Bitmask layout (xgrammar's and llguidance's): int32 ``[rows, ceil(vocab / 32)]``; token ``t`` is allowed when bit
``t % 32`` of word ``t // 32`` is set.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GuideError(ValueError):
    """A constraint cannot be served: invalid (a schema that does not compile) or not supported by the configured
    guide. ``field`` names the request field (``constraint``)."""

    def __init__(self, message: str, field: str = "constraint"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match; exactly one field is set.

    - ``json_schema``: the schema as JSON text (a dict is accepted and stored as its JSON);
    - ``json_object``: any JSON object;
    - ``regex``: the whole output matches it;
    - ``choice``: the output is one of these strings;
    - ``grammar``: a grammar in the configured guide's syntax (``Guide.grammar_syntax``: EBNF for xgrammar, Lark
      for llguidance).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))  # key order is property order
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise GuideError(
                f"a constraint sets exactly one of {', '.join(CONSTRAINT_KINDS)}; got {', '.join(given) or 'none'}"
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise GuideError("json_schema must be a JSON schema (an object, or its JSON text)")
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as error:
                raise GuideError(f"json_schema is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise GuideError("json_schema must be a JSON object")
        if self.json_object is not False and self.json_object is not True:
            raise GuideError("json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GuideError(f"{name} must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise GuideError("choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    @classmethod
    def from_dict(cls, data: Any) -> Constraint:
        """From a JSONL line's or a config's mapping (``{"json_schema": {...}}``); a schema may be given as an
        object. Unknown keys are an error naming them."""
        if isinstance(data, Constraint):
            return data
        if not isinstance(data, dict):
            raise GuideError(f"a constraint is a mapping with one of {', '.join(CONSTRAINT_KINDS)}; got {data!r}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise GuideError(f"unknown constraint field(s) {', '.join(unknown)}; known: {', '.join(CONSTRAINT_KINDS)}")
        return cls(**data)

    def describe(self) -> str:
        text = str(self.value)
        return f"{self.kind} {text[:60]}{'...' if len(text) > 60 else ''}"


class Matcher(ABC):
    """One sequence's position in a compiled grammar."""

    @abstractmethod
    def accept(self, token_ids: Sequence[int]) -> int:
        """Advance over ``token_ids`` in order, stopping at the first the grammar forbids (the state is then the
        one after the tokens accepted); returns how many were accepted."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (see the module docstring for the layout). When the
        grammar is complete only the stop tokens are allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has been completed and a stop token accepted: nothing more may follow."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (for jump-forward decoding); may be empty."""
        return []


class GuideConfig(BaseModel):
    """Config section ``guide``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "none"
    cache_size: int = Field(256, ge=1, description="Compiled constraints kept (least recently used dropped first).")
    strict: bool = Field(
        True,
        description="JSON objects take only the properties their schema lists unless it "
        "sets additionalProperties (xgrammar's strict mode; OpenAI's strict "
        "schemas): a small model otherwise invents properties without end.",
    )
    jump_forward: bool = Field(
        True,
        description="Tokens the grammar forces next (Matcher.forced_tokens) become "
        "drafts, verified like any (outputs unchanged), where the drafter "
        "proposes none; up to drafter.num_speculative_tokens, while at most "
        "drafter.max_batch_size sequences run.",
    )


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What a guide needs of the model's tokenizer: the HF tokenizer, the model's vocabulary size (logits width,
    which may exceed the tokenizer's) and the ids that end a sequence."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class Guide(ABC):
    """Compiles constraints into matchers. Subclasses implement ``_compile`` and ``matcher``; ``compile`` caches
    by constraint (thread-safe: the server compiles in a worker thread before the engine thread needs it).

    ``supported_kinds`` lists the constraint kinds the guide serves; ``grammar_syntax`` names what its ``grammar``
    constraints are written in.
    """

    config_model: ClassVar[type[GuideConfig]] = GuideConfig
    supported_kinds: ClassVar[frozenset[str]] = frozenset(CONSTRAINT_KINDS)
    grammar_syntax: ClassVar[str] = ""

    def __init__(self, tokenizer: TokenizerInfo, config: GuideConfig | None = None):
        self.tokenizer = tokenizer
        self.config = config or self.config_model()
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations actually run (cache misses)

    def compile(self, constraint: Constraint) -> Any:
        """The compiled form of ``constraint``, from the cache when it was compiled before; raises ``GuideError``
        when the guide cannot serve it."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        if constraint.kind not in self.supported_kinds:
            raise GuideError(
                f"guide {self.config.name!r} cannot serve a {constraint.kind} constraint (it serves "
                f"{', '.join(sorted(self.supported_kinds)) or 'none'})"
            )
        compiled = self._compile(constraint)
        with self._lock:
            self.num_compiled += 1
            self._compiled[constraint] = compiled
            while len(self._compiled) > self.config.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    @abstractmethod
    def _compile(self, constraint: Constraint) -> Any:
        """Compile one constraint; raise ``GuideError`` with the library's reason when it is invalid."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of ``compiled``'s grammar."""


def require_library(module: str, guide: str, extra: str) -> Any:
    """Import a guide's library, or fail naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise GuideError(
            f'guide {guide!r} needs the {module} package: pip install "infer[{extra}]" ({error})', "guide"
        ) from None


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say otherwise."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: close_objects(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped)."""
    import re

    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask ``[num_rows, ceil(vocab_size / 32)]``."""
    import torch

    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[rows, vocab_size]`` of allowed tokens that int32 ``bitmask`` ``[rows, words]`` encodes."""
    import torch

    bits = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32), torch.arange(32, dtype=torch.int32))
    return (bitmask.unsqueeze(-1) & bits.to(bitmask.device)).ne(0).flatten(1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], kernels=None) -> None:
    """Set the logits of tokens ``bitmask[i]`` forbids to -inf in row ``rows[i]`` of ``logits``, in place: with
    infer's CPU kernels when given (float32 CPU logits; a pass that skips allowed words), else in torch."""
    import torch

    index = torch.tensor(list(rows), dtype=torch.int64)
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        kernels.apply_bitmask_(logits, bitmask.contiguous(), index)
        return
    allowed = unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)
    index = index.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def constrain_logits(
    logits: torch.Tensor, rows: Sequence[tuple[Matcher, int, Sequence[int]]], copy: bool = False, kernels=None
) -> torch.Tensor:
    """``logits`` [N, vocab] with each constrained row allowing only what its grammar does (in place, or in a copy
    when ``copy``: the caller still needs the raw rows). Each entry of ``rows`` is (matcher, first logits row,
    drafts): the sequence's rows verify ``drafts``, and the mask of its row ``j`` is the grammar's state after
    ``drafts[:j]``, accepted tentatively and rolled back afterwards. Rows after a draft the grammar forbids are left
    unmasked: the forbidden draft is rejected, so they are never used. ``kernels``: infer's CPU kernels, if loaded."""
    if not rows:
        return logits
    bitmask = allocate_bitmask(sum(len(drafts) + 1 for _, _, drafts in rows), logits.shape[-1])
    targets: list[int] = []
    for matcher, start, drafts in rows:
        accepted = 0
        for j in range(len(drafts) + 1):
            matcher.fill_bitmask(bitmask, len(targets))
            targets.append(start + j)
            if j == len(drafts) or not matcher.accept([drafts[j]]):
                break
            accepted += 1
        matcher.rollback(accepted)
    if copy:
        logits = logits.clone()
    apply_bitmask(logits, bitmask[: len(targets)], targets, kernels)
    return logits
