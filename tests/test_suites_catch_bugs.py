"""Each conformance suite fails on a deliberately broken implementation: a suite that passes everything proves
nothing. The broken classes are one-line bugs in real built-ins, or in a plausible third-party plugin (a buddy
allocator) whose correct version is shown to pass; each runs through its suite in an inner pytest session (pytester,
in process), and the test asserts which suite tests failed and why.

The ``expected_failures`` hook is pinned here too: it turns a known bug into a strict xfail, fails the run when the
bug is gone, and rejects names that match no test.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import Phase, settings

from infer.allocator import RefcountingAllocator
from infer.plugins.allocators.paged import PagedAllocator
from infer.plugins.attention.sdpa import SdpaBackend
from infer.plugins.drafters.ngram import NgramDrafter
from infer.plugins.guides.xgrammar_guide import XGrammarGuide, XGrammarMatcher
from infer.plugins.prefix_cache.hash import HashPrefixCache
from infer.plugins.schedulers.fcfs import FCFSScheduler
from infer.plugins.schedulers.priority import PriorityScheduler
from infer.testing import (
    AllocatorConformance,
    AttentionConformance,
    DrafterConformance,
    GuideConformance,
    PrefixCacheConformance,
    SchedulerConformance,
)
from infer.testing.guide import default_tokenizer_info
from infer.testing.suite import ConformanceSuite

pytest_plugins = ["pytester"]

# xgrammar, transformers' tokenizer classes and what they import, loaded now: pytester forgets the modules imported
# while its fixture is up, and importing these again (torch.distributed's operator library) fails.
default_tokenizer_info()


def without_shrinking(suite: type[ConformanceSuite]) -> settings:
    """``suite``'s own run length, without shrinking: finding the bug is what is pinned here, a minimal example would
    only cost time, and a fixed generation order keeps the run the same every time."""
    return settings(suite.hypothesis_settings, phases=[Phase.generate], database=None, derandomize=True)


WITHOUT_SHRINKING = without_shrinking(ConformanceSuite)
ALLOCATOR_WITHOUT_SHRINKING = without_shrinking(AllocatorConformance)


# -- broken implementations ------------------------------------------------------------------------------------------
class LeakyAllocator(PagedAllocator):
    """Never gives back the first block of a release."""

    def release(self, blocks):
        super().release(list(blocks)[1:])


class RepeatingAllocator(PagedAllocator):
    """Hands the most recently allocated block out again while it is still held."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_block = None

    def allocate(self, n):
        blocks = super().allocate(n)
        if blocks and self.last_block is not None and self.refcount(self.last_block) > 0:
            blocks[0] = self.last_block
        if blocks:
            self.last_block = blocks[-1]
        return blocks


class BuddyAllocator(RefcountingAllocator):
    """A binary buddy allocator, as a third-party plugin would write one.

    Free blocks are kept as aligned runs of 2**order blocks. ``allocate(n)`` takes one run per power of two in ``n``,
    splitting the smallest larger run when none has the size (the upper halves stay free); a released block merges
    with its buddy, the other half of the aligned run of twice its size, as long as that buddy is a free run of the
    same order. Block ids are the addresses: the pool 1 .. num_blocks-1 starts as the largest aligned runs that tile
    it, and the null block 0 is never free, so nothing merges with it.
    """

    def __init__(self, num_blocks, block_size, max_model_len, config=None):
        super().__init__(num_blocks, block_size, max_model_len, config)
        self.free_runs: dict[int, int] = {}  # first block of a free run -> its order
        start = 1
        while start < num_blocks:
            order = 0
            while start % (2 << order) == 0 and start + (2 << order) <= num_blocks:
                order += 1
            self.free_runs[start] = order
            start += 1 << order

    @property
    def num_free(self):
        return sum(1 << order for order in self.free_runs.values())

    def _take_free(self, n):
        blocks = []
        while len(blocks) < n:
            start, order = self.take_run((n - len(blocks)).bit_length() - 1)
            blocks.extend(range(start, start + (1 << order)))
        return blocks

    def take_run(self, order):
        """Remove a free run of ``order`` and return (first block, order); when every free run is smaller, the
        largest one (so ``n`` free blocks always serve ``allocate(n)``: this allocator never refuses for
        fragmentation)."""
        runs = sorted((run_order, start) for start, run_order in self.free_runs.items())
        run_order, start = next(((o, s) for o, s in runs if o >= order), runs[-1])
        del self.free_runs[start]
        while run_order > order:
            run_order -= 1
            self.free_runs[start + (1 << run_order)] = run_order
        return start, run_order

    def _put_free(self, block):
        start, order = block, 0
        while (buddy := self.mergeable_buddy(start, order)) is not None:
            del self.free_runs[buddy]
            start, order = min(start, buddy), order + 1
        self.free_runs[start] = order

    def mergeable_buddy(self, start, order):
        """The first block of the free buddy of the run of ``order`` at ``start``, or None when it is not free."""
        buddy = start ^ (1 << order)
        return buddy if self.free_runs.get(buddy) == order else None


