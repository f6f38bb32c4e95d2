"""``infer run CONFIG [overrides] [--prompts FILE] [--output FILE] [--explain]``."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time

import click

from infer.engine.metrics import format_summary, summarize
from infer.prompts import builtin_items, read_jsonl


def run_command(config, overrides, prompts_path=None, output_path=None, explain: bool = False) -> None:
    from infer.llm import LLM

    items = read_jsonl(prompts_path) if prompts_path else builtin_items()
    click.echo(f"loading {config} ...", err=True)
    llm = LLM(config, dotlist=list(overrides))
    click.echo(llm.engine.pool_plan.describe(), err=True)
    click.echo(llm.engine.describe_execution(), err=True)
    with _execution_log(explain):
        start = time.perf_counter()
        outputs = llm.generate([item.prompt for item in items], [item.params for item in items], use_tqdm=True)
        wall = time.perf_counter() - start
    lines = [_output_line(index, item, output) for index, (item, output) in enumerate(zip(items, outputs))]
    if output_path:
        with open(output_path, "w") as handle:
            handle.writelines(json.dumps(line) + "\n" for line in lines)
        click.echo(f"wrote {len(lines)} outputs to {output_path}", err=True)
    else:
        for line in lines:
            click.echo(f"--- [{line['id']}] {line['prompt'][:80]!r}")
            click.echo(line["text"] if line.get("error") is None else f"ERROR: {line['error']}")
    click.echo("", err=True)
    click.echo(format_summary(summarize(outputs, llm.engine, wall)), err=True)
    if explain:
        click.echo(llm.engine.executor.describe(), err=True)
    llm.close()
    sys.stdout.flush()


@contextlib.contextmanager
def _execution_log(enabled: bool):
    """While generating: every forward pass's path and the reasons earlier paths refused it on stderr
    (``infer.execution.paths``'s debug log)."""
    if not enabled:
        yield
        return
    execution = logging.getLogger("infer.execution")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("infer.execution: %(message)s"))
    level = execution.level
    execution.addHandler(handler)
    execution.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        execution.removeHandler(handler)
        execution.setLevel(level)


def _output_line(index, item, output) -> dict:
    line = {
        "id": index if item.id is None else item.id,
        "prompt": item.display,
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "metrics": output.metrics.to_dict(),
    }
    if output.error:
        line["error"] = output.error
    if output.outputs and output.outputs[0].logprobs is not None:
        line["logprobs"] = output.outputs[0].logprobs
    if output.prompt_logprobs is not None:
        line["prompt_logprobs"] = output.prompt_logprobs
    if len(output.outputs) > 1:
        line["samples"] = [
            {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in output.outputs
        ]
    return line
