"""The cheapest assembly of a finished record batch on pyarrow, for the benchmarks' floors.

A floor times what no implementation of a step can avoid. For the assembly that is, where
``arrow_outputs._arrowbridge`` is loaded, one ``assemble`` call (the batch made in Arrow's
C++ library straight from the nodes over the buffers of the columns that hold data, the
all-null columns of absent fields placed as they are: they are the same every step of a
run's size, so any assembly keeps them); otherwise one C Data Interface import of the
columns that hold data (``_speedups.build_array``) and the all-null columns added
(``add_column``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from arrow_outputs._pyspeedups import node_of
from arrow_outputs._speedups import array_slot, build_array  # the floors need the C module

try:
    from arrow_outputs._arrowbridge import assemble as bridge_assemble
    from arrow_outputs._arrowbridge import export_into
except ImportError:  # not built, or built against another pyarrow
    bridge_assemble = export_into = None

_import_from_c = pa.RecordBatch._import_from_c


def split_for_floor(
    batch: pa.RecordBatch,
) -> tuple[Any, pa.Schema, Any, list[Any], tuple[pa.Schema, list[Any]]] | None:
    """``batch`` as the cheapest assembly on pyarrow takes it: a tree of nodes over the
    buffers of the columns that hold data, a schema of those columns, the schema metadata,
    (position, field, array) of the all-null columns, to be added as they are, and the
    whole schema (no metadata) with every column as a node or an array; None when a column
    has no node (``node_of``)."""
    n = batch.num_rows
    nodes, fields, added, columns = [], [], [], []
    for i, (field, col) in enumerate(zip(batch.schema, batch.columns)):
        if n and col.null_count == n:
            added.append((i, field, col))
            columns.append(col)
            continue
        node = node_of(col)
        if node is None:
            return None
        nodes.append(node)
        fields.append(field)
        columns.append(node)
    whole = (batch.schema.remove_metadata(), columns)
    return (n, 0, (None,), tuple(nodes)), pa.schema(fields), batch.schema.metadata, added, whole


def assemble(
    tree: Any,
    part: pa.Schema,
    meta: Any,
    added: list[Any],
    whole: tuple[pa.Schema, list[Any]],
    *,
    validate: bool,
) -> pa.RecordBatch:
    """The batch ``split_for_floor`` took apart: with the bridge, one ``assemble`` (which
    always makes from_buffers' checks); without it, its tree imported with ``meta`` (and
    ``validate()``d when asked, as from_buffers would) and its all-null columns added."""
    if bridge_assemble is not None:
        return bridge_assemble(whole[0], tree[0], whole[1], meta)
    capsule, address = build_array(tree)  # the capsule lives until the import took it
    batch = _import_from_c(address, part.with_metadata(meta))
    del capsule
    if validate:
        batch.validate()
    for at, field, column in added:
        batch = batch.add_column(at, field, column)
    return batch


def hand_over(batch: pa.RecordBatch) -> Any:
    """A received batch's buffers handed over once as the C decode walk reads them: the
    bridge's view where it is loaded and takes the layout, else pyarrow's export. Returns
    the capsule that releases the tree when dropped."""
    capsule, address = array_slot()
    if export_into is None or not export_into(batch, address):
        batch._export_to_c(address)
    return capsule
