"""The reader's engine (issue 48, item 1): threads that live across calls, transfers straight
between a file's pages and any pages of a buffer, many submissions in flight together, urgent
ones first, errors naming the file and the page; native, and the Python fallback."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embbench.disk import reader as reader_module
from embbench.disk.layout import PAGE
from embbench.disk.pagefile import PageFile, aligned_pages
from embbench.disk.reader import Engine, TransferError
from tests.test_disk import drive_dir, random_pages  # noqa: F401 (a fixture)


@pytest.fixture(params=["native", "python"])
def engine(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(reader_module, "native_library", lambda: (None, "no C compiler: test"))
    made = Engine(4)
    if request.param == "native" and not made.name.startswith("native"):
        pytest.skip(made.name)
    yield made
    made.close()


def _numbered_file(folder, pages: int) -> PageFile:
    file = PageFile.create(folder / "rows.pages", pages)
    data = aligned_pages(pages)
    data[:, :8] = np.arange(pages, dtype=np.int64).view(np.uint8).reshape(-1, 8)
    file.write(np.arange(pages), data)
    return file


def _numbers(buf: np.ndarray) -> np.ndarray:
    return buf[:, :8].copy().view(np.int64).ravel()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_many_submissions_in_flight_land_each_page_in_its_buffer_page(drive_dir, engine, plan, seed):
    rng = np.random.default_rng(seed)
    with _numbered_file(drive_dir, 64) as file:
        buf = aligned_pages(sum(n for n, _ in plan))
        places = rng.permutation(len(buf))  # scattered buffer pages, as slots are
        transfers, wanted, at = [], [], 0
        for count, urgent in plan:  # all queued before any is waited for
            pages = rng.integers(0, 64, count)
            transfers.append(file.submit(engine, pages, buf, places[at:at + count], write=False, urgent=urgent))
            wanted.append(pages)
            at += count
        for transfer in transfers:
            transfer.wait()
        np.testing.assert_array_equal(_numbers(buf[places]), np.concatenate(wanted))
    os.unlink(drive_dir / "rows.pages")


def test_writes_from_buffer_pages_then_reads_return_them_and_are_counted(drive_dir, engine):
    with PageFile.create(drive_dir / "rows.pages", 16) as file:
        data = random_pages(np.random.default_rng(1), 8)
        file.submit(engine, np.arange(8, 16), data, np.arange(8)[::-1], write=True).wait()
        out = aligned_pages(8)
        file.submit(engine, np.arange(8, 16), out, np.arange(8), write=False).wait()
        np.testing.assert_array_equal(out, data[::-1])
        stats = engine.stats()
        assert (stats["pages_read"], stats["pages_written"], stats["pending"]) == (8, 8, 0)
        assert stats["busy_ns"] > 0


def test_the_native_engine_starts_its_threads_once_not_per_call(drive_dir):
    def threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    before = threads()
    engine = Engine(6)
    if not engine.name.startswith("native"):
        pytest.skip(engine.name)
    try:
        ours = threads() - before
        assert len(ours) == 6
        with _numbered_file(drive_dir, 32) as file:
            buf = aligned_pages(32)
            for _ in range(20):
                file.submit(engine, np.arange(32), buf, np.arange(32), write=False).wait()
                assert ours <= threads()  # the same threads, alive between calls
    finally:
        engine.close()
    assert not ours & threads()


def test_an_urgent_submission_goes_before_those_queued(drive_dir):
    """One thread, a long queue: the urgent read is done long before the queue is."""
    engine = Engine(1)
    try:
        with _numbered_file(drive_dir, 256) as file:
            buf = aligned_pages(257)
            queued = [file.submit(engine, np.arange(256), buf, np.arange(256), write=False) for _ in range(8)]
            file.submit(engine, np.array([7]), buf, np.array([256]), write=False, urgent=True).wait()
            behind = sum(not t.done() for t in queued)
            for t in queued:
                t.wait()
            assert _numbers(buf[256:])[0] == 7
            assert behind >= 1  # the queue of 2,048 reads was not done when the urgent one was
    finally:
        engine.close()


def test_a_short_read_names_the_page_and_the_file(drive_dir, engine):
    with _numbered_file(drive_dir, 4) as file:
        os.truncate(file.path, 2 * PAGE + 100)
        file.pages = 4  # as a file opened before it was cut
        transfer = file.submit(engine, np.array([0, 3, 1]), aligned_pages(3), np.arange(3), write=False)
        with pytest.raises(OSError, match=rf"short read of page 3 in {file.path}: 0 of 4096 bytes"):
            transfer.wait()


def test_a_failed_write_gives_its_errno_and_the_lowest_failed_index(drive_dir, engine):
    with _numbered_file(drive_dir, 4) as file:
        read_only = os.open(file.path, os.O_RDONLY)
        try:
            ticket = engine.submit(read_only, np.array([1, 2, 3]), aligned_pages(3), np.arange(3), write=True)
            with pytest.raises(TransferError) as failed:
                ticket.wait()
            assert failed.value.errno == errno.EBADF and failed.value.index == 0
        finally:
            os.close(read_only)


def test_submissions_from_several_threads_at_once(drive_dir, engine):
    with _numbered_file(drive_dir, 128) as file:
        bufs = [aligned_pages(128) for _ in range(4)]

        def read(buf):
            for _ in range(5):
                file.submit(engine, np.arange(128)[::-1].copy(), buf, np.arange(128), write=False).wait()

        workers = [threading.Thread(target=read, args=(b,)) for b in bufs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for buf in bufs:
            np.testing.assert_array_equal(_numbers(buf), np.arange(128)[::-1])


def test_bad_buffers_and_pages_are_errors_naming_the_file(drive_dir, engine):
    with _numbered_file(drive_dir, 4) as file:
        buf = aligned_pages(2)
        with pytest.raises(ValueError, match=f"{file.path}: buffer pages must be one per page and within"):
            file.submit(engine, np.array([0, 1]), buf, np.array([0, 2]), write=False)
        with pytest.raises(ValueError, match=f"{file.path}: page 9 is out of range"):
            file.submit(engine, np.array([0, 9]), buf, np.array([0, 1]), write=False)
        with pytest.raises(ValueError, match="C-contiguous, writeable uint8"):
            file.submit(engine, np.array([0]), np.zeros((1, 100), np.uint8), np.array([0]), write=False)


def test_a_closed_engine_refuses_work_and_its_tickets_stay_readable(drive_dir):
    engine = Engine(2)
    with _numbered_file(drive_dir, 8) as file:
        ticket = file.submit(engine, np.arange(8), aligned_pages(8), np.arange(8), write=False)
        engine.close()
        ticket.wait()  # finished before the threads ended
        engine.close()  # twice is fine
        if engine.name.startswith("native"):
            with pytest.raises(ValueError, match="closed"):
                engine.submit(file.fileno(), np.arange(1), aligned_pages(1), np.arange(1), write=False)


def test_threads_waiting_for_the_same_submission_at_once_all_return(drive_dir, engine):
    """The store's write-backs are waited for by the thread that reads their blocks again and
    by the patch thread: the first waiter must not free what the second waits on (a run hung
    so, every thread asleep)."""
    with _numbered_file(drive_dir, 64) as file:
        for _ in range(30):
            buf = aligned_pages(64)
            transfer = file.submit(engine, np.arange(64), buf, np.arange(64), write=False)
            waiters = [threading.Thread(target=transfer.wait, daemon=True) for _ in range(4)]
            for w in waiters:
                w.start()
            while not transfer.done():
                pass
            for w in waiters:
                w.join(timeout=10)
            assert not any(w.is_alive() for w in waiters)
            np.testing.assert_array_equal(_numbers(buf), np.arange(64))
