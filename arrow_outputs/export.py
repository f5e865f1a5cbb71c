"""Runs exported to a partitioned dataset (Parquet or Arrow IPC) for Spark, Ray Data, DuckDB,
Polars and ``pyarrow.dataset``.

An export directory holds three tables, each a hive-partitioned dataset (``run=<name>``
directories, and optionally ``step_block=<k>`` below them)::

    out/rows/run=<name>/...   one row per request and step: the format's columns + step_index
    out/steps/run=<name>/...  one row per step: step_index, step, rows, step_json
    out/runs/run=<name>/...   one row per run: source, steps, rows, complete, schema_metadata,
                              arrow_schema

The per-request columns are plain Arrow (lists, structs, the fixed-shape tensor extension),
which every engine reads. What a column cannot say travels in the step's JSON (the
``arrow_outputs.step`` IPC custom metadata of a run file), kept verbatim in ``steps``, so
:func:`iter_exported_outputs` rebuilds every ``ModelRunnerOutput`` exactly. A run appears
whole or not at all: it is written into a staging directory (``_staging-*``, which dataset
readers skip) and moved into place, ``runs`` last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ._checks import describe
from .batch import from_record_batch, step_metadata
from .errors import (
    ConsistencyError,
    FieldTypeError,
    SchemaMismatchError,
    UnsupportedValueError,
)
from .reader import open_run
from .schema import KEY_STEP, column_types

__all__ = [
    "ExportedRun",
    "check_run_name",
    "export_dataset",
    "iter_exported_outputs",
    "open_exported",
]

#: Run names: a letter or digit, then letters, digits, ``.``, ``_`` or ``-``; 128 at most.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TABLES = ("rows", "steps", "runs")
FORMATS = {"parquet": "parquet", "ipc": "arrow"}  # format -> file extension
PARTITIONS = ("run", "step_block")
_RUN_SUFFIXES = (".arrows", ".arrow", ".ipc", ".feather")

STEPS_SCHEMA = pa.schema(
    [
        pa.field("step_index", pa.int64(), nullable=False),
        pa.field("step", pa.int64()),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("step_json", pa.string(), nullable=False),
    ]
)
RUNS_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("steps", pa.int64(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("complete", pa.bool_(), nullable=False),
        pa.field("schema_metadata", pa.string(), nullable=False),
        pa.field("arrow_schema", pa.binary(), nullable=False),
    ]
)


def check_run_name(name: Any) -> str:
    """A run name, checked: it becomes a file or directory name, so no path is possible.

    Parameters
    ----------
    name
        ``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128 characters.

    Examples
    --------
    >>> check_run_name("llama-8b.eval_3")
    'llama-8b.eval_3'
    >>> check_run_name("../etc/passwd")
    Traceback (most recent call last):
    ...
    arrow_outputs.errors.UnsupportedValueError: run: expected a run name of 1 to 128 characters \
