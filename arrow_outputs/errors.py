"""The exception hierarchy: one base class, a few specific ones.

Every message has the same shape, so a reader learns where, what and why at once::

    logprobs.cu_num_generated_tokens: expected 257 offsets ending at 1024, got 257 ending at 1023

The parts are also kept as attributes (``field``, ``expected``, ``got``) for programs.
"""

from __future__ import annotations

__all__ = [
    "ArrowOutputsError",
    "ConsistencyError",
    "CorruptFileError",
    "DTypeError",
    "FieldTypeError",
    "FormatVersionError",
    "OffsetsError",
    "OpaqueValueWarning",
    "SchemaMismatchError",
    "ShapeError",
    "StepMetadataError",
    "UnsupportedValueError",
    "WriterError",
]


class ArrowOutputsError(Exception):
    """Base class of every error raised by arrow_outputs.

    Parameters
    ----------
    field
        Dotted path of the offending field, e.g. ``"logprobs.logprobs"``.
    expected
        What the field had to be.
    got
        What came instead.

    Examples
    --------
    >>> err = ShapeError("pooler_output[2]", "a 1-D tensor", "shape (4, 4)")
    >>> str(err)
    'pooler_output[2]: expected a 1-D tensor, got shape (4, 4)'
    >>> isinstance(err, ArrowOutputsError) and isinstance(err, ValueError)
    True
    """

    def __init__(self, field: str, expected: str, got: str) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {got}")


class FieldTypeError(ArrowOutputsError, TypeError):
    """A value of the wrong Python kind: an unknown type, a tensor where a list belongs."""


class DTypeError(ArrowOutputsError, TypeError):
    """An array or tensor with the wrong element type (int16 token ids, float64 logprobs)."""


class ShapeError(ArrowOutputsError, ValueError):
    """An array of the wrong rank or length."""


class OffsetsError(ArrowOutputsError, ValueError):
    """Offsets that are not monotonic, do not start at 0, or disagree with array lengths."""


class ConsistencyError(ArrowOutputsError, ValueError):
    """Fields that contradict each other (``req_id_to_index`` vs ``req_ids``, unknown keys)."""


class UnsupportedValueError(ArrowOutputsError, ValueError):
    """A value the format cannot carry losslessly (opaque objects, device tensors, ints
    outside the column's range)."""


class SchemaMismatchError(ArrowOutputsError, ValueError):
    """A record batch or schema that is not this format's, or data that does not fit the
    run's schema (the schema is fixed at a run's first step)."""


class StepMetadataError(SchemaMismatchError):
    """Step metadata that is missing, malformed, or not the batch's own: an IPC batch read
    without its custom metadata, a table's batch that inherited another batch's schema, or
    JSON that breaks the format's rules. The message says how to read the batch correctly."""


class FormatVersionError(ArrowOutputsError, ValueError):
    """A batch written by a newer major version of the format."""


class CorruptFileError(ArrowOutputsError, ValueError):
    """Bytes of a run file, stream or message that are not valid Arrow IPC of this format:
    truncated, corrupted, or with offsets, lengths or metadata that do not hold."""


class WriterError(ArrowOutputsError, RuntimeError):
    """An :class:`~arrow_outputs.OutputWriter` that can take no more steps: closed, or
    stopped by an error in its background thread (raised first as itself)."""


class OpaqueValueWarning(UserWarning):
    """An opaque connector object was dropped rather than pickled (``opaque="drop"``)."""
