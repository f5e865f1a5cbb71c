"""Types of the C++ module ``arrow_outputs._arrowbridge`` (``_arrowbridge.cc``)."""

import pyarrow as pa

#: The Arrow version it was built against (it loads into no other).
ARROW_VERSION: str

def export_into(batch: pa.RecordBatch, address: int, /) -> bool: ...
