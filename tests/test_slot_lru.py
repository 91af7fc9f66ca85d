"""The file store's eviction order (embbench.cache.slot_lru, issue 48): the same victims as the
scan of every host slot it replaced, with work that grows with the batch, not host memory."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.cache.file_rows import FileRows
from embbench.cache.slot_lru import SlotLru

NEVER = np.iinfo(np.int64).max


class FullScan:
    """The reference: the file store's bookkeeping before SlotLru, a scan of every slot a call."""

    def __init__(self, capacity):
        self.pins = np.zeros(capacity, np.int64)
        self.ready = np.zeros(capacity, bool)
        self.empty = np.ones(capacity, bool)
        self.last_use = np.zeros(capacity, np.int64)
        self.clock = 0

    def touch(self, slots):
        self.clock += 1
        self.last_use[slots] = self.clock

    def attach(self, slots):
        self.empty[slots] = False
        self.ready[slots] = False
        self.touch(slots)

    def order(self, keep):
        """Each slot's place in the eviction order (NEVER: it may not be evicted)."""
        free = (self.pins == 0) & (self.ready | self.empty)
        free[keep] = False
        return np.where(free, np.where(self.empty, -1, self.last_use), NEVER)


def _some(data, capacity, label, duplicates=True):
    slots = data.draw(st.lists(st.integers(0, capacity - 1), max_size=capacity + 2, unique=not duplicates), label=label)
    return np.array(slots, dtype=np.int64)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 24), piece=st.integers(1, 8), slack=st.integers(0, 4), data=st.data())
def test_the_victims_and_the_pinned_count_are_the_full_scan_s(capacity, piece, slack, data):
    """Random touches, pins, unpins, arrivals, attachments and evictions (their victims attached,
    pinned and arriving as the file store does): after each, as many slots pinned as the scan
    counts, and each eviction's victims are k distinct slots the scan would take: the same places
    in its order (slots touched together tie, empty slots tie), or None where the scan finds
    fewer than k free. Small pieces and slack make the queue's splits and compactions happen."""
    lru, ref = SlotLru(capacity), FullScan(capacity)
    lru.PIECE, lru.SLACK = piece, slack
    pinned = []  # the pins given, as a multiset of slots
    for _ in range(data.draw(st.integers(1, 60), label="calls")):
        action = data.draw(st.sampled_from(["touch", "pin", "unpin", "arrive", "attach", "evict", "evict"]))
        if action == "touch":
            slots = _some(data, capacity, "touched")
            lru.touch(slots)
            ref.touch(slots)
        elif action == "pin":
            slots = _some(data, capacity, "pinned")
            lru.pin(slots)
            np.add.at(ref.pins, slots, 1)
            pinned += slots.tolist()
        elif action == "unpin" and pinned:
            chosen = data.draw(st.sets(st.integers(0, len(pinned) - 1)), label="unpinned")
            slots = np.array([pinned[i] for i in chosen], dtype=np.int64)
            pinned = [s for i, s in enumerate(pinned) if i not in chosen]
            lru.unpin(slots)
            np.subtract.at(ref.pins, slots, 1)
        elif action == "arrive":
            slots = _some(data, capacity, "arrived")
            lru.arrived(slots)
            ref.ready[slots] = True
        elif action == "attach":  # (not through an eviction: slots filled out of order)
            slots = _some(data, capacity, "attached", duplicates=False)
            lru.attach(slots)
            ref.attach(slots)
        elif action == "evict":
            keep = _some(data, capacity, "kept") if data.draw(st.booleans(), label="keep?") else None
            order = ref.order(keep if keep is not None else [])
            k = data.draw(st.integers(0, int((order < NEVER).sum()) + 1), label="k")  # (one more: too many)
            victims = lru.victims(k, keep)
            if int((order < NEVER).sum()) < k:
                assert victims is None
                assert lru.evictable(keep) == int((order < NEVER).sum())
            else:
                assert victims is not None and len(victims) == k == len(np.unique(victims))
                assert np.array_equal(np.sort(order[victims]), np.sort(order)[:k])
                if k and data.draw(st.booleans(), label="filled"):  # as the file store does
                    lru.attach(victims)
                    ref.attach(victims)
                    lru.pin(victims)
                    np.add.at(ref.pins, victims, 1)
                    pinned += victims.tolist()
                    if data.draw(st.booleans(), label="arrived"):
                        lru.arrived(victims)
                        ref.ready[victims] = True
        assert lru.pinned == int((ref.pins > 0).sum())
        assert np.array_equal(lru.pins, ref.pins) and np.array_equal(lru.ready, ref.ready)
        assert lru._entries == sum(len(slots) for slots, _ in lru._touches) <= 2 * capacity + slack


def test_unpinning_a_slot_more_often_than_it_was_pinned_is_an_error():
    lru = SlotLru(4)
    lru.pin(np.array([1, 1, 2]))
    lru.unpin(np.array([1, 2]))
    with pytest.raises(ValueError, match="slot 2 unpinned more often than pinned"):
        lru.unpin(np.array([1, 2]))
    assert lru.pinned == 1 and lru.pins.tolist() == [0, 1, 0, 0]


def _store(tmp_path, rows, dram_ratio, batch_blocks):
    store = FileRows(tmp_path / "t.rows", rows, 10, torch.float32, dram_ratio=dram_ratio, batch_blocks=batch_blocks,
                     direct=False)
    store.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 10))
    return store


def test_a_store_s_evictions_look_at_entries_in_proportion_to_its_batches_not_its_host_memory(tmp_path):
    """10k host slots, batches of 60 blocks announced 4 ahead (half of them from a hot set):
    once host memory is full, each batch's evictions look at under a tenth of host memory's
    entries in the recency queue (about 50 on average), not at 10k slots as the scan did; and the
    rows are right."""
    store = _store(tmp_path, 102 * 20_000, 0.5, 60)  # 102 rows of 40 bytes a page: 20k blocks, 10k slots
    store.lru.PIECE = 64
    rng = np.random.default_rng(0)
    hot = rng.choice(store.blocks, 1000, replace=False)
    batches = [np.unique(np.concatenate([rng.choice(hot, 30, replace=False), rng.choice(store.blocks, 30)]))
               * store.rows_per_block + 7 for _ in range(500)]
    try:
        assert store.capacity == 10_000
        examined = []
        for number, batch in enumerate(batches):
            store.announce(number, batch)
            if number >= 4:
                assert torch.equal(store.gather(batches[number - 4], number - 4)[:, 0],
                                   torch.from_numpy(batches[number - 4]).float())
                store.release(number - 4)
                examined.append(store.lru.examined)
        assert store.lru.empty.sum() == 0  # full: the later batches evict
        per_batch = np.diff(examined[-100:])
        assert 0 < per_batch.mean() and per_batch.max() < store.capacity / 10, (per_batch.mean(), per_batch.max())
        assert store.lru._entries <= 2 * store.capacity + store.lru.SLACK  # stale entries do not pile up
    finally:
        store.close()


def test_a_batch_with_more_blocks_than_host_memory_is_refused_naming_the_file(tmp_path):
    store = _store(tmp_path, 102 * 40, 0.5, 10)  # 40 blocks, 20 slots
    try:
        rows = np.arange(21) * store.rows_per_block
        store.announce(0, rows)
        with pytest.raises(RuntimeError, match=f"{store.path}: host memory holds 20 blocks, 20 of them free of "
                                               "announced batches: 21 more do not fit .* raise dram_ratio"):
            store.gather(rows, 0)
    finally:
        store.close()
