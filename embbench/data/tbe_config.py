"""fbgemm's TBE input reports as a synthetic ``data:`` section.

With ``FBGEMM_REPORT_INPUT_PARAMS_INTERVAL`` set, fbgemm's training TBE writes, every that many
iterations, a JSON file ``tbe-<op>-config-estimation-<iteration>.json``: its
``TBEDataConfig`` (fbgemm_gpu/tbe/bench/tbe_data_config.py): the tables (``T``, ``Es``,
``Ds``), the batch (``batch_params.B``), the bag lengths (``pooling_params.L``, ``Ls``) and
a fit of the ids (``indices_params``, and one per table in ``indices_params_list``): the
heavy hitters' probabilities and a Zipf ``(x + q)^-s``. These reports hold no ids: the
section built here draws ids from embbench's generator with each table's Zipf exponent ``s``
(which is what embbench's ``alpha`` is); ``q`` and the heavy hitters are not reproduced
(:data:`NOT_REPRODUCED`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from embbench.bounds import Finite, Positive, PositiveCount, Rows
from embbench.inputs import read_json, validated

__all__ = ["NOT_REPRODUCED", "TbeReport", "read_tbe_report", "synthetic_data"]

NOT_REPRODUCED = ("fbgemm's Zipf offset q and its heavy hitters are not reproduced: embbench draws each table's ids "
                  "from a Zipf of exponent s over ranks")


# The bounds of a scenario's data section (embbench.bounds), each list item's too: a report
# that passes makes a section that `run` takes.


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Indices(_Fields):
    heavy_hitters: list[Finite] = []
    zipf_q: Positive
    zipf_s: Positive


class _Batch(_Fields):
    B: PositiveCount


class _Pooling(_Fields):
    L: Positive
    Ls: list[Positive] | None = None


class TbeReport(_Fields):
    """The fields of fbgemm's ``TBEDataConfig`` JSON that a synthetic section needs."""

    T: PositiveCount
    E: Rows
    D: PositiveCount
    batch_params: _Batch
    indices_params: _Indices
    pooling_params: _Pooling
    Es: list[Rows] | None = None
    Ds: list[PositiveCount] | None = None
    indices_params_list: list[_Indices] | None = None


def read_tbe_report(path: str | Path) -> TbeReport:
    """One report, read as every user file is (:mod:`embbench.inputs`); ValueError naming the
    file and the key where it is damaged."""
    path = Path(path)
    report = validated(TbeReport, read_json(path, "TBE input report"), path,
                       hint=" (not an fbgemm TBE input report?)")
    for key in ("Es", "Ds", "indices_params_list"):
        values = getattr(report, key)
        if values is not None and len(values) != report.T:
            raise ValueError(f"{path}: {key} has {len(values)} entries for T = {report.T} tables")
    if report.pooling_params.Ls is not None and len(report.pooling_params.Ls) != report.T:
        raise ValueError(f"{path}: pooling_params.Ls has {len(report.pooling_params.Ls)} entries for T = {report.T} tables")
    return report


def synthetic_data(report: TbeReport) -> dict:
    """A scenario ``data:`` section for the report's tables, batch and skew."""
    rows = report.Es or [report.E] * report.T
    fits = report.indices_params_list or [report.indices_params] * report.T
    bags = report.pooling_params.Ls or [report.pooling_params.L] * report.T
    dims = set(report.Ds or [report.D])
    if len(dims) != 1:
        raise ValueError(f"the tables have dims {sorted(dims)}; embbench's tables share one dim")
    return {"source": "synthetic", "embedding_dim": dims.pop(), "batch_size": report.batch_params.B,
            "tables": [{"rows": r, "alpha": round(f.zipf_s, 4), "bag_size": max(1, round(b))}
                       for r, f, b in zip(rows, fits, bags)]}
