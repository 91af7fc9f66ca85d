"""embbench.disk: the page file, the reader (native and Python) and the drive probe (issue 43)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embbench.disk import pagefile as pagefile_module
from embbench.cli import disk as disk_command
from embbench.disk import probe as probe_module
from embbench.disk import reader as reader_module
from embbench.disk.layout import PAGE
from embbench.disk.pagefile import DirectIOError, PageFile, aligned_pages, mount_of
from embbench.disk.probe import DriveProbe, measure_drive
from embbench.disk.reader import ENGINES, TransferError, get_reader, native_library

SHM_IS_TMPFS = mount_of("/dev/shm").filesystem == "tmpfs"


@pytest.fixture
def drive_dir(tmp_path):
    """A fresh folder where O_DIRECT reads reach a drive: tmp_path, or one beside the tests
    where the temporary folder is on tmpfs."""
    if mount_of(tmp_path).filesystem not in pagefile_module.MEMORY_FILESYSTEMS:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent, prefix=".disk-test-") as folder:
        yield Path(folder)


def engine_reader(engine: str, threads: int = 4):
    """The reader of that engine, or a skip saying why it is not here (no compiler, no io_uring)."""
    reader = get_reader(threads, engine)
    if reader.engine != engine:
        pytest.skip(reader.name)
    return reader


def random_pages(rng: np.random.Generator, count: int) -> np.ndarray:
    data = aligned_pages(count)
    data[:] = rng.integers(0, 256, size=data.shape, dtype=np.uint8)
    return data


# --------------------------------------------------------------------------- buffers


def test_aligned_pages_are_zeroed_and_page_aligned():
    pages = aligned_pages(3)
    assert pages.shape == (3, PAGE) and pages.dtype == np.uint8
    assert pages.ctypes.data % PAGE == 0 and not pages.any()
    assert aligned_pages(0).shape == (0, PAGE)
    with pytest.raises(ValueError, match="count must be >= 0"):
        aligned_pages(-1)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), file_pages=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_reads_return_what_was_written(drive_dir, engine, data, file_pages, seed):
    """Random writes (page sets and contents) then random reads, against a numpy copy of the file:
    every engine gives the reference's bytes, so all give identical bytes."""
    reader = engine_reader(engine, threads=data.draw(st.sampled_from([1, 3, 16])))
    rng = np.random.default_rng(seed)
    reference = np.zeros((file_pages, PAGE), dtype=np.uint8)
    path = Path(tempfile.mkdtemp(dir=drive_dir)) / "rows.pages"
    with PageFile.create(path, file_pages, reader=reader) as pages:
        assert pages.direct and pages.direct_problem is None
        for _ in range(data.draw(st.integers(1, 3))):
            chosen = rng.permutation(file_pages)[: data.draw(st.integers(0, file_pages))]
            contents = random_pages(rng, len(chosen))
            pages.write(chosen, contents)
            reference[chosen] = contents
        wanted = rng.integers(0, file_pages, size=data.draw(st.integers(0, 3 * file_pages)))  # repeats allowed
        out = aligned_pages(len(wanted))
        pages.read(wanted, out)
        np.testing.assert_array_equal(out, reference[wanted])
    with PageFile.open(path, reader=reader) as again:  # what was written is in the file, not in a cache
        out = aligned_pages(file_pages)
        again.read(np.arange(file_pages), out)
        np.testing.assert_array_equal(out, reference)


def test_a_new_file_reads_as_zero_pages(drive_dir):
    with PageFile.create(drive_dir / "zero.pages", 5) as pages:
        assert pages.pages == 5 and (drive_dir / "zero.pages").stat().st_size == 5 * PAGE
        out = aligned_pages(5)
        out[:] = 7
        pages.read(np.arange(5), out)
        assert not out.any()


