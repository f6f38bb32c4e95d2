"""Registers one implementation of each kind, as lazy ``"module:Class"`` targets (listing them imports no torch)."""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_allocators(register):
    register(
        "outside-fifo",
        "infer_outside_plugin.allocator:FifoAllocator",
        description="FIFO free list: the block released longest ago is handed out next",
    )


@hookimpl
def register_prefix_caches(register):
    register(
        "outside-prefix",
        "infer_outside_plugin.prefix_cache:TokenPrefixCache",
        description="Whole blocks keyed by every token up to their end; LRU eviction of leaves",
    )


@hookimpl
def register_schedulers(register):
    register(
        "outside-longest",
        "infer_outside_plugin.scheduler:LongestPromptFirstScheduler",
        description="Longest prompt first",
    )


@hookimpl
def register_attention_backends(register):
    register(
        "outside-reference",
        "infer_outside_plugin.attention:ReferenceAttention",
        description="Plain torch attention, one sequence at a time",
    )


@hookimpl
def register_drafters(register):
    register(
        "outside-repeat",
        "infer_outside_plugin.drafter:RepeatDrafter",
        description="Prompt lookup: what followed the last two tokens before",
    )


@hookimpl
def register_guides(register):
    register("outside-choice", "infer_outside_plugin.guide:ChoiceGuide", description="Choice constraints only")
