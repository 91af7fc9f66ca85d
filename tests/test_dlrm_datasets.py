"""Meta's dlrm_datasets batches (.pt files of (indices, offsets, lengths)), written here in that
format, read into an embbench trace; damaged files refused by name."""

import numpy as np
import pytest
import torch

from embbench.data.dlrm_datasets import NOT_OVER_TIME, dlrm_to_trace, read_dlrm_batch
from embbench.data.trace import Trace, TraceError, TraceSource
from embbench.data import Stream


def _batch(tables: int = 3, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (tables, batch), generator=g)
    indices = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths.reshape(-1), 0)])
    return indices, offsets, lengths


def test_batches_become_a_trace_with_the_same_bags(tmp_path):
    files = []
    for i in range(2):
        files.append(tmp_path / f"batch{i}.pt")
        torch.save(_batch(seed=i), files[-1])
    info = dlrm_to_trace(files, tmp_path / "t.npz")
    assert info["samples"] == 8 and info["note"] == NOT_OVER_TIME
    trace = Trace(tmp_path / "t.npz")
    batch = TraceSource(trace, seed=0).batch(Stream.TRAIN, 1, 4).sparse  # the second file's batch
    indices, offsets, lengths = _batch(seed=1)
    assert torch.equal(batch.lengths, lengths.reshape(-1)) and torch.equal(batch.values, indices)
    # A table has as many rows as its largest index + 1 (the files do not say).
    per_table = [torch.split(_batch(seed=s)[0], _batch(seed=s)[2].sum(1).tolist()) for s in (0, 1)]
    assert trace.num_rows.tolist() == [max(int(parts[t].max()) for parts in per_table) + 1 for t in range(3)]


@pytest.mark.parametrize("damage, message", [
    (lambda i, o, ln: (i, o), "expected a tuple of 3 tensors (indices, offsets, lengths), got tuple of 2"),
    (lambda i, o, ln: (i.float(), o, ln), "indices holds torch.float32; expected integers"),
    (lambda i, o, ln: (i, o, ln.reshape(-1)), "lengths has shape [12]; expected 2 dimensions"),
    (lambda i, o, ln: (i, o[:-1], ln), "offsets has 12 entries; lengths [3, 4] needs 13"),
    (lambda i, o, ln: (i[:-1], o, ln), "offsets run from 0 to"),
    (lambda i, o, ln: (i, o, ln + torch.eye(3, 4, dtype=torch.long)), "bag 0 (table 0, sample 0) has"),
    (lambda i, o, ln: (i - 100, o, ln), "is negative"),
])
def test_damaged_batches_are_refused_naming_the_file(tmp_path, damage, message):
    path = tmp_path / "bad.pt"
    torch.save(damage(*_batch()), path)
    with pytest.raises(TraceError, match=f"{path}: .*" + message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        read_dlrm_batch(path)


def test_a_file_that_is_not_a_torch_file_is_refused(tmp_path):
    path = tmp_path / "bad.pt"
    path.write_bytes(b"not a zip")
    with pytest.raises(TraceError, match=f"{path}: not a readable torch file"):
        read_dlrm_batch(path)
    good = tmp_path / "good.pt"
    torch.save(_batch(), good)
    good.write_bytes(good.read_bytes()[:200])  # truncated
    with pytest.raises(TraceError, match=f"{good}: not a readable torch file"):
        read_dlrm_batch(good)


def test_import_command_writes_the_trace_and_says_what_it_cannot_measure(tmp_path, capsys):
    from embbench.cli import main

    path = tmp_path / "batch.pt"
    torch.save(_batch(), path)
    assert main(["trace", "import-dlrm", str(path), "--out", str(tmp_path / "t.npz")]) == 0
    out = capsys.readouterr().out
    assert "1 batches, 4 training samples of 3 tables" in out and "not eviction over time" in " ".join(out.split())
    bad = tmp_path / "bad.pt"
    torch.save(_batch()[:2], bad)
    assert main(["trace", "import-dlrm", str(bad), "--out", str(tmp_path / "u.npz")]) == 2
    assert f"{bad}: expected a tuple of 3 tensors" in capsys.readouterr().err