@pytest.mark.parametrize("engine", ENGINES)
def test_threads_reading_and_writing_disjoint_pages_at_once(drive_dir, engine):
    """A background thread reads its half while the caller writes the other half, through one
    PageFile: neither sees the other's pages change, and the last writes are what the file holds."""
    reader = engine_reader(engine, threads=8)
    rng = np.random.default_rng(1)
    half = 64
    with PageFile.create(drive_dir / "shared.pages", 2 * half, reader=reader) as pages:
        fixed = random_pages(rng, half)
        pages.write(np.arange(half, 2 * half), fixed)
        wrong: list[int] = []

        def read_back() -> None:
            out = aligned_pages(3 * half)
            for round_ in range(30):
                wanted = rng_reader.integers(half, 2 * half, size=3 * half)
                pages.read(wanted, out)
                if not np.array_equal(out, fixed[wanted - half]):
                    wrong.append(round_)

        rng_reader = np.random.default_rng(2)
        background = threading.Thread(target=read_back)
        background.start()
        written = np.zeros((half, PAGE), dtype=np.uint8)
        for _ in range(30):
            order, latest = rng.permutation(half), random_pages(rng, half)
            pages.write(order, latest)
            written[order] = latest
        background.join()
        assert wrong == []
        out = aligned_pages(2 * half)
        pages.read(np.arange(2 * half), out)
        np.testing.assert_array_equal(out[:half], written)
        np.testing.assert_array_equal(out[half:], fixed)


# --------------------------------------------------------------------------- bad input and faults


def test_create_refuses_a_missing_folder_and_an_existing_file(drive_dir):
    with pytest.raises(FileNotFoundError, match=f"the folder {drive_dir / 'nowhere'} does not exist"):
        PageFile.create(drive_dir / "nowhere" / "rows.pages", 4)
    (drive_dir / "rows.pages").write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match=f"{drive_dir / 'rows.pages'} exists: refusing to overwrite"):
        PageFile.create(drive_dir / "rows.pages", 4)
    assert (drive_dir / "rows.pages").read_bytes() == b"keep me"