class WrongOrderMergingBuddyAllocator(BuddyAllocator):
    """Merges with any free run that starts at the buddy's address, whatever its order: a smaller run there is only
    the head of a buddy whose other blocks are still held, and the merged run claims them as free."""

    def mergeable_buddy(self, start, order):
        buddy = start ^ (1 << order)
        return buddy if buddy in self.free_runs else None  # the bug: the buddy's order is not compared


class LockIgnoringPrefixCache(HashPrefixCache):
    """Forgets locks, so eviction may take a prefix a request is about to use."""

    def lock(self, match):
        pass

    def unlock(self, match):
        pass


class PeekingPrefixCache(HashPrefixCache):
    """Peeks by matching: every scheduler peek counts as a lookup and refreshes the prefix's recency."""

    def peek(self, tokens, namespace=None):
        return self.match(tokens, namespace).num_tokens


class WrongScaleAttention(SdpaBackend):
    """Scales scores by 1 / head_dim instead of 1 / sqrt(head_dim), consistently (its own ``scale`` says so)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = 1.0 / self.head_dim


class SinkBlindAttention(SdpaBackend):
    """Declares attention sinks and is given them, but attends every layer as if it had none."""

    def layer_sinks(self, layer):
        return None


class OverlongDrafter(NgramDrafter):
    """Proposes one token more than asked."""

    def propose(self, sequences, k):
        return [drafts + [0] for drafts in super().propose(sequences, k)]


class OverBudgetScheduler(FCFSScheduler):
    """Plans as if the token budget were twice what the engine allows."""

    def schedule(self, view):
        view.max_num_batched_tokens *= 2
        try:
            return super().schedule(view)
        finally:
            view.max_num_batched_tokens //= 2


class PrefixBlindScheduler(FCFSScheduler):
    """Plans a newly admitted sequence's whole prompt, ignoring what the prefix cache or its leader computed."""

    def _admit_waiting(self, view, scheduled, budget):
        for seq in self.order_waiting(view):
            if budget <= 0 or len(view.running) >= view.max_num_seqs:
                break
            if not view.is_ready(seq):
                continue
            num_new = min(seq.num_tokens, budget)  # the bug: not seq.num_tokens - view.cached_prefix_len(seq)
            if not view.admit(seq, num_new):
                break
            scheduled[seq] = num_new
            budget -= num_new


class ImpatientScheduler(FCFSScheduler):
    """Admits n > 1 followers before their leader has computed the prompt they could share."""

    def schedule(self, view):
        view.is_ready = lambda seq: True
        try:
            return super().schedule(view)
        finally:
            del view.is_ready


class AgelessPriorityScheduler(PriorityScheduler):
    """Orders by priority alone: waiting never ages a request past favored later ones."""

    def order_waiting(self, view):
        return sorted(view.waiting, key=lambda seq: (seq.params.priority, seq.arrival_order))  # the bug: no aging


class PermissiveMatcher(XGrammarMatcher):
    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1  # the bug: every token allowed, whatever the grammar says


class PermissiveGuide(XGrammarGuide):
    """Masks nothing: the matcher then refuses tokens its own mask allowed."""

    matcher_class = PermissiveMatcher


class ForgetfulMatcher(XGrammarMatcher):
    def rollback(self, num_tokens):
        pass  # the bug: rejected drafts stay in the grammar's state


class ForgetfulGuide(XGrammarGuide):
    """Ignores rollbacks."""

    matcher_class = ForgetfulMatcher


# -- the suites, pointed at them (not collected here: the names do not start with Test) -------------------------------
class LeakyAllocatorSuite(AllocatorConformance):
    hypothesis_settings = ALLOCATOR_WITHOUT_SHRINKING

    @pytest.fixture
    def allocator_factory(self):
        return lambda: LeakyAllocator(self.num_blocks, self.block_size, self.max_model_len)