from [A-Za-z0-9._-] starting with a letter or digit, got '../etc/passwd'
    """
    if not isinstance(name, str):
        raise FieldTypeError("run", "a str run name", describe(name))
    if RUN_NAME.fullmatch(name) is None:
        shown = repr(name) if len(name) <= 60 else repr(name[:57]) + "..."
        raise UnsupportedValueError(
            "run",
            "a run name of 1 to 128 characters from [A-Za-z0-9._-] starting with a letter or digit",
            shown,
        )
    return name


@dataclass(frozen=True)
class ExportedRun:
    """One exported run: its name, source file, steps and rows, and whether the source was a
    complete run (a cut run is exported up to its last whole step only if it opens)."""

    name: str
    source: str
    steps: int
    rows: int
    complete: bool


def _sources(sources: Any) -> list[tuple[str, str]]:
    """(run name, path) pairs from a path, paths, or a mapping of run name -> path."""
    if isinstance(sources, (str, os.PathLike)):
        items: list[tuple[Any, Any]] = [(None, sources)]
    elif isinstance(sources, Mapping):
        items = list(sources.items())
    elif isinstance(sources, Iterable):
        items = [(None, s) for s in sources]
    else:
        raise FieldTypeError(
            "sources", "a path, an iterable of paths, or a mapping run -> path", describe(sources)
        )
    out: list[tuple[str, str]] = []
    for name, path in items:
        if not isinstance(path, (str, os.PathLike)):
            raise FieldTypeError("sources", "paths of run files", describe(path))
        path = os.fspath(path)
        if name is None:
            name = Path(path).name
            for suffix in _RUN_SUFFIXES:
                if name.endswith(suffix) and len(name) > len(suffix):
                    name = name[: -len(suffix)]
                    break
        out.append((check_run_name(name), path))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConsistencyError("sources", "one source per run name", f"{dup!r} twice")
    if not out:
        raise FieldTypeError("sources", "at least one run file", "none")
    return out


def _check_options(
    format: Any, partitioning: Any, step_block_size: Any, compression: Any
) -> tuple[str, ...]:
    if format not in FORMATS:
        raise FieldTypeError("format", "'parquet' or 'ipc'", repr(format)[:60])
    if isinstance(partitioning, str) or not isinstance(partitioning, (tuple, list)):
        raise FieldTypeError("partitioning", "a tuple of partition names", describe(partitioning))
    parts = tuple(partitioning)
    if parts not in (("run",), ("run", "step_block")):
        raise UnsupportedValueError(
            "partitioning", "('run',) or ('run', 'step_block')", repr(parts)[:80]
        )
    if type(step_block_size) is not int or step_block_size < 1:
        raise FieldTypeError("step_block_size", "an int >= 1", describe(step_block_size))
    allowed = (None, "lz4", "zstd") if format == "ipc" else (None, "snappy", "zstd", "gzip", "lz4")
    if compression not in allowed:
        raise FieldTypeError(
            "compression", " or ".join(map(repr, allowed)) + f" for {format}", repr(compression)
        )
    return parts


def export_dataset(
    sources: Any,
    out_dir: str | os.PathLike[str],
    *,
    format: str = "parquet",
    partitioning: tuple[str, ...] = ("run",),
    step_block_size: int = 10_000,
    compression: str | None = "zstd",
    max_rows_per_file: int = 1 << 22,
    max_rows_per_group: int = 1 << 16,
    validate: bool = True,
) -> list[ExportedRun]:
    """Export runs to a partitioned dataset under ``out_dir`` (created, or added to).

    Parameters
    ----------
    sources
        A run file's path, an iterable of paths (the run name is the file name without
        ``.arrows``/``.arrow``), or a mapping of run name -> path. Run names must pass
        :func:`check_run_name`; a run already in ``out_dir`` is refused.
    out_dir
        The export directory: ``rows/``, ``steps/`` and ``runs/`` datasets (module docs).
    format
        ``"parquet"`` (default) or ``"ipc"`` (Arrow IPC files, the Feather v2 format).
    partitioning
        ``("run",)`` (default), or ``("run", "step_block")`` to split a long run's rows and
        steps into ``step_block=<step_index // step_block_size>`` directories.
    step_block_size
        Steps per ``step_block`` partition.
    compression
        Parquet: ``"zstd"`` (default), ``"snappy"``, ``"gzip"``, ``"lz4"`` or None; IPC:
        ``"zstd"``, ``"lz4"`` or None.
    max_rows_per_file, max_rows_per_group
        Passed to :func:`pyarrow.dataset.write_dataset`.
    validate
        Validate every source batch in full (files are untrusted); ``False`` for trusted
        files.

    Returns
    -------
    list of ExportedRun
        One per source, in order.

    Examples
    --------
    >>> import tempfile, arrow_outputs as ao
    >>> from arrow_outputs.export import export_dataset
    >>> tmp = tempfile.mkdtemp()
    >>> with ao.OutputWriter(f"{tmp}/run-1.arrows") as writer:
    ...     writer.write(ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[5], [6]]))
    >>> (run,) = export_dataset([f"{tmp}/run-1.arrows"], f"{tmp}/out")
    >>> run.name, run.steps, run.rows, run.complete
    ('run-1', 1, 2, True)
    """
    parts = _check_options(format, partitioning, step_block_size, compression)
    runs = _sources(sources)
    for name, value in (
        ("max_rows_per_file", max_rows_per_file),
        ("max_rows_per_group", max_rows_per_group),
    ):
        if type(value) is not int or value < 1:
            raise FieldTypeError(name, "an int >= 1", describe(value))
    if max_rows_per_group > max_rows_per_file:
        max_rows_per_group = max_rows_per_file
    out = Path(out_dir)
    for name, _ in runs:
        for table in TABLES:
            if (out / table / f"run={name}").exists():
                raise ConsistencyError(
                    "sources",
                    f"run names not yet exported to {out}",
                    f"{name!r}, which is there (delete {out}/*/run={name} to export it again)",
                )
    out.mkdir(parents=True, exist_ok=True)
    file_format = ds.ParquetFileFormat() if format == "parquet" else ds.IpcFileFormat()
    options = file_format.make_write_options(compression=compression)
    done = []
    for name, path in runs:
        staging = out / f"_staging-{uuid.uuid4().hex}"
        try:
            exported = _export_run(
                name, path, staging, out, file_format, options, parts, step_block_size,
                max_rows_per_file, max_rows_per_group, validate,
            )  # fmt: skip
            for table in TABLES:  # runs last: a run listed in runs/ is whole
                src = staging / table / f"run={name}"
                if src.exists():
                    (out / table).mkdir(exist_ok=True)
                    os.replace(src, out / table / f"run={name}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        done.append(exported)
    return done


def _existing_rows_schema(out: Path, file_format: Any) -> pa.Schema | None:
    rows = out / "rows"
    if not rows.is_dir() or not any(rows.iterdir()):
        return None
    try:
        return ds.dataset(rows, format=file_format, partitioning="hive").schema
    except (pa.ArrowException, OSError) as e:  # files of the other format, or not a dataset
        raise SchemaMismatchError(
            "out_dir", f"{_name(file_format)} files in {rows}", str(e).splitlines()[0][:200]
        ) from e


def _export_run(
    name: str,
    path: str,
    staging: Path,
    out: Path,
    file_format: Any,
    options: Any,
    parts: tuple[str, ...],
    block: int,
    max_rows_per_file: int,
    max_rows_per_group: int,
    validate: bool,
) -> ExportedRun:
    run = open_run(path, validate=validate)
    schema = run.schema
    column_types(schema)  # this format's schema (open_run checked it; kept explicit)
    rows_schema = _relaxed(schema, parquet=_name(file_format) == "parquet").append(
        pa.field("step_index", pa.int64(), nullable=False)
    )
    existing = _existing_rows_schema(out, file_format)
    if existing is not None:
        # One dataset, one set of column types: a reader of rows/ scans every run with it.
        have = pa.schema([existing.field(n) for n in rows_schema.names if n in existing.names])
        if not have.equals(rows_schema, check_metadata=False):
            raise SchemaMismatchError(
                f"run[{name}].schema",
                f"the column types of the runs already in {out / 'rows'}",
                "other column types (export it to another directory)",
            )
    with_parts = [(p, pa.string() if p == "run" else pa.int64()) for p in parts]
    partition_fields = pa.schema(with_parts)
    written = _with_parts(rows_schema, partition_fields)
    steps: dict[str, list[Any]] = {n: [] for n in STEPS_SCHEMA.names}
    totals = {"rows": 0}

    def row_batches() -> Iterator[pa.RecordBatch]:
        for index, (batch, custom) in enumerate(run):
            meta = step_metadata(batch, custom)
            raw = bytes(custom[KEY_STEP])
            steps["step_index"].append(index)
            steps["step"].append(meta["step"])
            steps["rows"].append(batch.num_rows)
            steps["step_json"].append(raw.decode("utf-8"))  # checked as UTF-8 JSON above
            totals["rows"] += batch.num_rows
            if batch.num_rows == 0:
                continue
            n = batch.num_rows
            columns = _relaxed_columns(batch, rows_schema)
            columns.append(pa.array([index] * n, pa.int64()))
            yield pa.RecordBatch.from_arrays(
                columns + _partition_columns(parts, name, index, block, n), schema=written
            )

    common = {
        "format": file_format,
        "file_options": options,
        "partitioning": ds.partitioning(partition_fields, flavor="hive"),
        "basename_template": f"part-{uuid.uuid4().hex[:12]}-{{i}}.{FORMATS[_name(file_format)]}",
        "existing_data_behavior": "overwrite_or_ignore",
        "max_rows_per_file": max_rows_per_file,
        "max_rows_per_group": max_rows_per_group,
        "min_rows_per_group": min(max_rows_per_group, 1 << 14),
    }
    ds.write_dataset(
        row_batches(),
        staging / "rows",
        schema=written,
        **common,
    )
    n_steps = len(steps["step_index"])
    if n_steps:
        index = pa.array(steps["step_index"], pa.int64())
        steps_table = pa.Table.from_pydict(steps, schema=STEPS_SCHEMA)
        for p, _ in with_parts:
            value = (
                pa.array([name] * n_steps, pa.string())
                if p == "run"
                else pc.divide(index, pa.scalar(block, pa.int64()))
            )
            steps_table = steps_table.append_column(p, value)
        ds.write_dataset(steps_table, staging / "steps", **common)
    meta = {
        k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
        for k, v in (schema.metadata or {}).items()
    }
    runs_table = pa.Table.from_pylist(
        [
            {
                "source": os.path.abspath(path),
                "steps": n_steps,
                "rows": totals["rows"],
                "complete": run.complete,
                "schema_metadata": json.dumps(meta, sort_keys=True),
                "arrow_schema": schema.serialize().to_pybytes(),
                "run": name,
            }
        ],
        schema=RUNS_SCHEMA.append(pa.field("run", pa.string())),
    )
    ds.write_dataset(
        runs_table,
        staging / "runs",
        **{
            **common,
            "partitioning": ds.partitioning(pa.schema([("run", pa.string())]), flavor="hive"),
        },
    )
    return ExportedRun(name, os.path.abspath(path), n_steps, totals["rows"], run.complete)


def _relaxed_type(t: pa.DataType, parquet: bool) -> pa.DataType:
    if pa.types.is_struct(t):
        return pa.struct(
            [f.with_type(_relaxed_type(f.type, parquet)).with_nullable(True) for f in t]
        )
    if parquet and isinstance(t, pa.BaseExtensionType):
        return _relaxed_type(t.storage_type, parquet)
    if parquet and pa.types.is_fixed_size_list(t):
        return pa.list_(_relaxed_type(t.value_type, parquet))
    return t


def _relaxed(schema: pa.Schema, *, parquet: bool) -> pa.Schema:
    """The schema the exported rows are written in; :func:`iter_exported_outputs` restores
    the exact types (:func:`_restored`).

    - Every struct child nullable: Parquet writers refuse a non-null child
      (``aux_output.token_start``) under a null struct row, although the format puts a 0 there.
    - For Parquet, fixed-size lists (tensor shapes, and the storage of fixed-shape tensor
      columns) as lists: pyarrow before 26 cannot read a null fixed-size-list row back from
      Parquet ("Expected all lists to be of size=...", every version from 15 to 25), and
      every run has such rows (an absent tensor column is all null).
    """
    return pa.schema(
        [f.with_type(_relaxed_type(f.type, parquet)) for f in schema], metadata=schema.metadata
    )


def _relaxed_array(col: pa.Array, target: pa.DataType, hidden: Any = None) -> pa.Array:
    """A run column in its exported type (:func:`_relaxed`): an extension column becomes its
    storage, a fixed-size list a list, and the rest is cast. ``hidden``: a numpy mask of the
    rows under a null parent row. Lists keep no values under a null row, their own or a
    parent's (pyarrow's Parquet writer before 16 refuses a null list row with values)."""
    if isinstance(col, pa.ExtensionArray) and not isinstance(target, pa.BaseExtensionType):
        col = col.storage
    if pa.types.is_struct(target) and pa.types.is_struct(col.type):
        null = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else None
        if hidden is not None:
            null = hidden if null is None else null | hidden
        children = [_relaxed_array(col.field(i), f.type, null) for i, f in enumerate(target)]
        mask = pa.array(null) if null is not None and null.any() else None
        return pa.StructArray.from_arrays(children, fields=list(target), mask=mask)
    fixed = pa.types.is_fixed_size_list(col.type)
    if pa.types.is_list(target) and (fixed or (hidden is not None and pa.types.is_list(col.type))):
        n = len(col)
        if fixed:
            size = col.type.list_size
            starts = (col.offset + np.arange(n, dtype=np.int64)) * size
            lengths = np.full(n, size, np.int64)
        else:
            offsets = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
            starts, lengths = offsets[:-1], np.diff(offsets)
        null = ~col.is_valid().to_numpy(zero_copy_only=False)
        if hidden is not None:
            null |= hidden
        kept = np.where(null, 0, lengths)
        # The child's index of every value kept, row by row.
        first = np.repeat(starts - (np.cumsum(kept) - kept), kept)
        index = first + np.arange(int(kept.sum()), dtype=np.int64)
        values = _relaxed_array(col.values.take(pa.array(index)), target.value_type)
        offsets_out = pa.array(np.concatenate(([0], np.cumsum(kept))), pa.int32())
        mask = pa.array(null) if null.any() else None
        return pa.ListArray.from_arrays(offsets_out, values, type=target, mask=mask)
    return col if col.type.equals(target) else col.cast(target)


def _relaxed_columns(batch: pa.RecordBatch, schema: pa.Schema) -> list[pa.Array]:
    """A run's columns in the exported types of ``schema`` (:func:`_relaxed`; fields past the
    run's own, such as a dataset's ``step_index``, are the caller's to fill)."""
    return [_relaxed_array(c, f.type) for c, f in zip(batch.columns, schema)]


