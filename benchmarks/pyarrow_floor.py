"""The cheapest assembly of a finished record batch on pyarrow, for the benchmarks' floors.

A floor times what no implementation of a step can avoid; for the assembly that is one C
Data Interface import of the columns that hold data (``_speedups.build_array``) and the
all-null columns of absent fields added as they are (``add_column``): they are the same
every step of a run's size, so any assembly keeps them instead of importing them again.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from arrow_outputs._pyspeedups import node_of
from arrow_outputs._speedups import build_array  # the floors need the C module

_import_from_c = pa.RecordBatch._import_from_c


def split_for_floor(batch: pa.RecordBatch) -> tuple[Any, pa.Schema, Any, list[Any]] | None:
    """``batch`` as the cheapest assembly on pyarrow takes it: a tree of nodes over the
    buffers of the columns that hold data, a schema of those columns, the schema metadata,
    and (position, field, array) of the all-null columns, to be added as they are; None
    when a column has no node (``node_of``)."""
    n = batch.num_rows
    nodes, fields, added = [], [], []
    for i, (field, col) in enumerate(zip(batch.schema, batch.columns)):
        if n and col.null_count == n:
            added.append((i, field, col))
            continue
        node = node_of(col)
        if node is None:
            return None
        nodes.append(node)
        fields.append(field)
    return (n, 0, (None,), tuple(nodes)), pa.schema(fields), batch.schema.metadata, added


def assemble(
    tree: Any, part: pa.Schema, meta: Any, added: list[Any], *, validate: bool
) -> pa.RecordBatch:
    """The batch ``split_for_floor`` took apart: its tree imported with ``meta`` (and
    ``validate()``d when asked, as from_buffers would), its all-null columns added."""
    capsule, address = build_array(tree)  # the capsule lives until the import took it
    batch = _import_from_c(address, part.with_metadata(meta))
    del capsule
    if validate:
        batch.validate()
    for at, field, column in added:
        batch = batch.add_column(at, field, column)
    return batch