class RepeatingAllocatorSuite(AllocatorConformance):
    hypothesis_settings = ALLOCATOR_WITHOUT_SHRINKING

    @pytest.fixture
    def allocator_factory(self):
        return lambda: RepeatingAllocator(self.num_blocks, self.block_size, self.max_model_len)


class BuddyAllocatorSuite(AllocatorConformance):
    hypothesis_settings = ALLOCATOR_WITHOUT_SHRINKING

    @pytest.fixture
    def allocator_factory(self):
        return lambda: BuddyAllocator(self.num_blocks, self.block_size, self.max_model_len)


class WrongOrderMergingBuddyAllocatorSuite(AllocatorConformance):
    hypothesis_settings = ALLOCATOR_WITHOUT_SHRINKING

    @pytest.fixture
    def allocator_factory(self):
        return lambda: WrongOrderMergingBuddyAllocator(self.num_blocks, self.block_size, self.max_model_len)


class LeakyAllocatorWithExampleDatabaseSuite(AllocatorConformance):
    """The suite's own Hypothesis settings, example database included (it saves the failing example it finds)."""

    @pytest.fixture
    def allocator_factory(self):
        return lambda: LeakyAllocator(self.num_blocks, self.block_size, self.max_model_len)


class PagedAllocatorSuite(AllocatorConformance):
    impl_name = "paged"


class LockIgnoringPrefixCacheSuite(PrefixCacheConformance):
    hypothesis_settings = WITHOUT_SHRINKING

    @pytest.fixture
    def prefix_cache_factory(self):
        return lambda allocator: LockIgnoringPrefixCache(allocator, allocator.block_size)


class PeekingPrefixCacheSuite(PrefixCacheConformance):
    hypothesis_settings = WITHOUT_SHRINKING

    @pytest.fixture
    def prefix_cache_factory(self):
        return lambda allocator: PeekingPrefixCache(allocator, allocator.block_size)


class WrongScaleAttentionSuite(AttentionConformance):
    impl_name = "sdpa"

    @pytest.fixture
    def attention_factory(self):
        def make(block_size=8, queries_per_kv_head=1, dtype=None, num_kv_heads=None, head_dim=None):
            import torch

            num_kv_heads = num_kv_heads or self.num_kv_heads
            return WrongScaleAttention(
                num_heads=num_kv_heads * queries_per_kv_head,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim or self.head_dim,
                block_size=block_size,
                dtype=dtype or torch.float32,
                device=torch.device("cpu"),
            )

        return make


class SinkBlindAttentionSuite(AttentionConformance):
    impl_name = "sdpa"

    @pytest.fixture
    def attention_factory(self):
        def make(block_size=8, queries_per_kv_head=1, dtype=None, num_kv_heads=None, head_dim=None):
            import torch

            num_kv_heads = num_kv_heads or self.num_kv_heads
            return SinkBlindAttention(
                num_heads=num_kv_heads * queries_per_kv_head,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim or self.head_dim,
                block_size=block_size,
                dtype=dtype or torch.float32,
                device=torch.device("cpu"),
            )

        return make


class OverlongDrafterSuite(DrafterConformance):
    impl_name = "ngram"

    @pytest.fixture
    def drafter_factory(self):
        from infer.plugins.drafters.ngram import NgramDrafterConfig

        return lambda: OverlongDrafter(NgramDrafterConfig(num_speculative_tokens=self.num_speculative_tokens))


class OverBudgetSchedulerSuite(SchedulerConformance):
    hypothesis_settings = WITHOUT_SHRINKING

    @pytest.fixture
    def scheduler_factory(self):
        return lambda limits: OverBudgetScheduler()


class PrefixBlindSchedulerSuite(SchedulerConformance):
    hypothesis_settings = WITHOUT_SHRINKING

    @pytest.fixture
    def scheduler_factory(self):
        return lambda limits: PrefixBlindScheduler()


class ImpatientSchedulerSuite(SchedulerConformance):
    hypothesis_settings = WITHOUT_SHRINKING

    @pytest.fixture
    def scheduler_factory(self):
        return lambda limits: ImpatientScheduler()


class AgelessPrioritySchedulerSuite(SchedulerConformance):
    hypothesis_settings = WITHOUT_SHRINKING

    @pytest.fixture
    def scheduler_factory(self):
        return lambda limits: AgelessPriorityScheduler()


class PermissiveGuideSuite(GuideConformance):
    @pytest.fixture
    def guide_factory(self):
        from infer.testing.guide import default_tokenizer_info

        return lambda: PermissiveGuide(default_tokenizer_info())


