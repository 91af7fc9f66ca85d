"""The bounds of the numbers a scenario gives and a record holds: one definition for both.

:class:`Config` is the base of every section of a scenario (and of a strategy's parameters
and the policy sweep's file): unknown keys refused, no infinity or NaN (JSON has none, so a
record could not hold the scenario it ran), and no boolean where a number is meant (``true``
is not read as 1). The annotated types are the bounds that the scenario's fields and the
record's share; :func:`positive_flag` is the bound of a command-line number.
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["CURVE_MAX_BATCHES", "THREADS_MAX", "Bytes", "Config", "Count", "Finite", "NonNegative", "Positive", "PositiveCount", "Rate", "Rows", "Seed", "Threads", "positive_flag"]

# Strict: a string or a bool is not a number.
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)]
Positive = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0)]
Rate = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=1)]
Count = Annotated[int, Field(strict=True, ge=0)]
PositiveCount = Annotated[int, Field(strict=True, gt=0)]
Bytes = Count
#: A table's rows: its ids are int64 (torch's indices), so it holds fewer than 2^63.
Rows = Annotated[int, Field(strict=True, gt=0, lt=1 << 63)]
#: Intra-op threads per rank (``run.threads``): torch takes a C int, and no machine has more cores.
THREADS_MAX = 4096
Threads = Annotated[int, Field(strict=True, ge=1, le=THREADS_MAX)]
#: Batches a cache curve holds in memory, each of its flags (``curve --warmup``, ``--steps``): a
#: Criteo-Kaggle batch of 16384 samples is 3.4 MB of ids, so 10,000 batches are 34 GB.
CURVE_MAX_BATCHES = 10_000
#: What torch's generators take (``torch.manual_seed``: 64 bits, unsigned).
Seed = Annotated[int, Field(strict=True, ge=0, lt=1 << 64)]


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a bool (``bool``, ``Any``, or a union or literal with one)."""
    if annotation is bool or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _admits_bool(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return any(_admits_bool(a) for a in typing.get_args(annotation))
    return False


class Config(BaseModel):
    """A section of a scenario, validated as a whole: see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        # pydantic reads true as 1 for an int (lax mode); YAML's true is never meant as a count
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if isinstance(value, bool) and field is not None and not _admits_bool(field.annotation):
                    raise PydanticCustomError("scenario_key", "{message}",
                                              {"key": key, "message": f"{str(value).lower()} is a boolean, not a number"})
        return data


def positive_flag(kind: type, zero: bool = False, at_most: float | None = None):
    """An argparse type: a finite number of ``kind`` above zero (at least zero with ``zero``),
    and at most ``at_most`` if given. Every numeric flag (embbench's and its scripts') goes
    through it, so an empty, NaN, infinite or out-of-range value is refused with the flag
    named (argparse names it)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value >= 0 if zero else value > 0):  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {'at least' if zero else 'above'} 0, got {text}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse
