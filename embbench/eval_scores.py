"""A cell's evaluation scores beside its record (``<run>/eval/<cell>.npz``): each held-out
sample's score and label, so that ``recommend`` compares two cells' AUCs on the same samples
(DeLong's test). Written by the launcher, read as a record is read: checked (issue 50)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from embbench.inputs import not_regular
from embbench.outputs import atomic_write
from embbench.results import EVAL_DIR, RecordError

__all__ = ["MAX_EVAL_BYTES", "read_eval_scores", "write_eval_scores"]


def write_eval_scores(path: Path, scores: list[float], labels: list[int]) -> Path:
    """A cell's evaluation scores (logits) and labels, for tests of AUCs on the same samples."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: np.savez_compressed(f, scores=np.asarray(scores, dtype=np.float32),
                                                             labels=np.asarray(labels, dtype=np.uint8)))


#: The largest eval file read (compressed) and the largest array in it (uncompressed) when the
#: record does not say how many samples it scored: 90M samples (a Criteo day) as float32.
MAX_EVAL_BYTES = 512 << 20


def read_eval_scores(run_dir: Path, name: str, samples: int | None = None) -> tuple[Any, Any]:
    """(scores, labels) of the eval file a record names (``accuracy.eval_file``), read as a record
    is: a regular file in the run's ``eval/`` folder (a name, never a path out of it), of bounded
    size (``samples``: the count the record says it scored, which its arrays must hold), a float
    score and a 0/1 label a sample, both classes present. A RecordError naming the file and what
    is wrong otherwise."""
    import zipfile

    import numpy as np

    folder = Path(run_dir) / EVAL_DIR
    path = folder / str(name)
    if not isinstance(name, str) or not name or name != Path(name).name or name.startswith(".") \
            or not name.endswith(".npz"):
        raise RecordError(f"{path}: an eval file is named by a file name in {folder} (NAME.npz), not {name!r}")
    limit = MAX_EVAL_BYTES if samples is None else 8 * samples + 4096
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RecordError(f"{path}: evaluation scores missing or unreadable "
                          f"({not_regular(path) or e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        kind = not_regular(path, info.st_mode)
        if kind or info.st_size > MAX_EVAL_BYTES:
            raise RecordError(f"{path}: evaluation scores: " + (kind or f"{info.st_size:,} bytes, at most {MAX_EVAL_BYTES:,}"))
        try:
            with zipfile.ZipFile(f) as archive:
                sizes = {member.filename: member.file_size for member in archive.infolist()}
                if sorted(sizes) != ["labels.npy", "scores.npy"]:
                    raise ValueError(f"holds {sorted(sizes)}, expected labels.npy and scores.npy")
                large = [n for n, size in sizes.items() if size > limit]
                if large:
                    raise ValueError(f"{large[0]} unpacks to {sizes[large[0]]:,} bytes, more than "
                                     + (f"{samples:,} samples take" if samples is not None else f"{limit:,}"))
            f.seek(0)
            with np.load(f, allow_pickle=False) as data:
                scores, labels = data["scores"], data["labels"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, MemoryError) as e:
            raise RecordError(f"{path}: evaluation scores damaged ({type(e).__name__}: {e})") from None
    problem = _eval_problem(scores, labels, samples)
    if problem:
        raise RecordError(f"{path}: evaluation scores: {problem}")
    return scores, labels


def _eval_problem(scores: Any, labels: Any, samples: int | None) -> str | None:
    import numpy as np

    if scores.ndim != 1 or labels.ndim != 1 or scores.dtype.kind != "f" or labels.dtype.kind not in "uib":
        return f"scores {scores.dtype} {scores.shape} and labels {labels.dtype} {labels.shape}: expected 1-D floats and integers"
    if len(scores) != len(labels) or (samples is not None and len(scores) != samples):
        return f"{len(scores):,} scores, {len(labels):,} labels" + (f", the record {samples:,} samples" if samples else "")
    if not np.isfinite(scores).all():
        return f"{int((~np.isfinite(scores)).sum()):,} scores are not finite numbers"
    if not np.isin(labels, (0, 1)).all():
        return "labels other than 0 and 1"
    if len(np.unique(labels)) < 2:
        return "labels of one class only: no AUC"
    return None