def test_create_says_what_space_is_needed_and_free(drive_dir, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pagefile_module.shutil, "disk_usage", lambda folder: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(OSError, match=r"not enough space for .*rows.pages: needs 16.00 KiB, 100 B free on ") as caught:
        PageFile.create(drive_dir / "rows.pages", 4)
    assert caught.value.errno == errno.ENOSPC
    assert not (drive_dir / "rows.pages").exists()


def test_open_refuses_what_is_not_a_page_file(drive_dir):
    with pytest.raises(FileNotFoundError, match=f"page file {drive_dir / 'absent.pages'} does not exist"):
        PageFile.open(drive_dir / "absent.pages")
    (drive_dir / "odd.pages").write_bytes(b"x" * (PAGE + 1))
    with pytest.raises(ValueError, match=f"{drive_dir / 'odd.pages'}: {PAGE + 1} bytes is not a whole number"):
        PageFile.open(drive_dir / "odd.pages")


def test_bad_page_numbers_and_buffers_are_errors_naming_the_file(drive_dir):
    path = drive_dir / "rows.pages"
    with PageFile.create(path, 4) as pages:
        for wanted in ([4], [0, -1]):
            with pytest.raises(ValueError, match=f"{path}: page {wanted[-1]} is out of range: the file has 4 pages"):
                pages.read(np.array(wanted), aligned_pages(len(wanted)))
        with pytest.raises(ValueError, match=r"out must be uint8 \[2, 4096\].*got uint8 \(1, 4096\)"):
            pages.read(np.array([0, 1]), aligned_pages(1))
        with pytest.raises(ValueError, match=r"data must be uint8 \[1, 4096\].*got float32"):
            pages.write(np.array([0]), np.zeros((1, PAGE), dtype=np.float32))
        with pytest.raises(ValueError, match="pages must be a 1-D integer array"):
            pages.read(np.array([0.5]), aligned_pages(1))
        shifted = aligned_pages(3).reshape(-1)[512: 512 + 2 * PAGE].reshape(2, PAGE)
        with pytest.raises(ValueError, match=f"{path}: out is not 4096-byte aligned, as O_DIRECT needs"):
            pages.read(np.array([0, 1]), shifted)
        with pytest.raises(ValueError, match=f"{path}: page 2 is written twice in one call"):
            pages.write(np.array([2, 1, 2]), aligned_pages(3))
    with pytest.raises(ValueError, match=f"page file {path} is closed"):
        pages.read(np.array([0]), aligned_pages(1))


def test_a_short_read_names_the_page_and_the_file(drive_dir):
    path = drive_dir / "rows.pages"
    with PageFile.create(path, 4) as pages:
        os.truncate(path, 2 * PAGE)  # someone cut the file under us
        with pytest.raises(OSError, match=f"short read of page 3 in {path}: 0 of 4096 bytes") as caught:
            pages.read(np.array([0, 3, 1]), aligned_pages(3))
        assert caught.value.errno == errno.EIO


@pytest.mark.parametrize("engine", ENGINES)
def test_the_reader_reports_enospc_and_the_failed_index(engine):
    """/dev/full refuses every write with ENOSPC: the reader says so, with the lowest index."""
    reader = engine_reader(engine)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(TransferError) as caught:
            reader.transfer(fd, np.arange(3, dtype=np.int64), aligned_pages(3), write=True)
    finally:
        os.close(fd)
    assert caught.value.errno == errno.ENOSPC and caught.value.index == 0


def test_a_full_drive_during_a_write_names_the_device_and_the_page(drive_dir):
    class FullDrive:
        name = "a drive that fills at the second page"

        def transfer(self, fd, pages, buf, write):
            raise TransferError(errno.ENOSPC, 1, 0)

    path = drive_dir / "rows.pages"
    with PageFile.create(path, 8, reader=FullDrive()) as pages:
        with pytest.raises(OSError, match=rf"no space left on {pages.mount.device} writing {path} \(page 7\)") as caught:
            pages.write(np.array([3, 7]), aligned_pages(2))
    assert caught.value.errno == errno.ENOSPC


# --------------------------------------------------------------------------- where O_DIRECT measures a drive


def test_this_machines_work_and_tmp_folders():
    """What /work and /tmp are on here, and whether O_DIRECT reads work there (it is said, not assumed)."""
    for folder in [f for f in ("/work", tempfile.gettempdir()) if os.path.isdir(f)]:
        mount = mount_of(folder)
        assert mount.filesystem != "unknown"
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            path = Path(scratch) / "probe.pages"
            if mount.filesystem in pagefile_module.MEMORY_FILESYSTEMS:
                with pytest.raises(DirectIOError):
                    PageFile.create(path, 1)
            else:
                with PageFile.create(path, 1) as pages:
                    assert pages.direct and pages.filesystem == mount.filesystem


@pytest.mark.skipif(not SHM_IS_TMPFS, reason="/dev/shm is not tmpfs here")
def test_tmpfs_is_refused_unless_buffered_reads_are_asked_for():
    path = Path("/dev/shm") / f"embbench-test-{os.getpid()}.pages"
    with pytest.raises(DirectIOError, match=f"{path}: cannot read with O_DIRECT from a drive: tmpfs: O_DIRECT reads "
                                            "would be memory reads, not the drive's"):
        PageFile.create(path, 2)
    assert not path.exists()  # a refused file is not left behind
    pages = PageFile.create(path, 2, direct=False)
    try:
        assert not pages.direct and pages.filesystem == "tmpfs" and "tmpfs" in pages.direct_problem
        data = random_pages(np.random.default_rng(3), 2)
        pages.write(np.array([1, 0]), data)
        out = np.zeros((2, PAGE), dtype=np.uint8)  # buffered: any buffer will do
        pages.read(np.array([0, 1]), out)
        np.testing.assert_array_equal(out, data[::-1])
    finally:
        pages.remove()
    assert not path.exists()


def test_a_file_system_refusing_o_direct_is_named(drive_dir, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(pagefile_module.os, "open", no_direct)
    with pytest.raises(DirectIOError, match=r"refuses O_DIRECT \(EINVAL\)"):
        PageFile.create(drive_dir / "rows.pages", 2)
    assert not (drive_dir / "rows.pages").exists()
    with PageFile.create(drive_dir / "rows.pages", 2, direct=False) as pages:
        assert not pages.direct and "refuses O_DIRECT" in pages.direct_problem


def test_mount_of_takes_the_deepest_mount_point():
    assert mount_of("/proc/self").filesystem == "proc"
    assert mount_of("/dev/shm/not-there").point == "/dev/shm"
    assert mount_of("/").point == "/"


# --------------------------------------------------------------------------- the native library and its fallback


def test_without_a_compiler_the_python_pool_reads_and_says_why(drive_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(drive_dir / "cache"))  # nothing built yet
    monkeypatch.setenv("CC", "no-such-cc-embbench")
    assert native_library() == (None, "no C compiler: no-such-cc-embbench not found")
    reader = get_reader(4)
    assert reader.engine == "python"
    assert reader.name == "python preadv pool, 4 threads (no C compiler: no-such-cc-embbench not found)"
    with PageFile.create(drive_dir / "rows.pages", 3, reader=reader) as pages:
        data = random_pages(np.random.default_rng(4), 3)
        pages.write(np.array([2, 0, 1]), data)
        out = aligned_pages(3)
        pages.read(np.array([2, 0, 1]), out)
        np.testing.assert_array_equal(out, data)


def test_a_failed_build_falls_back_and_says_so(drive_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(drive_dir / "cache"))
    monkeypatch.setenv("CC", "false")
    assert native_library() == (None, "C build failed: no message")
    assert get_reader(2).name == "python preadv pool, 2 threads (C build failed: no message)"
    monkeypatch.setattr(reader_module, "_SOURCE", drive_dir / "left-out.c")  # an install without the C file
    lib, why = native_library()
    assert lib is None and why.startswith("no C source: ") and "left-out.c" in why


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_the_library_is_built_once_into_the_cache_keyed_by_its_source(drive_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(drive_dir / "cache"))
    monkeypatch.delenv("CC", raising=False)
    lib, why = native_library()
    assert lib is not None and why == ""
    built = sorted((drive_dir / "cache" / "embbench").iterdir())
    assert len(built) == 2 and built[0].name.startswith("pageio-") and built[0].suffix == ".so"
    assert built[1].name == built[0].name + ".sha256"  # the hash of what the build wrote
    monkeypatch.setenv("CC", "no-such-cc-embbench")  # built: no compiler needed any more
    assert native_library()[0] is not None
    monkeypatch.setattr(reader_module, "_SOURCE", drive_dir / "pageio.c")
    (drive_dir / "pageio.c").write_bytes(Path(pagefile_module.__file__).with_name("pageio.c").read_bytes()
                                        + b"\n/* changed */\n")
    assert native_library() == (None, "no C compiler: no-such-cc-embbench not found")  # a new source: a new build


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_a_truncated_library_is_rebuilt_not_loaded(drive_dir):
    """Issue 50, 4: mapping a short library kills the process with SIGBUS; its hash tells first.
    (Each step in a process of its own: this one never maps the file.)"""
    env = dict(os.environ, XDG_CACHE_HOME=str(drive_dir / "cache"), PYTHONPATH=str(Path(__file__).parents[1]))
    env.pop("CC", None)

    def reader_name() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from embbench.disk import reader\n"
                               "print(reader.get_reader(2).name)"], env=env, capture_output=True, text=True, timeout=300)

    assert reader_name().stdout.strip() == "native pread pool, 2 threads"
    library = next((drive_dir / "cache" / "embbench").glob("pageio-*.so"))
    short = library.with_name("short")
    short.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    os.replace(short, library)  # as an interrupted copy leaves it
    done = reader_name()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "native pread pool, 2 threads"  # rebuilt
    assert reader_module._intact(library)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_a_library_without_the_reader_s_functions_falls_back_and_says_so(drive_dir, monkeypatch):
    """A file under the library's name, intact as its hash says, that is not the reader's: the
    Python pool reads, and its name says why (before: AttributeError, no fall-back)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(drive_dir / "cache"))
    monkeypatch.delenv("CC", raising=False)
    library = reader_module._library_path()  # never loaded by this process: it is not the reader's
    library.parent.mkdir(parents=True)
    other = drive_dir / "other.c"
    other.write_text("int something_else(void) { return 1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(other)], check=True)
    Path(str(library) + ".sha256").write_text(reader_module._digest(library))
    lib, why = native_library()
    assert lib is None and why.startswith(f"loading {library} failed: ") and "pageio_threads" in why
    reader = get_reader(3)
    assert reader.engine == "python" and "pageio_threads" in reader.name
    monkeypatch.setenv("CC", "no-such-cc-embbench")  # damaged and no compiler: said, and the pool reads
    (drive_dir / "short").write_bytes(b"\x7fELF")
    os.replace(drive_dir / "short", library)  # a new file: the one this process mapped stays whole
    assert native_library() == (None, f"no C compiler: no-such-cc-embbench not found (and {library} is damaged)")


def test_reader_arguments_are_checked():
    with pytest.raises(ValueError, match="reader engine 'aio': expected one of pread, io_uring, python"):
        get_reader(4, "aio")
    with pytest.raises(ValueError, match="reader threads 0: must be at least 1"):
        get_reader(0)


# --------------------------------------------------------------------------- the probe

def probe_args(*argv: str):
    parser = argparse.ArgumentParser()
    disk_command._add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_probe_measures_a_drive_and_the_reader_and_leaves_nothing(drive_dir):
    probe = measure_drive(drive_dir, seconds=0.05, depths=(1, 4), file_bytes=64 * PAGE, ceiling_seconds=0.05)
    assert isinstance(probe, DriveProbe) and probe.problem is None
    assert probe.filesystem == mount_of(drive_dir).filesystem and probe.device == mount_of(drive_dir).device
    assert [rate.depth for rate in probe.drive] == [1, 4] == [rate.depth for rate in probe.memory]
    for rate in probe.drive + probe.memory:
        assert rate.reads > 0 and rate.seconds > 0 and rate.reads_per_s > 0
        assert rate.mib_per_s == pytest.approx(rate.reads_per_s * PAGE / 2**20)
        assert rate.mean_latency_us == pytest.approx(rate.depth / rate.reads_per_s * 1e6)
    assert probe.reader_ceiling == max(rate.reads_per_s for rate in probe.memory)
    record = probe.as_dict()
    assert record["drive"][1]["depth"] == 4 and record["reader_ceiling_reads_per_s"] == probe.reader_ceiling
    assert list(drive_dir.iterdir()) == []  # the scratch file is gone


@pytest.mark.skipif(not SHM_IS_TMPFS, reason="/dev/shm is not tmpfs here")
def test_the_probe_on_tmpfs_says_so_and_measures_no_drive():
    before = set(os.listdir("/dev/shm"))
    probe = measure_drive("/dev/shm", seconds=0.05, depths=(2,), file_bytes=16 * PAGE)
    assert probe.filesystem == "tmpfs" and probe.drive is None and probe.as_dict()["drive"] is None
    assert probe.problem == "tmpfs: O_DIRECT reads would be memory reads, not the drive's"
    assert probe.memory[0].reads_per_s > 0  # the reader's ceiling is still measured
    assert set(os.listdir("/dev/shm")) == before


@pytest.mark.parametrize("fault", [KeyboardInterrupt, OSError])
def test_the_scratch_file_is_removed_when_the_probe_is_stopped(drive_dir, monkeypatch, fault):
    def stopped(*args):
        assert len(list(drive_dir.glob(".embbench-disk-probe-*.pages"))) == 1  # the scratch file exists now
        raise fault()

    monkeypatch.setattr(probe_module, "_rate", stopped)
    with pytest.raises(fault):
        measure_drive(drive_dir, seconds=0.05, depths=(1,), file_bytes=8 * PAGE)
    assert list(drive_dir.iterdir()) == []


def test_a_killed_probe_s_scratch_file_is_removed_by_the_next_probe(drive_dir):
    """Issue 50, 2: SIGKILL leaves the scratch file; its owner note names a dead pid, so the next
    probe in that folder removes it (a file of that name without a note is not the probe's)."""
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal\n"
                               "from embbench.disk import probe\n"
                               "probe._rate = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
                               f"probe.measure_drive({str(drive_dir)!r}, 0.05, (1,), 8 * 4096)"],
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    assert killed.wait() == -9
    left = sorted(p.name for p in drive_dir.iterdir())
    assert len(left) == 2 and left[0].endswith(".pages") and left[1].endswith(".pages.embbench-owner")
    (drive_dir / ".embbench-disk-probe-1-mine.pages").write_text("not the probe's")
    measure_drive(drive_dir, seconds=0.02, depths=(1,), file_bytes=8 * PAGE, ceiling_seconds=0.02)
    assert [p.name for p in drive_dir.iterdir()] == [".embbench-disk-probe-1-mine.pages"]