class ForgetfulGuideSuite(GuideConformance):
    @pytest.fixture
    def guide_factory(self):
        from infer.testing.guide import default_tokenizer_info

        return lambda: ForgetfulGuide(default_tokenizer_info())


def run_suite(
    pytester: pytest.Pytester, suite: type, expected_failures: dict[str, str] | None = None, *args: str
) -> pytest.RunResult:
    """Run ``suite`` (a class of this module) as the inner session's ``TestSuite``; the session runs in this process,
    so it finds this module, broken classes and all, in ``sys.modules``."""
    pytester.makepyfile(
        test_inner=f"""
        import sys

        class TestSuite(sys.modules[{__name__!r}].{suite.__name__}):
            expected_failures = {expected_failures or {}!r}
        """
    )
    return pytester.runpytest("-p", "no:cacheprovider", "-q", *args)


def assert_failed(result: pytest.RunResult, tests: set[str], message: str) -> None:
    """Exactly ``tests`` failed (nothing errored, the rest passed), and ``message`` explains a failure."""
    failed = set(re.findall(r"^FAILED test_inner\.py::TestSuite::(\w+)", result.stdout.str(), re.MULTILINE))
    assert failed == tests, result.stdout.str()
    outcomes = result.parseoutcomes()
    assert "error" not in outcomes and outcomes.get("passed", 0) > 0, outcomes
    result.stdout.fnmatch_lines([f"*{message}*"])


def test_allocator_suite_catches_a_leak_on_release(pytester):
    result = run_suite(pytester, LeakyAllocatorSuite)
    assert_failed(
        result,
        {
            "test_state_machine",
            "test_release_makes_blocks_free_again",
            "test_double_release_raises",
            "test_release_of_null_or_foreign_block_raises",
            "test_retain_then_release_twice_frees",
        },
        "1 blocks are not free after releasing all of *",
    )


def test_allocator_suite_catches_a_block_handed_out_twice(pytester):
    result = run_suite(pytester, RepeatingAllocatorSuite)
    assert_failed(
        result,
        {"test_state_machine", "test_blocks_held_at_once_are_distinct"},
        "block * handed out again while still held",
    )


def test_allocator_suite_passes_a_buddy_allocator(pytester):
    # The same run as the one below catches the wrong-order merge: the buddy design itself conforms.
    result = run_suite(pytester, BuddyAllocatorSuite)
    assert result.ret == pytest.ExitCode.OK and "skipped" not in result.parseoutcomes(), result.stdout.str()


def test_allocator_suite_catches_a_buddy_merge_with_a_run_of_another_order(pytester):
    result = run_suite(pytester, WrongOrderMergingBuddyAllocatorSuite)
    assert_failed(result, {"test_state_machine"}, "*num_free (*) + held (*) != capacity (18)")


def test_prefix_cache_suite_catches_eviction_of_a_locked_entry(pytester):
    result = run_suite(pytester, LockIgnoringPrefixCacheSuite)
    assert_failed(
        result,
        {"test_state_machine", "test_state_machine_over_other_geometries", "test_evict_never_touches_a_locked_entry"},
        "evict dropped locked or shared blocks *",
    )


def test_scheduler_suite_catches_a_blown_token_budget(pytester):
    result = run_suite(pytester, OverBudgetSchedulerSuite)
    assert_failed(
        result,
        {
            "test_budget_and_sequence_limit_hold_every_step",
            "test_prompt_longer_than_the_budget_finishes",
            "test_an_overload_of_favored_requests_does_not_starve_one",
            "test_random_workloads_finish_within_the_limits",
        },
        "plan schedules * tokens, over the budget of *",
    )


def test_scheduler_suite_catches_a_plan_that_ignores_prefix_hits(pytester):
    result = run_suite(pytester, PrefixBlindSchedulerSuite)
    assert_failed(
        result,
        {
            "test_prefix_hits_reach_the_scheduler",
            "test_samples_of_one_request_share_its_prompt",
            "test_random_workloads_finish_within_the_limits",
        },
        "*is scheduled for * tokens but has only * to compute",
    )


def test_scheduler_suite_catches_followers_admitted_before_their_leader_is_ready(pytester):
    result = run_suite(pytester, ImpatientSchedulerSuite)
    assert_failed(
        result,
        {"test_samples_of_one_request_share_its_prompt"},
        "*tokens computed for 5 samples*when followers wait for view.is_ready*",
    )


