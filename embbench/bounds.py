"""The bounds of the numbers a scenario gives and a record holds: one definition for both.

:class:`Config` is the base of every section of a scenario (and of a strategy's parameters
and the policy sweep's file): unknown keys refused, no infinity or NaN (JSON has none, so a
record could not hold the scenario it ran), and no boolean where a number is meant (``true``
is not read as 1). The annotated types are the bounds that the scenario's fields and the
record's share.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["Bytes", "Config", "Count", "Finite", "NonNegative", "Positive", "PositiveCount", "Rate", "Rows", "Seed"]

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