def _relaxed_batch(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A run's batch in the exported schema (:func:`_relaxed`)."""
    return pa.RecordBatch.from_arrays(_relaxed_columns(batch, schema), schema=schema)


def _restored(col: pa.Array, target: pa.DataType, path: str) -> pa.Array:
    """A column read back from the dataset in its exact type. Parquet keeps no value under a
    null struct or list row (it reads back null or empty); the format has zeros there
    (``docs/schema.md``), so zeros go back, under null rows only: a null under a valid row
    stays, for the decoder to refuse. ``path`` names the column in errors."""
    if isinstance(target, pa.BaseExtensionType):
        storage = col.storage if isinstance(col, pa.ExtensionArray) else col
        return pa.ExtensionArray.from_storage(target, _restored(storage, target.storage_type, path))
    if pa.types.is_struct(target):
        row_null = col.is_null()
        children = []
        for i, field in enumerate(target):
            child = _restored(col.field(i), field.type, f"{path}.{field.name}")
            if not field.nullable and child.null_count:
                child = pc.if_else(row_null, _zero(field.type), child)
                if child.null_count:
                    raise SchemaMismatchError(
                        f"{path}.{field.name}", "no nulls (a non-nullable field)", "nulls"
                    )
            children.append(child)
        return pa.StructArray.from_arrays(
            children, fields=list(target), mask=row_null if col.null_count else None
        )
    if pa.types.is_fixed_size_list(target):
        size = target.list_size
        if pa.types.is_fixed_size_list(col.type):  # an IPC export: the run's own type
            if col.type.list_size != size:
                raise SchemaMismatchError(path, str(target), str(col.type))
            values = col.values.slice(col.offset * size, len(col) * size)
        elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            values = _fixed_values(col, size, path)
        else:
            raise SchemaMismatchError(path, f"{target} (or a list of its values)", str(col.type))
        values = _restored(values, target.value_type, f"{path}[]")
        if col.null_count and values.null_count:
            under_null = np.repeat(col.is_null().to_numpy(zero_copy_only=False), size)
            values = pc.if_else(pa.array(under_null), _zero(values.type), values)
        return pa.FixedSizeListArray.from_arrays(
            values, type=target, mask=col.is_null() if col.null_count else None
        )
    return col if col.type.equals(target) else col.cast(target)


def _fixed_values(col: pa.Array, size: int, path: str) -> pa.Array:
    """The values of a list column written for a fixed-size list of ``size``: each non-null
    row's, which must be exactly ``size``, and ``size`` nulls for each null row (its values
    are not in the file; :func:`_restored` puts zeros there)."""
    offsets = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.diff(offsets)
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    wrong = valid & (lengths != size)
    if wrong.any():
        i = int(np.argmax(wrong))
        raise SchemaMismatchError(
            path, f"{size} values in every non-null row", f"{int(lengths[i])} in row {i}"
        )
    # Null rows take their values from one null appended to the child (index len(child)).
    child = col.values
    starts = np.where(valid, offsets[:-1], len(child))
    index = (starts[:, None] + np.where(valid[:, None], np.arange(size), 0)).reshape(-1)
    padded = pa.concat_arrays([child, pa.nulls(1, child.type)])
    return padded.take(pa.array(index, pa.int64()))


def _zero(t: pa.DataType) -> pa.Scalar:
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise SchemaMismatchError("column", "numbers under null rows", str(t))
    return pa.array(np.zeros(1, dtype=t.to_pandas_dtype()), type=t)[0]


def _name(file_format: Any) -> str:
    return "parquet" if isinstance(file_format, ds.ParquetFileFormat) else "ipc"


def _with_parts(schema: pa.Schema, parts: pa.Schema) -> pa.Schema:
    for f in parts:
        schema = schema.append(f)
    return schema


def _partition_columns(
    parts: tuple[str, ...], name: str, index: int, block: int, n: int
) -> list[pa.Array]:
    cols = []
    for p in parts:
        if p == "run":
            cols.append(pa.array([name] * n, pa.string()))
        else:
            cols.append(pa.array([index // block] * n, pa.int64()))
    return cols


# ----------------------------------------------------------------------------- reading back


def open_exported(
    out_dir: str | os.PathLike[str], table: str = "rows", *, format: str = "parquet"
) -> ds.Dataset:
    """One of an export's tables as a :class:`pyarrow.dataset.Dataset` (hive partitions
    become the ``run`` and ``step_block`` columns).

    Parameters
    ----------
    out_dir
        The directory given to :func:`export_dataset`.
    table
        ``"rows"`` (default), ``"steps"`` or ``"runs"``.
    format
        The export's format: ``"parquet"`` or ``"ipc"``.
    """
    if table not in TABLES:
        raise FieldTypeError("table", "'rows', 'steps' or 'runs'", repr(table)[:60])
    if format not in FORMATS:
        raise FieldTypeError("format", "'parquet' or 'ipc'", repr(format)[:60])
    path = Path(out_dir) / table
    if not path.is_dir():
        raise FieldTypeError("out_dir", f"an export directory with {table}/", str(out_dir))
    file_format = "parquet" if format == "parquet" else "ipc"
    return ds.dataset(path, format=file_format, partitioning="hive")


def iter_exported_outputs(
    out_dir: str | os.PathLike[str],
    run: str,
    *,
    format: str = "parquet",
    classes: Iterable[type] | None = None,
) -> Iterator[Any]:
    """An exported run's steps as ``ModelRunnerOutput`` objects, exactly as they were written.

    Reads the run's partition of ``rows`` and ``steps`` (the whole run in memory), orders
    rows by ``(step_index, req_index)`` and decodes each step with its step JSON; every batch
    is validated (the files are untrusted).
    """
    check_run_name(run)
    where = ds.field("run") == run
    runs = open_exported(out_dir, "runs", format=format).to_table(filter=where)
    if runs.num_rows != 1:
        raise ConsistencyError("run", f"a run exported to {out_dir}", f"{run!r}, which is not")
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(runs.column("arrow_schema")[0].as_py()))
    except (pa.ArrowException, TypeError) as e:
        raise SchemaMismatchError(
            f"run[{run}].arrow_schema", "an Arrow IPC schema", str(e)[:200]
        ) from e
    column_types(schema)  # this format's schema, or a clear refusal
    n_steps = runs.column("steps")[0].as_py()
    if n_steps == 0:
        return
    steps = (
        open_exported(out_dir, "steps", format=format)
        .to_table(filter=where, columns=["step_index", "rows", "step_json"])
        .sort_by("step_index")
    )
    if steps.column("step_index").to_pylist() != list(range(n_steps)):
        raise ConsistencyError(
            f"run[{run}].steps", f"step_index 0..{n_steps - 1}", "gaps or repeats"
        )
    counts = steps.column("rows").to_pylist()
    if sum(counts):
        table = _run_rows(out_dir, format, where, schema, run, sum(counts))
    else:  # only 0-row steps: the run has no rows/ partition
        table = schema.empty_table()
    empty = pa.RecordBatch.from_pylist([], schema=schema)
    offset = 0
    for n, raw in zip(counts, steps.column("step_json").to_pylist()):
        chunks = table.slice(offset, n).to_batches()
        batch = chunks[0] if n else empty
        offset += n
        yield from_record_batch(batch, custom_metadata={KEY_STEP: raw.encode()}, classes=classes)


def _run_rows(
    out_dir: Any, format: str, where: Any, schema: pa.Schema, run: str, expected: int
) -> pa.Table:
    """A run's rows in step order, in the run's exact schema."""
    rows_ds = open_exported(out_dir, "rows", format=format)
    names = [n for n in rows_ds.schema.names if n not in ("run", "step_block", "step_index")]
    if names != schema.names:
        raise SchemaMismatchError(f"run[{run}].rows", str(schema.names), str(names))
    rows = rows_ds.to_table(filter=where, columns=[*names, "step_index"])
    rows = rows.sort_by([("step_index", "ascending"), ("req_index", "ascending")])
    if rows.num_rows != expected:
        raise ConsistencyError(f"run[{run}].rows", f"{expected} rows (steps/)", str(rows.num_rows))
    rows = rows.select(names).combine_chunks()
    columns = [
        _restored(rows.column(i).combine_chunks(), f.type, f"run[{run}].rows.{f.name}")
        for i, f in enumerate(schema)
    ]
    return pa.Table.from_arrays(columns, schema=schema)