def test_a_depth_s_rate_is_never_of_no_reads_and_its_buffer_is_bounded(drive_dir, monkeypatch):
    sizes = []
    real = probe_module.aligned_pages
    monkeypatch.setattr(probe_module, "aligned_pages", lambda n: sizes.append(n) or real(n))
    probe = measure_drive(drive_dir, seconds=0.01, depths=(1, 1024), file_bytes=8 * PAGE, ceiling_seconds=0.01)
    assert all(rate.reads > 0 and rate.reads_per_s > 0 for rate in probe.drive + probe.memory)
    assert max(sizes) <= probe_module.MAX_BATCH_PAGES


@pytest.mark.slow  # a fresh interpreter importing embbench (over 3 s on 2 cores)
def test_python_m_probe_is_no_command_and_says_which_is(tmp_path):
    done = subprocess.run([sys.executable, "-m", "embbench.disk.probe"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])), timeout=120)
    assert done.returncode == 2 and "usage: embbench disk" in done.stderr


def test_the_command_prints_the_table(drive_dir, capsys):
    assert disk_command.main(probe_args(str(drive_dir), "--seconds", "0.05", "--depths", "1,2",
                                        "--file-size", "256KiB")) == 0
    out = capsys.readouterr().out
    assert "drive reads/s" in out and "reader from" in out and mount_of(drive_dir).filesystem in out
    assert disk_command.main(probe_args(str(drive_dir), "--seconds", "0.05", "--depths", "3",
                                        "--file-size", "64KiB", "--json")) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["drive"][0]["depth"] == 3 and record["path"] == str(drive_dir)


