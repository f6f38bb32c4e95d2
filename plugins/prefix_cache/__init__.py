"""infer's built-in prefix caches: registered here, each as a lazy ``"module:Class"`` target, so that
listing them (``infer plugins``, ``infer --help``) imports none of their modules; a module loads when a config
selects it."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_prefix_caches(register):
    register("none", "infer.plugins.prefix_cache.none:NoPrefixCache", description="No prefix caching")
    register(
        "hash",
        "infer.plugins.prefix_cache.hash:HashPrefixCache",
        description="vLLM-style automatic prefix caching: full blocks keyed by chained SHA-256 hashes, LRU eviction",
    )
    register(
        "radix",
        "infer.plugins.prefix_cache.radix:RadixPrefixCache",
        description="SGLang-style RadixAttention: token radix tree, any prefix length at block granularity, LRU leaves",
    )
