"""Scenarios: the YAML schema, validated up front, and its expansion into a matrix of cells.

A misspelled key, a wrong type, an unknown strategy or parameter is a
:class:`ScenarioError` naming the file and the key path, before anything runs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from embbench.bounds import THREADS_MAX, Config, PositiveCount, Rows, Seed, Threads
from embbench.data.criteo import NUM_TABLES
from embbench.data.presets import PRESETS, RENAMED_PRESETS, TableSpec
from embbench.inputs import read_text
from embbench.model import ModelConfig
from embbench.optim import DenseOptimizer, EmbeddingOptimizer
from embbench.precision import DENSE_PRECISIONS, DensePrecision
from embbench.row_precision import ROW_PRECISIONS, RowPrecision
from embbench.strategy import Strategy, get_strategy

__all__ = ["Cell", "Scenario", "cell_slug", "ScenarioError", "load_scenario", "parse_scenario", "read_scenario_text",
           "read_yaml", "validate_config"]


class ScenarioError(ValueError):
    """A scenario that cannot run; the message names the file and the key."""


_Strict = Config  # unknown keys, infinities and booleans for numbers refused (embbench.bounds)


class DriftConfig(_Strict):
    """Popularity drift of the synthetic data (the generator's ``drift_every``, ``drift_fraction``)."""

    every: int = Field(gt=0, description="batches between two changes of which ids are hot")
    fraction: float = Field(gt=0, le=1, description="share of each table's hot ids that change at each")


class CoAccessConfig(_Strict):
    """Samples drawn from latent entities, whose rows recur together (the generator's
    ``coaccess``, :class:`embbench.data.synthetic.CoAccess`)."""

    share: float = Field(gt=0, le=1, description="share of the samples that take all their ids from an entity")
    entities: int = Field(gt=0, description="how many entities there are")
    alpha: float = Field(1.15, ge=0, allow_inf_nan=False, description="Zipf exponent of entity popularity")


# The keys that belong to one data source only (the others must be left out).
_SOURCE_KEYS = {
    "synthetic": {"preset", "tables", "scale", "min_rows_per_table", "alpha", "drift", "coaccess"},
    "criteo_tsv": {"path", "format", "eval", "hash_size", "min_count", "epochs"},
    "trace": {"path", "epochs"},
}

def _key_error(key: str, message: str) -> PydanticCustomError:
    """An error of one key of a model, raised from a validator of the whole model (pydantic
    would name only the model); :func:`_format` appends the key to the path."""
    return PydanticCustomError("scenario_key", "{message}", {"key": key, "message": message})


class TableConfig(_Strict):
    """One table of a synthetic scenario that names its tables instead of a preset."""

    rows: Rows = Field(description="cardinality (before data.scale)")
    alpha: float | None = Field(None, ge=0, allow_inf_nan=False,
                                description="Zipf exponent of id popularity (data.alpha if left out)")
    bag_size: int = Field(1, gt=0, description="ids per sample")


class DataConfig(_Strict):
    """The data of a scenario: a synthetic preset, real Criteo files, or a recorded trace."""

    source: Literal["synthetic", "criteo_tsv", "trace"] = "synthetic"
    embedding_dim: int = Field(128, gt=0)
    batch_size: int = Field(16384, gt=0, description="global: split across the ranks")
    # synthetic
    preset: str = Field("criteo_kaggle", description=f"one of {', '.join(PRESETS)}")
    tables: list[TableConfig] | None = Field(
        None, min_length=1, description="the tables themselves (rows, alpha, bag_size each), in place of the preset")
    scale: float = Field(1.0, gt=0, le=1, description="multiplies every table's cardinality")
    min_rows_per_table: int = Field(
        1, ge=1, description="rows a table keeps however small the scale, never more than its own cardinality: "
                             "a scaled table stays larger than what one batch touches (1: the scale alone)")
    alpha: float | list[float] = Field(1.15, description="Zipf exponent of id popularity, or one per table")
    drift: DriftConfig | None = Field(None, description="which ids are hot changes every N batches")
    coaccess: CoAccessConfig | None = Field(
        None, description="a share of the samples drawn from entities whose rows recur together (none: every id "
                          "drawn on its own)")
    # criteo_tsv and trace
    path: str | None = Field(None, description="a file, a glob, or a directory of day_N files (plain or .gz); a trace .npz")
    format: Literal["kaggle", "terabyte"] = "kaggle"
    eval: float | str = Field(0.1, description="the fraction of the rows (the last ones) that evaluate, or evaluation files")
    hash_size: int | list[int] | None = Field(None, description="ids modulo this (one cap, or one per table)")
    min_count: int = Field(1, ge=1, description="training ids seen fewer times share one row per table")
    epochs: int = Field(1, ge=1, description="how many times a run may read the training rows")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value in RENAMED_PRESETS:
            raise ValueError(f"preset {value!r} was renamed: use {RENAMED_PRESETS[value]}")
        if value not in PRESETS:
            raise ValueError(f"unknown preset {value!r}; known: {', '.join(PRESETS)}")
        return value

    @field_validator("alpha", "hash_size")
    @classmethod
    def _per_table(cls, value, info):
        low = {"alpha": 0, "hash_size": 1}[info.field_name]
        items = value if isinstance(value, list) else [] if value is None else [value]
        if isinstance(value, list) and info.field_name == "alpha" and info.data.get("tables") is not None:
            raise ValueError("with data.tables, each table names its own alpha (data.alpha: one value for the others)")
        if isinstance(value, list) and len(value) != NUM_TABLES:
            raise ValueError(f"a list needs one value per table ({NUM_TABLES}), got {len(value)}")
        if any(not v >= low for v in items):  # also refuses nan
            raise ValueError(f"values must be >= {low}, got {value}")
        return value

    @field_validator("eval")
    @classmethod
    def _fraction_or_files(cls, value: float | str) -> float | str:
        if isinstance(value, float) and not 0 < value < 1:
            raise ValueError(f"a fraction must be in (0, 1), got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "DataConfig":
        # Compared with the defaults, not the keys given: a scenario passed on to the cells'
        # processes is written out with every key.
        foreign = {k for keys in _SOURCE_KEYS.values() for k in keys} - _SOURCE_KEYS[self.source]
        for key in sorted(k for k in foreign if getattr(self, k) != type(self).model_fields[k].default):
            owners = [s for s, keys in _SOURCE_KEYS.items() if key in keys]
            hint = " (--scale)" if key == "scale" else ""
            raise _key_error(key, f"only for source {' or '.join(owners)}, this data's source is {self.source}{hint}")
        if self.source != "synthetic" and not self.path:
            raise _key_error("path", f"source {self.source} needs a path")
        if self.tables is not None and self.preset != type(self).model_fields["preset"].default:
            raise _key_error("preset", "data.tables names the tables in place of a preset: give one or the other")
        return self


class OptimizerConfig(_Strict):
    embedding: EmbeddingOptimizer = EmbeddingOptimizer()
    dense: DenseOptimizer = DenseOptimizer()


#: Untimed training steps after the measurement: operator counting, then (with a profile) profiling.
OPS_STEPS = 2
PROFILE_STEPS = 3


class RunConfig(_Strict):
    world_size: PositiveCount | list[PositiveCount] = Field(1, description="ranks (processes) per cell; a list: a cell for each")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    warmup_steps: int = Field(5, ge=0, description="warm-up steps (the least, unless warmup_max_steps is null)")
    warmup_max_steps: Annotated[int, Field(ge=0)] | Literal["auto"] | None = Field(
        "auto", description="warm up until the cache is steady (its miss rate no longer falls and its empty slots "
                            "no longer fill), at most this many steps; auto: as many as are timed (repeats x "
                            "steps); null: exactly warmup_steps")
    steps: int = Field(20, gt=0, description="measured steps per repeat")
    repeats: int = Field(5, ge=1, description="timed windows of `steps` steps; each one's median step is one sample")
    eval_batches: int = Field(4, ge=0)
    seed: Seed = 0
    time_limit_s: float = Field(600, gt=0, description="per cell, build to evaluation")
    compare_weights: bool | Literal["auto"] = Field(
        "auto", description="save flushed weights and compare them with the baseline's ('auto': tables <= 256 MiB)"
    )
    threads: Threads | Literal["auto"] = Field(
        "auto", description="intra-op CPU threads per rank ('auto': the cores this process may use, CPU affinity "
                            "and cgroup quota, divided by the ranks, so ranks x threads never exceeds them)")
    dense_precision: DensePrecision = Field(
        "fp32", description="the dense model's arithmetic: fp32, tf32 (CUDA matmuls) or bf16 (autocast); embeddings stay fp32")

    deterministic: bool = Field(
        False, description="torch's deterministic algorithms: on CUDA, sums in a fixed order, so an exact strategy "
                           "trains bit for bit like the baseline; slower, for a correctness check, not a timing")

    sparse_backward: Literal["auto", "padded", "padded_torch", "unique"] = Field(
        "auto", description="how strategies that update rows themselves sum a batch's row gradients: padded (a fixed "
                            "shape, no host sync; on CUDA a kernel updates only the distinct rows), padded_torch (the "
                            "same shape, every entry updated by torch's scatters: the kernel's gain in one run), unique "
                            "(torch.unique: a host sync on CUDA) or auto (padded on CUDA, unique elsewhere)")

    row_precision: RowPrecision | list[RowPrecision] = Field(
        "fp32", description="the type embedding rows are stored in (device, cache, host): fp32, fp16, bf16 or fp8 "
                            "(E4M3, a float32 scale per row); a list: a cell for each")

    @field_validator("dense_precision", mode="before")
    @classmethod
    def _known_precision(cls, value: Any) -> Any:
        if value not in DENSE_PRECISIONS:
            raise ValueError(f"{value!r} is not one of {', '.join(DENSE_PRECISIONS)}")
        return value

    @field_validator("row_precision", mode="before")
    @classmethod
    def _known_row_precision(cls, value: Any) -> Any:
        items = value if isinstance(value, list) else [value]
        if not items or len(set(map(str, items))) != len(items):
            raise ValueError(f"needs one or more distinct values, got {value!r}")
        for item in items:
            if item not in ROW_PRECISIONS:
                raise ValueError(f"{item!r} is not one of {', '.join(ROW_PRECISIONS)}")
        return value

    @field_validator("world_size", mode="before")  # before the type check: one message, not one per type
    @classmethod
    def _at_least_one_rank(cls, value: Any) -> Any:
        sizes = value if isinstance(value, list) else [value]
        if not sizes or any(isinstance(w, int) and not isinstance(w, bool) and w < 1 for w in sizes):
            raise ValueError(f"must be at least 1 (or a non-empty list of such), got {value}")
        return value

    @field_validator("threads", mode="before")
    @classmethod
    def _at_least_one_thread(cls, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, int) and not 1 <= value <= THREADS_MAX):
            raise ValueError(f"must be 'auto' or from 1 to {THREADS_MAX}, got {value!r}")
        return value

    def threads_per_rank(self, world_size: int) -> int:
        """The intra-op threads each of ``world_size`` ranks runs with on this machine."""
        if self.threads != "auto":
            return self.threads
        from embbench.noise import usable_cores

        return max(1, usable_cores()[0] // world_size)

    @model_validator(mode="after")
    def _warmup_range(self) -> "RunConfig":
        if isinstance(self.warmup_max_steps, int) and self.warmup_max_steps < self.warmup_steps:
            raise _key_error("warmup_max_steps", f"{self.warmup_max_steps} is below warmup_steps ({self.warmup_steps}): "
                             "the warm-up runs at least warmup_steps and at most warmup_max_steps")
        return self

    @property
    def warmup_bound(self) -> int:
        """The most warm-up steps a cell may run."""
        bound = self.repeats * self.steps if self.warmup_max_steps == "auto" else self.warmup_max_steps or 0
        return max(self.warmup_steps, bound)

    @property
    def world_sizes(self) -> list[int]:
        return self.world_size if isinstance(self.world_size, list) else [self.world_size]

    @property
    def row_precisions(self) -> list[str]:
        return self.row_precision if isinstance(self.row_precision, list) else [self.row_precision]

    @property
    def counted_steps(self) -> int:
        """The steps after the timed ones whose counters the record reports, every instrument on
        (one repeat's length: embbench.runner._counted_steps)."""
        return self.steps

    def training_batches_read(self, profile: bool = True) -> int:
        """How many training batches a cell reads: the longest warm-up, every measured step, the
        counted steps, the untimed steps that count operators (and profile), and the batch the
        last step prefetches."""
        return (self.warmup_bound + self.repeats * self.steps + self.counted_steps + OPS_STEPS
                + (PROFILE_STEPS if profile else 0) + 1)


class StrategyEntry(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class Scenario(_Strict):
    name: str
    description: str = ""
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    run: RunConfig = RunConfig()
    baseline: str
    strategies: list[StrategyEntry] = Field(min_length=1)

    def tables(self) -> list[TableSpec]:
        """The tables: a preset's (synthetic), or counted from the files or the trace (cached)."""
        from embbench.data.sources import source_tables

        return source_tables(self.data)

    def data_source(self, device: torch.device | str, batches: tuple[int, int] | None = None):
        """The batch source (``.batch(stream, index, batch_size)``); for files, after checking
        that they hold the rows the run reads (``batches``: the training and evaluation
        batches another reader takes)."""
        from embbench.data.sources import open_source

        return open_source(self.data, self.run, device, batches)

    def digest(self) -> str:
        """A hash of the effective scenario (after command-line overrides): what a cell's
        measurement depends on. The strategy list is left out (each cell names its strategy and
        parameters), so adding a cell to a scenario keeps the cells already measured comparable
        and reusable (``--resume``), as ``recommend``'s "add this ratio, then run" suggests.
        ``run.row_precision`` is left out for the same reason (each cell names its own), which
        also keeps the digests of scenarios written before it existed; ``run.deterministic`` is
        left out where it is off, and ``run.sparse_backward`` where it is ``auto``, for the same reason."""
        run_excluded = ({"row_precision"} | (set() if self.run.deterministic else {"deterministic"})
                        | (set() if self.run.sparse_backward != "auto" else {"sparse_backward"}))
        config = self.model_dump(mode="json", exclude={"strategies": True, "run": run_excluded})
        canonical = json.dumps(config, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def weights_compared(self) -> bool:
        if self.run.compare_weights == "auto":
            return sum(t.num_bytes for t in self.tables()) <= 256 << 20
        return bool(self.run.compare_weights)


#: A cell id whose file name is the id itself, its brackets as ``_`` (as every release wrote it).
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.-]+(\[[A-Za-z0-9_.=,-]*\])?@w[0-9]+(@(fp16|bf16|fp8))?")
#: Longest file name a slug makes (most file systems allow 255 bytes; ``.rank0.log`` and the
#: temporary file's affixes go around it).
_MAX_SLUG = 200


def cell_slug(cell_id: str) -> str:
    """A cell id as a file name (its record is ``<slug>.json``), one per id.

    A plain id (letters, digits and ``_.-=,`` in its name and parameters, and a row precision
    suffix such as ``@fp16``) keeps the name runs
    have always had: the id with its brackets as ``_``. Any other id (a space, a slash, a
    non-ASCII letter in a parameter) is shortened to those characters and gets ``~`` and a
    hash of the whole id, so ids that differ only in what the name drops get two files (no
    plain slug holds a ``~``). Two ids that still meet in one name are refused
    (:func:`parse_scenario`, :func:`embbench.results.write_record`)."""
    shown = "".join(c if c.isascii() and (c.isalnum() or c in "-_.=@,") else "_" for c in cell_id)
    if _PLAIN_ID.fullmatch(cell_id) and len(shown) <= _MAX_SLUG:
        return shown
    return f"{shown[:_MAX_SLUG - 13]}~{hashlib.sha256(cell_id.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Cell:
    """One measurement: a strategy with concrete parameters at one world size and row precision."""

    strategy: str
    params: dict[str, Any] = field(default_factory=dict, hash=False)
    world_size: int = 1
    row_precision: str = "fp32"

    @property
    def id(self) -> str:
        """``strategy[params]@w<ranks>``, then ``@<precision>`` unless fp32 (fp32 ids are those
        of records made before row precision existed)."""
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        base = f"{self.strategy}[{inner}]@w{self.world_size}" if inner else f"{self.strategy}@w{self.world_size}"
        return base if self.row_precision == "fp32" else f"{base}@{self.row_precision}"

    @property
    def slug(self) -> str:
        """The id as a file name."""
        return cell_slug(self.id)

    def strategy_class(self) -> type[Strategy]:
        return get_strategy(self.strategy)

    def make_strategy(self) -> Strategy:
        cls = self.strategy_class()
        return cls(cls.Params(**self.params))


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# The member of a union pydantic tried, which it puts in an error's path ("data.alpha.float").
_UNION_TAGS = ("int", "float", "str", "bool", "list[int]", "list[float]", "literal['auto']", "constrained-int",
               "list[constrained-int]")


def _format(errors: list[dict], file: str, prefix: str = "") -> str:
    lines = []
    for e in errors:
        key = _loc(tuple(p for p in e["loc"] if p not in _UNION_TAGS))
        if e["type"] == "scenario_key":
            key = f"{key}.{e['ctx']['key']}" if key else e["ctx"]["key"]
        key = f"{prefix}.{key}" if prefix and key else (prefix or key)
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        lines.append(f"{file}: {key}: {msg}" if key else f"{file}: {msg}")
    return "\n".join(lines)


def _expand(entry: StrategyEntry, index: int, file: str) -> list[dict[str, Any]]:
    where = f"strategies[{index}]"
    try:
        cls = get_strategy(entry.name)
    except KeyError as e:  # unknown or broken: the message says which
        raise ScenarioError(f"{file}: {where}.name: {e.args[0]}") from None
    fields = cls.Params.model_fields
    axes: list[list[tuple[str, Any]]] = []
    for key, value in entry.params.items():
        if key not in fields:
            raise ScenarioError(
                f"{file}: {where}.params.{key}: unknown parameter of {entry.name} "
                f"(known: {', '.join(fields) or 'none'})"
            )
        is_list_param = typing.get_origin(fields[key].annotation) in (list, tuple)
        values = value if isinstance(value, list) and not is_list_param else [value]
        if not values:
            raise ScenarioError(f"{file}: {where}.params.{key}: empty list")
        axes.append([(key, v) for v in values])
    combos = [dict(c) for c in itertools.product(*axes)]
    for combo in combos:
        try:
            cls.Params(**combo)
        except ValidationError as e:
            raise ScenarioError(_format(e.errors(), file, f"{where}.params")) from None
    return combos


def parse_scenario(raw: Any, file: str = "<scenario>") -> tuple[Scenario, list[Cell]]:
    """Validate a scenario mapping and expand it into cells (the baseline's first)."""
    scenario = validate_config(Scenario, raw, file, "scenario")
    if scenario.model.bottom_mlp[-1] != scenario.data.embedding_dim:
        # DLRM takes dot products of the bottom MLP's output with every pooled embedding; DCNv2
        # crosses them as equal-width parts of one vector (as MLPerf's does).
        raise ScenarioError(f"{file}: model.bottom_mlp: must end in data.embedding_dim "
                            f"{scenario.data.embedding_dim}, got {scenario.model.bottom_mlp}")
    names = [s.name for s in scenario.strategies]
    if scenario.baseline not in names:
        raise ScenarioError(f"{file}: baseline: {scenario.baseline!r} is not among the strategies {names}")
    cells = []
    for index, entry in enumerate(scenario.strategies):
        for params in _expand(entry, index, file):
            for world in scenario.run.world_sizes:
                for precision in sorted(scenario.run.row_precisions, key=lambda p: p != "fp32"):  # fp32 first: the others compare with it
                    cells.append(Cell(entry.name, params, world, precision))
    cells.sort(key=lambda c: c.strategy != scenario.baseline)
    ids = [c.id for c in cells]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ScenarioError(f"{file}: strategies: the same cell appears twice: {', '.join(duplicates)}")
    slugs: dict[str, str] = {}
    for cell in cells:
        other = slugs.setdefault(cell.slug, cell.id)
        if other != cell.id:
            raise ScenarioError(f"{file}: strategies: cells {other} and {cell.id} would share the record file "
                                f"{cell.slug}.json; rename a strategy or a parameter value")
    return scenario, cells


#: A scenario is a few kilobytes; anything far larger is not one (and /dev/zero never ends).
MAX_SCENARIO_BYTES = 1 << 20


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (YAML says keys are unique;
    PyYAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark)
            except TypeError:  # an unhashable key: the base class reports it
                break
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_scenario_text(path: Path) -> str:
    """The text of a scenario file: a regular, readable UTF-8 file of bounded size
    (:func:`embbench.inputs.read_text`).

    Raises:
        ScenarioError: naming the file and what is wrong with it.
    """
    return read_text(path, "scenario", MAX_SCENARIO_BYTES, ScenarioError)


def read_yaml(path: Path) -> Any:
    """A scenario-like YAML file, parsed (:func:`read_scenario_text`; a key given twice refused).

    Raises:
        ScenarioError: naming the file, and the line of invalid YAML.
    """
    text = read_scenario_text(path)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ScenarioError(f"{path}: {where}invalid YAML: {getattr(e, 'problem', e)}") from None


def validate_config(model: type[Config], raw: Any, file: str, what: str) -> Any:
    """``raw`` as ``model``, or a :class:`ScenarioError` naming the file and each key (``what``: a
    scenario, a sweep)."""
    if not isinstance(raw, dict):
        raise ScenarioError(f"{file}: a {what} is a mapping of keys, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ScenarioError(_format(e.errors(), file)) from None


def load_scenario(
    path: str | Path,
    steps: int | None = None,
    scale: float | None = None,
    strategies: list[str] | None = None,
    batch_size: int | None = None,
    embedding_dim: int | None = None,
) -> tuple[Scenario, list[Cell]]:
    """Read, override (command-line flags), validate and expand a scenario file. With
    ``embedding_dim``, the bottom MLP's last layer follows it (DLRM and DCNv2 need the two equal)."""
    path = Path(path)
    raw = read_yaml(path)
    overrides = {("run", "steps"): steps, ("data", "scale"): scale, ("data", "batch_size"): batch_size,
                 ("data", "embedding_dim"): embedding_dim}
    if isinstance(raw, dict):
        # Overrides go into the sections; a section that is not a mapping fails validation, named.
        for (section, key), value in overrides.items():
            if value is not None and isinstance(raw.setdefault(section, {}), dict):
                raw[section][key] = value
        model = raw.get("model", {})
        if embedding_dim is not None and isinstance(model, dict):
            bottom = model.get("bottom_mlp", ModelConfig.model_fields["bottom_mlp"].get_default(call_default_factory=True))
            if isinstance(bottom, list) and bottom:
                raw["model"] = {**model, "bottom_mlp": [*bottom[:-1], embedding_dim]}
    scenario, cells = parse_scenario(raw, str(path))
    if strategies:
        unknown = set(strategies) - {c.strategy for c in cells}
        if unknown:
            raise ScenarioError(f"--strategies: {', '.join(sorted(unknown))} not in {path}")
        cells = [c for c in cells if c.strategy in strategies]
    return scenario, cells
