"""Request and response bodies of the OpenAI API, as pydantic models, and the mapping to ``SamplingParams``.

Requests are strict (``"5"`` is not an int, NaN is not a float) and closed (an unknown field is a 400 naming it, not
silently dropped). Extensions beyond OpenAI's fields follow vLLM's names: ``top_k``, ``min_p``, ``min_tokens``,
``ignore_eos``, and for structured output ``structured_outputs`` and the older ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` (beside OpenAI's ``response_format``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from infer.guide import Constraint, GuideError
from infer.prompts import ChatPrompt
from infer.sampling_params import SamplingParams, SamplingParamsError
from infer.serve.tools import forced_call_constraint

# Python's json module reads NaN and Infinity, which would slip past range checks (NaN < 0 is False).
REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# OpenAI's own bounds: they keep one request from flooding the engine with samples or stop-string checks.
MAX_SAMPLES = 128
MAX_STOP_STRINGS = 16
# A batched completions request: at most this many prompts (each is an engine request; server.max_waiting applies).
MAX_PROMPTS = 256
# OpenAI's bound on a chat request's tools.
MAX_TOOLS = 128


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG
    include_usage: bool = False


# Fields whose null is a value of its own: ``"max_tokens": null`` asks for tokens until the context ends (vLLM's
# reading).
NULL_IS_A_VALUE = frozenset({"max_tokens"})


def _nulls_as_absent(model: type[BaseModel], data: object) -> object:
    """``null`` for a field whose default is not null means "absent" (OpenAI and vLLM accept ``"stream": null``,
    ``"n": null``, ...); fields whose default is null, and those in ``NULL_IS_A_VALUE``, keep their null."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {
        key: value
        for key, value in data.items()
        if not (value is None and key in fields and fields[key].default is not None and key not in NULL_IS_A_VALUE)
    }


