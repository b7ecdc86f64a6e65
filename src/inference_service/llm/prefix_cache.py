"""The OpenVINO engine's prefix cache hits, tallied by the rule OpenVINO GenAI's cache follows: its
2026.4 pipeline counts no hits of its own (``PipelineMetrics`` has none).

The pipeline keeps KV blocks of :data:`BLOCK_TOKENS` tokens keyed by the whole token prefix each
block ends, a request's blocks from its first step on and a finished request's until their space is
needed, least recently used first. A new prompt takes over its leading whole blocks found so, then
at most one part-filled block; a prompt found whole still computes its last token. The tally keeps
the same keys, as many as the cache has blocks. A block the pipeline overwrote under memory
pressure that the tally still holds counts as a hit it was not (docs/llm.md, "Prefix caching").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: Tokens per KV cache block of OpenVINO GenAI's CPU pipeline (measured: 100 blocks allocate 3,200
#: tokens' bytes).
BLOCK_TOKENS = 32


class PrefixCacheTally:
    """Prompt tokens looked up (``queries``) and found (``hits``) in a prefix cache of
    ``capacity_blocks`` blocks."""

    def __init__(self, capacity_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self.block_tokens = block_tokens
        self.queries = 0
        self.hits = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()  # block key -> None, least recent first

    def __len__(self) -> int:
        return len(self._blocks)

    def _touch(self, key: int) -> None:
        self._blocks[key] = None
        self._blocks.move_to_end(key)

    def lookup(self, ids: Sequence[int]) -> int:
        """Count a new prompt: the tokens of it the cache holds (they are not computed again)."""
        size, step = len(ids), self.block_tokens
        found, previous = 0, 0
        for start in range(0, size, step):
            end = min(start + step, size)
            key = hash((previous, tuple(ids[start:end])))
            if key in self._blocks:
                self._touch(key)
                found, previous = end, key
                if end - start == step:
                    continue
                break
            for length in range(1, end - start):  # a part-filled block, the shortest first
                part = hash((previous, tuple(ids[start:start + length])))
                if part in self._blocks:
                    self._touch(part)
                    found = start + length
                    break
            break
        hits = min(found, size - 1)  # the last prompt token is always computed
        self.queries += size
        self.hits += max(hits, 0)
        return max(hits, 0)

    def remember(self, ids: Sequence[int]) -> None:
        """Hold the blocks of a token sequence whose KV the pipeline computed (or is computing):
        every whole block, and the part-filled last one."""
        previous = 0
        for start in range(0, len(ids), self.block_tokens):
            previous = hash((previous, tuple(ids[start:start + self.block_tokens])))
            self._touch(previous)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
