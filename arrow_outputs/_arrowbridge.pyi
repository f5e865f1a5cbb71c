"""Types of the C++ module ``arrow_outputs._arrowbridge`` (``_arrowbridge.cc``)."""

import pyarrow as pa

#: The Arrow version it was built against (it loads into no other).
ARROW_VERSION: str

def export_into(batch: pa.RecordBatch, address: int, /) -> bool: ...
def assemble(
    schema: pa.Schema, n: int, columns: list[object], metadata: dict[bytes, bytes] | None, /
) -> pa.RecordBatch | None: ...
def schema_address(batch: pa.RecordBatch, /) -> int: ...