class JsonSchemaFormat(BaseModel):
    model_config = REQUEST_CONFIG
    name: str | None = None
    description: str | None = None
    # OpenAI calls it "schema"; pydantic models reserve that name.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = REQUEST_CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given_for_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one of its fields."""

    model_config = REQUEST_CONFIG
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# vLLM's older extras, each one constraint kind of infer.guide.Constraint.
GUIDED_KINDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# Where a request may ask for a constraint (at most one of them).
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_KINDS)


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = REQUEST_CONFIG

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        return _nulls_as_absent(cls, data)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None  # OpenAI's end-user id: the request's tenant for ``scheduler: fair``
    # Scheduling extras (vLLM's ``priority``: lower is served first; a TTFT target in seconds for ``deadline``).
    priority: int = 0
    ttft_slo_s: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Token id (as a string: JSON keys are strings) -> bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[str, float] | None = None
    # Structured output (at most one): OpenAI's response_format, vLLM's structured_outputs and guided_* extras.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _only_zero_penalty(cls, value: float | None) -> float | None:
        # Clients often send the 0 default explicitly; anything else would be silently ignored, so refuse it.
        if value not in (None, 0, 0.0):
            raise ValueError("penalties are not supported by infer; send 0 or leave it out")
        return value

    def api_field(self, engine_field: str | None) -> str | None:
        """The request's own name for a field the engine refused (``prompt`` is ``messages`` in a chat)."""
        if engine_field == "constraint":
            return self._constraint_field() or engine_field
        return engine_field

    def _constraint_field(self) -> str | None:
        given = [
            name
            for name in CONSTRAINT_FIELDS
            if getattr(self, name) is not None
            and not (name == "response_format" and self.response_format.type == "text")
        ]
        if len(given) > 1:
            raise SamplingParamsError(given[1], f"ask for one constraint; got {', '.join(given)}")
        return given[0] if given else None

    def constraint(self) -> Constraint | None:
        """The structured-output constraint the request asks for, if any; ``SamplingParamsError`` names the field
        of a malformed one."""
        name = self._constraint_field()
        if name is None:
            return None
        value = getattr(self, name)
        try:
            if name == "response_format":
                if value.type == "json_object":
                    return Constraint(json_object=True)
                return Constraint(json_schema=value.json_schema.schema_)
            if name == "structured_outputs":
                fields = value.model_dump(by_alias=True, exclude_none=True)
                if "json" in fields:
                    fields["json_schema"] = fields.pop("json")
                return Constraint.from_dict(fields)
            return Constraint.from_dict({GUIDED_KINDS[name]: value})
        except GuideError as error:
            raise SamplingParamsError(name, str(error)) from None

    @property
    def echoes_prompt(self) -> bool:
        """Whether each choice starts with the prompt (completions' ``echo``)."""
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **engine_fields) -> SamplingParams:
        """Raises ``SamplingParamsError`` naming the field for a bad value (API names and engine names agree).
        ``engine_fields``: further ``SamplingParams`` fields (or replacements) the endpoint derives."""
        defaults = SamplingParams()
        fields = dict(
            max_tokens=max_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop or [],
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
            constraint=self.constraint(),
            priority=self.priority,
            tenant=self.user,
            ttft_slo_s=self.ttft_slo_s,
            logit_bias=self.logit_bias or {},
        )
        return SamplingParams(**{**fields, **engine_fields})


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt as text or token ids, or a batch of them (one choice per prompt and
    sample, prompt-major). ``echo`` puts the prompt before each choice's text (and, with ``logprobs``, its tokens'
    logprobs first; ``max_tokens: 0`` then scores a prompt); ``best_of`` draws that many samples of each prompt and
    returns the ``n`` of highest cumulative logprob."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | list[int]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("text after the completion (insertion) is not supported by infer; leave it out")
        return value

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    @property
    def returns_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def samples_per_prompt(self) -> int:
        return self.best_of or self.n

    def to_sampling_params(self) -> SamplingParams:
        # best_of ranks samples by their tokens' cumulative logprob: the engine computes them even when the client
        # does not ask for logprobs (the response then leaves them out).
        if self.best_of is not None and self.best_of < self.n:
            raise SamplingParamsError("best_of", f"must be at least n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise SamplingParamsError(
                "best_of", "above n it cannot be streamed: the best samples are known only at the end"
            )
        logprobs = self.logprobs
        if logprobs is None and self.samples_per_prompt > self.n:
            logprobs = 0
        return self.sampling_params(
            self.max_tokens, logprobs, n=self.samples_per_prompt, prompt_logprobs=self.logprobs if self.echo else None
        )

    def engine_prompts(self) -> list[str | list[int]]:
        """One engine prompt per prompt of the batch."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = REQUEST_CONFIG
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (``messages[i].tool_calls``)."""

    model_config = REQUEST_CONFIG
    id: str
    type: Literal["function"]
    function: FunctionCall

    def template_call(self) -> dict:
        """The call as chat templates read it: arguments as a mapping (Qwen's, Llama's and Hermes' templates
        serialize a mapping themselves)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"tool call {self.id}: arguments are not JSON: {error}") from None
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null: an assistant turn that said nothing, or made calls only (OpenAI allows it)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None  # role tool: the call this message answers

    @model_validator(mode="after")
    def _roles_fields(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content may be null only for role assistant, not {self.role}")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to role assistant, not {self.role}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a message of role tool needs tool_call_id (the call it answers), and only it has one")
        if self.tool_calls:
            for call in self.tool_calls:
                call.template_call()
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def template_message(self) -> dict:
        """The message as the chat template reads it (``name``, ``tool_calls``, ``tool_call_id`` where given)."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = REQUEST_CONFIG
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = REQUEST_CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise SamplingParamsError("tools", "two tools have the same name")
        choice = self.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return
        if not names:
            raise SamplingParamsError("tool_choice", "a call is required but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise SamplingParamsError(
                "tool_choice", f"{choice.function.name!r} is not one of the tools ({', '.join(names)})"
            )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forces_a_call(self) -> bool:
        choice = self.effective_tool_choice
        return choice == "required" or isinstance(choice, NamedToolChoice)

    def tool_dicts(self) -> list[dict] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def constraint(self) -> Constraint | None:
        """A forced call's constraint (``infer.serve.tools``), else the structured-output fields' one."""
        self._check_tools()
        if not self.forces_a_call:
            return super().constraint()
        given = self._constraint_field()
        if given is not None:
            raise SamplingParamsError(
                "tool_choice", f"a forced tool call is its own constraint; {given} cannot be combined with it"
            )
        choice = self.effective_tool_choice
        try:
            return forced_call_constraint(self.tool_dicts(), None if choice == "required" else choice.function.name)
        except GuideError as error:
            raise SamplingParamsError("tools", str(error)) from None

    def to_sampling_params(self) -> SamplingParams:
        # Chat's default is "until the model stops": None, which the engine resolves to the room left in the context.
        limit = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), None)
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)

    @property
    def returns_logprobs(self) -> bool:
        return self.logprobs

    def api_field(self, engine_field: str | None) -> str | None:
        if engine_field == "prompt":
            return "messages"
        if engine_field == "constraint" and self.forces_a_call:
            return "tools"
        if engine_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().api_field(engine_field)

    def engine_prompts(self) -> list[ChatPrompt]:
        return [ChatPrompt([message.template_message() for message in self.messages], self.tool_dicts())]

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_in_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"must be in [0, 20], got {value}")
        return value


# -- responses ---------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    # An echoed prompt's first token has no logprob and no alternatives: null, as OpenAI and vLLM send.
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """The whole response, and also each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _tool_calls_only_when_made(self, handler) -> dict:
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls")
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _without_empty_fields(self) -> dict:
        return {
            name: value for name, value in (("name", self.name), ("arguments", self.arguments)) if value is not None
        }


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first carries ``id``, ``type`` and the name, the next ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_empty_fields(self, handler) -> dict:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_fields(self, handler) -> dict:
        # OpenAI sends the role once, in the first chunk, and the last chunk's delta may be empty: {}.
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "infer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