def test_the_command_refuses_a_bad_folder_in_one_line(drive_dir, capsys, monkeypatch):
    (drive_dir / "file").write_text("x")
    cases = {str(drive_dir / "absent"): f"{drive_dir / 'absent'}: no such folder",
             str(drive_dir / "file"): f"{drive_dir / 'file'} is not a folder"}
    for folder, message in cases.items():
        assert disk_command.main(probe_args(folder)) == 2
        assert capsys.readouterr().err == f"embbench disk: {message}\n"
    with monkeypatch.context() as patched:
        patched.setattr(probe_module.os, "access", lambda path, mode: False)
        assert disk_command.main(probe_args(str(drive_dir))) == 2
        assert capsys.readouterr().err == f"embbench disk: {drive_dir} is not writable: the probe writes a scratch file there\n"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pagefile_module.shutil, "disk_usage", lambda folder: usage(2**40, 2**40 - 2**20, 2**20))
    assert disk_command.main(probe_args(str(drive_dir))) == 2
    assert capsys.readouterr().err == (f"embbench disk: not enough space for the probe's scratch file in {drive_dir}: "
                                       f"needs 1.00 GiB, 1.00 MiB free on {mount_of(drive_dir).device}\n")
    assert disk_command.main(probe_args(str(drive_dir), "--depths", "1,x")) == 2
    assert "--depths '1,x': expected numbers separated by commas" in capsys.readouterr().err
    monkeypatch.undo()
    bounds = {("--seconds", "nan"): "seconds nan: expected 0.01 to 600 seconds at each depth",
              ("--seconds", "1e-9"): "seconds 1e-09: expected 0.01 to 600 seconds at each depth",
              ("--seconds", "inf"): "seconds inf: expected 0.01 to 600 seconds at each depth",
              ("--seconds", "1e9"): "seconds 1000000000.0: expected 0.01 to 600 seconds at each depth",
              ("--depths", "100000"): "depths 100000: expected 1 to 1024 reads in flight",
              ("--depths", "0,4"): "depths 0, 4: expected 1 to 1024 reads in flight"}
    for (flag, value), message in bounds.items():  # issue 50, 8: a traceback, a run for ever, 12.5 GiB asked
        assert disk_command.main(probe_args(str(drive_dir), flag, value)) == 2
        assert capsys.readouterr().err == f"embbench disk: {message}\n"
    assert list(drive_dir.iterdir()) == [drive_dir / "file"]
