"""The offline API: ``infer.LLM(config, **overrides).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from infer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from infer.sampling_params import SamplingParams


def overrides_from_kwargs(overrides: dict) -> list[str]:
    """``LLM("baseline", scheduler__max_num_seqs=8)`` or ``{"scheduler.max_num_seqs": 8}`` -> dotlist strings."""
    import json

    items = []
    for key, value in overrides.items():
        dotted = key.replace("__", ".")
        items.append(f"{dotted}={json.dumps(value) if not isinstance(value, str) else value}")
    return items


class LLM:
    """Batch generation on one engine.

    ``config`` is a YAML path, a shipped config name (``"baseline"``), or a dict; ``overrides`` are ``key=value``
    pairs with dots written as ``__`` (``LLM("baseline", model__dtype="float32")``) or passed in ``dotlist``.
    """

    def __init__(self, config="baseline", dotlist: SequenceABC[str] = (), registry=None, **overrides):
        from infer.config import load_config
        from infer.engine.engine import Engine

        self.config = load_config(config, [*dotlist, *overrides_from_kwargs(overrides)], registry=registry)
        self.engine = Engine(self.config, registry=registry)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (nothing to do in one process); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt the engine refuses (too long, empty) gets an output with
        ``finish_reason == "error"`` and ``error`` set; the other prompts still run."""
        from infer.engine.engine import RequestError

        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        results: dict[int, RequestOutput] = {}
        ids: dict[str, int] = {}
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                ids[self.engine.add_request(prompt, params)] = index
            except RequestError as error:
                results[index] = _error_output(f"prompt-{index}", prompt, str(error))
        for output in self.run_until_done(total=len(ids), use_tqdm=use_tqdm):
            results[ids[output.request_id]] = output
        return [results[i] for i in range(len(prompts))]

    def run_until_done(self, total: int | None = None, use_tqdm: bool = False):
        """Step the engine until no request is left, yielding each finished request."""
        from tqdm import tqdm

        progress = tqdm(total=total, desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    self.engine.release_request(output.request_id)
                    progress.update(1)
                    progress.set_postfix(tok=self.engine.stats.num_output_tokens, refresh=False)
                    yield output
        finally:
            progress.close()

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)


def _error_output(request_id: str, prompt, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    return RequestOutput(
        request_id,
        text,
        [],
        [CompletionOutput(0, "", [], "error")],
        True,
        RequestMetrics(arrival_time=0.0),
        error=message,
    )
