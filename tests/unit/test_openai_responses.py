"""The Responses API's pure parts: the bounded store of responses."""

from __future__ import annotations

from inference_service.frontends.openai.responses_store import ENTRY_OVERHEAD, ResponseStore, StoreLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ten_thousand_responses_leave_the_store_within_its_bounds():
    limits = StoreLimits(max_entries=500, max_bytes=300_000, max_age_s=60.0)
    clock = Clock()
    store = ResponseStore(limits, clock)
    for i in range(10_000):
        clock.now += 0.001
        size = 100 + (i * 37) % 900  # 100 to 999 bytes of JSON, besides the overhead
        assert store.put(f"resp_{i}", "key", b"r" * size, b"c" * 10)
        assert len(store) <= limits.max_entries and store.bytes <= limits.max_bytes
    assert store.bytes == sum(e.size for e in store._entries.values())
    assert store.get("resp_9999", "key") is not None and store.get("resp_0", "key") is None
    kept = [i for i in range(10_000) if store.get(f"resp_{i}", "key") is not None]
    assert kept == list(range(kept[0], 10_000))  # the oldest went first
    # the age bound: a minute later, everything has expired
    clock.now += 61
    assert store.get("resp_9999", "key") is None and len(store) == 0 and store.bytes == 0


def test_store_owners_entry_size_and_delete():
    store = ResponseStore(StoreLimits(max_entries=10, max_bytes=10_000, max_age_s=60.0), Clock())
    assert store.put("a", "key1", b"{}", b"[]")
    assert store.get("a", "key2") is None and not store.delete("a", "key2")  # another key's entry is absent
    assert store.get("a", "key1").conversation == b"[]"
    assert store.bytes == 4 + ENTRY_OVERHEAD
    assert not store.put("big", "key1", b"x" * 10_000, b"")  # alone above the byte bound: not stored
    assert store.get("a", "key1") is not None  # and nothing was evicted for it
    assert store.delete("a", "key1") and len(store) == 0 and store.bytes == 0