def test_scheduler_suite_catches_a_priority_order_that_starves(pytester):
    result = run_suite(pytester, AgelessPrioritySchedulerSuite)
    assert_failed(
        result,
        {"test_an_overload_of_favored_requests_does_not_starve_one"},
        "*the disfavored request finished at step *, after the last of the stream arrived*",
    )


def test_prefix_cache_suite_catches_a_peek_that_counts_and_refreshes(pytester):
    result = run_suite(pytester, PeekingPrefixCacheSuite)
    assert_failed(result, {"test_peek_touches_neither_statistics_nor_recency"}, "*assert*stats*")


def test_attention_suite_catches_a_wrong_softmax_scale(pytester):
    result = run_suite(pytester, WrongScaleAttentionSuite, None, "-x")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1, result.stdout.str()  # -x: the first oracle comparison already fails
    result.stdout.fnmatch_lines(["*Mismatched elements*"])


def test_attention_suite_catches_a_backend_that_ignores_its_sinks(pytester):
    result = run_suite(pytester, SinkBlindAttentionSuite, None, "-k", "sinks")
    failed = set(re.findall(r"^FAILED test_inner\.py::TestSuite::(\w+)", result.stdout.str(), re.MULTILINE))
    assert failed == {
        "test_attention_sinks_match_the_oracle",
        "test_attention_sinks_over_shared_prefix_blocks_match_the_oracle",
    }, result.stdout.str()
    assert result.parseoutcomes() == {"failed": 5, "deselected": result.parseoutcomes()["deselected"]}
    result.stdout.fnmatch_lines(["*Mismatched elements*"])


def test_drafter_suite_catches_more_drafts_than_asked(pytester):
    result = run_suite(pytester, OverlongDrafterSuite)
    failed = set(re.findall(r"^FAILED test_inner\.py::TestSuite::(\w+)", result.stdout.str(), re.MULTILINE))
    assert "test_proposes_at_most_k_valid_tokens_per_sequence" in failed, result.stdout.str()
    result.stdout.fnmatch_lines(["*tokens proposed for * with k=*"])


def test_guide_suite_catches_a_mask_that_allows_everything(pytester):
    result = run_suite(pytester, PermissiveGuideSuite)
    assert_failed(
        result,
        {
            "test_never_allows_a_dead_end",
            "test_rollback_restores_exactly",
            "test_accepting_a_valid_string_then_the_stop_token_terminates",
            "test_same_state_same_mask",
        },
        "*is in the mask but refused*",
    )


def test_guide_suite_catches_a_rollback_that_does_nothing(pytester):
    result = run_suite(pytester, ForgetfulGuideSuite)
    assert_failed(result, {"test_rollback_restores_exactly"}, "*the mask after rolling back * tokens differs*")


def test_expected_failure_becomes_a_strict_xfail(pytester):
    known = {"test_double_release_raises": "leaks the first block of a release"}
    result = run_suite(pytester, LeakyAllocatorSuite, known, "-k", "double_release", "-rx")
    result.assert_outcomes(xfailed=1)
    result.stdout.fnmatch_lines(["XFAIL *test_double_release_raises* leaks the first block of a release"])


def test_expected_failure_that_passes_fails_the_run(pytester):
    result = run_suite(pytester, PagedAllocatorSuite, {"test_double_release_raises": "fixed since"}, "-k", "double")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*XPASS(strict)*fixed since*"])


def test_expected_failure_naming_no_test_is_a_usage_error(pytester):
    result = run_suite(pytester, PagedAllocatorSuite, {"test_double_relase_raises": "typo"})
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*expected_failures names no test of the suite: test_double_relase_raises*"])


def test_suites_keep_hypothesis_examples_out_of_the_working_directory(pytester):
    """A read-only checkout failed when Hypothesis saved a failing example to .hypothesis/ in the working directory;
    the suites keep their examples in infer's cache directory."""
    import os
    from pathlib import Path

    database = Path(AllocatorConformance.hypothesis_settings.database.path)
    # Under infer's cache directory (the user's, or $INFER_CACHE_DIR; resolved when the suites were imported), not
    # Hypothesis' default.
    assert database.is_absolute() and ".hypothesis" not in database.parts
    override = os.environ.get("INFER_CACHE_DIR")
    assert database.parent == Path(override).expanduser() if override else database.parent.name == "infer"
    result = run_suite(pytester, LeakyAllocatorWithExampleDatabaseSuite, None, "-k", "state_machine")
    result.assert_outcomes(failed=1)
    assert any(path.is_file() for path in database.rglob("*")), "the failing example was not saved there"
