"""Greedy float32 output equals HF transformers ``generate`` on SmolLM2-135M, in one mixed batch, and under
preemption, chunked prefill, the contiguous allocator, and prefix-cache hits on a shared system prompt."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.kernels import cpu as cpu_kernels

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and French, and say which is which.",
    "Hi!",
    "What does a compiler do? Answer briefly, then give an example of a compiled language and an interpreted one.",
    "Name a famous painting.",
]


# A system prompt of ~150 tokens: 9 whole blocks of 16 shared by every conversation that starts with it.
SYSTEM = (
    "You are the reference desk of a small public library. Answer visitors' questions briefly and politely, in plain "
    "words. If a question is about opening hours, say the library opens at nine in the morning and closes at six in "
    "the evening on weekdays, and at one in the afternoon on Saturdays; it is closed on Sundays. If a question is "
    "about borrowing, say that a library card is free, that books may be kept for three weeks and renewed twice, and "
    "that films may be kept for one week. If a question is about something else, answer it as well as you can, and "
    "suggest a section of the library where the visitor could read more about it."
)


def conversations(texts, system=None):
    head = [{"role": "system", "content": system}] if system else []
    return [[*head, {"role": "user", "content": text}] for text in texts]


@pytest.fixture(scope="module")
def hf_model():
    from infer.testing.models import load_hf_reference

    return load_hf_reference(MODEL, torch.float32)


def hf_greedy(hf_model, chats) -> list[list[int]]:
    """Greedy continuations from HF transformers, one prompt at a time (no padding effects)."""
    model, tokenizer = hf_model
    references = []
    for messages in chats:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        references.append(out[0, ids.shape[1] :].tolist())
    return references


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    return hf_greedy(hf_model, conversations(CHATS))


def _generate(chats=None, config="baseline", **overrides):
    settings = {"model__path": MODEL, "model__dtype": "float32", "model__max_model_len": 512, **overrides}
    llm = LLM(config, **settings)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = llm.generate(chats or conversations(CHATS), params)
    return llm, outputs


def _assert_matches(outputs, references):
    for index, (output, reference) in enumerate(zip(outputs, references)):
        # HF stops at EOS; the engine includes the EOS token it stopped on, as HF does.
        assert output.token_ids == reference[: len(output.token_ids)], f"prompt {index}: {output.text!r}"
        assert len(output.token_ids) == len(reference) or output.finish_reason == "stop"


def test_batched_greedy_matches_hf(hf_reference):
    llm, outputs = _generate()
    _assert_matches(outputs, hf_reference)
    assert llm.engine.stats.peak_running == len(CHATS)
    # Where a C compiler is found (as in CI), this ran on infer's CPU kernels, attention auto picking cpu.
    has_compiler = cpu_kernels.compiler() is not None
    assert (llm.engine.executor.kernels is not None) == has_compiler
    assert type(llm.engine.attention).__name__ == ("CpuBackend" if has_compiler else "SdpaBackend")


def test_greedy_matches_hf_on_torch_ops_alone(hf_reference):
    llm, outputs = _generate(model__cpu_kernels=False)
    _assert_matches(outputs, hf_reference)
    assert llm.engine.executor.kernels is None and type(llm.engine.attention).__name__ == "SdpaBackend"
    assert set(llm.engine.executor.counts) == {"torch"}


def test_greedy_matches_hf_under_preemption(hf_reference):
    # 12 blocks of 16 tokens cannot hold 8 chat prompts of ~40-60 tokens at once: sequences must be preempted.
    llm, outputs = _generate(model__max_model_len=128, cache__block_size=16, cache__num_blocks=13)
    _assert_matches(outputs, hf_reference)
    assert llm.engine.stats.num_preemptions > 0


def test_greedy_matches_hf_with_chunked_prefill(hf_reference):
    llm, outputs = _generate(scheduler__max_num_batched_tokens=16)
    _assert_matches(outputs, hf_reference)
    assert any(o.metrics.num_prompt_tokens > 16 for o in outputs)


def test_greedy_matches_hf_with_contiguous_allocator(hf_reference):
    llm, outputs = _generate(allocator__name="contiguous", cache__num_blocks=200)
    _assert_matches(outputs, hf_reference)


def test_greedy_matches_hf_with_a_shared_system_prompt_attended_once(hf_model, monkeypatch):
    # Radix caching shares the system prompt's blocks; sdpa's torch path then attends them once for all the
    # conversations decoding on them (cascade attention), which must change nothing. (The cpu backend, which auto
    # picks on a float32 CPU, reads the pool in place instead: sdpa is named here.)
    from infer.plugins.attention.sdpa import SdpaBackend

    calls = []
    cascade = SdpaBackend._attend_cascade
    monkeypatch.setattr(SdpaBackend, "_attend_cascade", lambda self, *args: calls.append(1) or cascade(self, *args))
    chats = conversations(CHATS[:5], system=SYSTEM)
    llm, outputs = _generate(chats, "radix_lpm", attention__name="sdpa")
    _assert_matches(outputs, hf_greedy(hf_model, chats))
    assert sum(output.metrics.num_cached_prompt_tokens for output in outputs) == 4 * 144
    assert calls, "no step attended a shared prefix once"
