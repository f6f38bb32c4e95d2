"""Block tables: the request-level API over the allocator and the prefix cache (what schedulers call)."""

from __future__ import annotations

from infer.allocator import Allocator
from infer.prefix_cache import Match, PrefixCache
from infer.sequence import Sequence

EVICTION_BATCH_DIVISOR = 256


class KVCacheManager:
    """Gives sequences the blocks they need, credits prefix-cache hits, and takes blocks back.

    Every block a sequence holds is in ``seq.block_table`` with one reference owned by the sequence.
    """

    def __init__(self, allocator: Allocator, prefix_cache: PrefixCache, max_model_len: int):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.block_size = allocator.block_size
        self.max_model_len = max_model_len
        # n > 1: a finished leader's computed prompt blocks, kept (one reference each) for followers still waiting,
        # with the tokens they hold; by the leader's seq_id.
        self._fork_pins: dict[str, tuple[list[int], int]] = {}
        # Full blocks of each sequence already offered to the prefix cache (``offer``), while it holds blocks.
        self._num_offered: dict[Sequence, int] = {}

    # -- queries -------------------------------------------------------------------------------------------------
    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus blocks the prefix cache would give back on demand."""
        return self.allocator.num_free + self.prefix_cache.num_evictable

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens of waiting ``seq`` an admission now would not compute (cache hit or shared fork prefix)."""
        if seq.needs_prompt_logits:
            return 0
        cached = self.prefix_cache.peek(seq.token_ids, seq.params.cache_salt)
        return max(cached, self._fork_prefix(seq)[1])

    def is_ready(self, seq: Sequence) -> bool:
        """False for an n > 1 follower while its leader has not computed the shared prompt yet."""
        leader = seq.fork_of
        return leader is None or leader.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens - 1

    # -- mutations -----------------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Take the cached prefix of a waiting ``seq`` and allocate room for ``num_new_tokens`` more tokens.

        ``num_new_tokens`` counts tokens after the cached prefix (see ``cached_prefix_len``). All or nothing: on
        failure ``seq`` is left exactly as it was.
        """
        assert not seq.block_table, f"sequence {seq.seq_id} is admitted while holding blocks"
        # Prompt logprobs need the logits of every prompt position: no cached prefix for a sequence that owes them.
        if not seq.needs_prompt_logits and not self._share_fork_prefix(seq):
            match = self.prefix_cache.match(seq.token_ids, seq.params.cache_salt)
            self.prefix_cache.lock(match)
            self.allocator.retain(list(match.blocks))
            seq.cache_match = match
            seq.block_table = list(match.blocks)
            seq.num_computed_tokens = match.num_tokens
        if self.allocate(seq, num_new_tokens):
            if seq.num_preemptions == 0:  # a resumed sequence's hit is its own earlier work, not a saving
                seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            return True
        self._drop_blocks(seq)
        return False

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold ``num_computed_tokens + num_new_tokens`` slots. Evicts cached blocks when
        the allocator runs dry; returns False (no change) when even that is not enough."""
        num_slots = min(seq.num_computed_tokens + num_new_tokens, self.max_model_len)
        missing = self.allocator.blocks_needed(num_slots) - len(seq.block_table)
        if missing <= 0:
            return True
        shortfall = missing - self.allocator.num_free
        if shortfall > 0 and self._fork_pins and not self.prefix_cache.can_evict(shortfall):
            # Pins are a saving, not a claim: kept under pressure, they could hold the pool against the very
            # sequence that must run before the followers they wait for (a deadlock the scheduler suite found).
            for leader_id in list(self._fork_pins):
                self._release_pin(leader_id)
            shortfall = missing - self.allocator.num_free
        if shortfall > 0:
            if not self.prefix_cache.can_evict(shortfall):
                return False
            # A few blocks ahead (1/256 of the pool), so a full pool does not run an eviction per allocation: each
            # costs a pass over the cache's candidates (a radix tree's leaves), which grows with the pool.
            self.prefix_cache.evict(max(shortfall, self.allocator.capacity // EVICTION_BATCH_DIVISOR))
        blocks = self.allocator.allocate(missing)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def commit(self, seq: Sequence) -> None:
        """Offer the sequence's computed, committed tokens to the prefix cache (called after every step)."""
        num_committed = min(seq.num_computed_tokens, seq.num_tokens)
        num_full_blocks = num_committed // self.block_size
        if num_full_blocks == 0:
            return
        num_tokens = num_full_blocks * self.block_size
        self.prefix_cache.insert(seq.token_ids[:num_tokens], seq.block_table[:num_full_blocks], seq.params.cache_salt)

    def offer(self, seq: Sequence) -> None:
        """After a step: offer ``seq``'s newly filled blocks to the prefix cache (``commit``), only when a block was
        filled since the last offer (a decode step fills one block in ``block_size``)."""
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full > self._num_offered.get(seq, 0):
            self.commit(seq)
            self._num_offered[seq] = num_full

    def trim(self, seq: Sequence) -> None:
        """Release the blocks wholly past ``seq``'s committed tokens (reserved for drafts that were rejected)."""
        keep = self.allocator.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.allocator.release(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks (its computed prefix stays in the prefix cache for the next request)."""
        self.commit(seq)
        self._drop_blocks(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        if isinstance(seq.cache_match, Match):
            self.prefix_cache.unlock(seq.cache_match)
        seq.cache_match = None
        self._num_offered.pop(seq, None)
        # Tail first, so that an LRU cache sees a chain's head as the more recently used end.
        self.allocator.release(seq.block_table[::-1])
        seq.block_table = []
        seq.num_computed_tokens = 0

    # -- n > 1: followers share the leader's computed prompt blocks ----------------------------------------------
    def pin_fork_prefix(self, leader: Sequence) -> None:
        """Keep a finishing leader's computed prompt blocks for its followers still waiting (``n`` above
        ``max_num_seqs``): without it every later sample computed the whole prompt again. ``release_fork_pin``
        gives them back; so does an allocation that would fail without them."""
        num_blocks = self._shareable_prompt_blocks(leader)
        if num_blocks == 0 or leader.seq_id in self._fork_pins:
            return
        blocks = leader.block_table[:num_blocks]
        self.allocator.retain(blocks)
        self._fork_pins[leader.seq_id] = (blocks, num_blocks * self.block_size)

    def free_finished(self, seq: Sequence, followers_waiting: bool) -> None:
        """Free a finished running sample's blocks; a leader (``fork_of`` None) whose followers still wait first pins
        its computed prompt for them."""
        if followers_waiting and seq.fork_of is None:
            self.pin_fork_prefix(seq)
        self.free(seq)

    def release_fork_pin(self, leader: Sequence) -> None:
        """Give back what ``pin_fork_prefix`` kept (when the request has finished: no follower waits any more)."""
        self._release_pin(leader.seq_id)

    def _release_pin(self, leader_id: str) -> None:
        blocks, _ = self._fork_pins.pop(leader_id, ([], 0))
        self.allocator.release(blocks[::-1])

    def _fork_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """The leader's blocks a waiting follower can share and the tokens they hold: from the leader while it holds
        them, else from its pin."""
        leader = seq.fork_of
        if leader is None:
            return [], 0
        if not leader.block_table:
            return self._fork_pins.get(leader.seq_id, ([], 0))
        num_blocks = self._shareable_prompt_blocks(leader)
        return leader.block_table[:num_blocks], num_blocks * self.block_size

    def _shareable_prompt_blocks(self, leader: Sequence) -> int:
        """Whole blocks of the leader's computed prompt a follower can take, short of the prompt's last token (the
        follower computes that one itself, to get logits of its own)."""
        return min(leader.num_computed_tokens, leader.num_prompt_tokens - 1) // self.block_size

    def _share_fork_prefix(self, seq: Sequence) -> bool:
        blocks, num_tokens = self._fork_prefix(seq)
        if num_tokens <= self.prefix_cache.peek(seq.token_ids, seq.params.cache_salt):
            return False
        self.allocator.retain(blocks)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = num_tokens
        return True
