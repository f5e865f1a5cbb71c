"""``_arrowbridge.proven_valid`` and ``_accel.validate_full``: full validation of a batch
from elsewhere, proven by a stricter walk where it can be and left to pyarrow where not.

What must hold: whatever the walk proves valid, ``RecordBatch.validate(full=True)`` accepts
(never the other way round: the walk may only decline); every batch of this format proves
valid as written and as read back from IPC (so the decoders take the cheap way); and
``validate_full`` refuses exactly what pyarrow refuses, with pyarrow's own error.
"""

from __future__ import annotations

import os
import random
import struct
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import run_on
from test_batch import CASES, _ipc, _ipc_bytes

import arrow_outputs as ao
from arrow_outputs import _accel

pytestmark = pytest.mark.skipif(
    _accel._bridge is None,
    reason=f"arrow_outputs._arrowbridge not loaded: {_accel.BRIDGE_UNAVAILABLE}",
)

FUZZ_CASES = int(3000 * float(os.environ.get("ARROW_OUTPUTS_FUZZ_SCALE", "1")))


def _proven(batch: pa.RecordBatch) -> bool:
    return _accel._bridge.proven_valid(batch)


def _pyarrow_error(batch: pa.RecordBatch) -> str | None:
    try:
        batch.validate(full=True)
    except pa.ArrowException as e:
        return str(e)
    return None


def _one(array: pa.Array) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([array], ["c"])


def _i32(*values: int) -> pa.Buffer:
    return pa.py_buffer(np.array(values, np.int32).tobytes())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_every_batch_of_the_format_proves_valid_as_made_and_as_read(case: Any) -> None:
    batch = ao.to_record_batch(case(), step=3)
    read = _ipc(batch)[0]
    assert _proven(batch)
    assert _proven(read)
    assert _pyarrow_error(read) is None


def _supported_columns() -> dict[str, pa.Array]:
    n = 9
    ints = pa.array(range(n), pa.int64())
    return {
        "int8": pa.array([i - 4 for i in range(n)], pa.int8()),
        "uint16": pa.array(range(n), pa.uint16()),
        "float16": pa.array(np.arange(n, dtype=np.float16)),
        "float64-nulls": pa.array([None if i % 2 else i / 2 for i in range(n)], pa.float64()),
        "string": pa.array([f"é{i}" if i % 3 else None for i in range(n)], pa.string()),
        "large-string": pa.array([f"x{i}" for i in range(n)], pa.large_string()),
        "binary": pa.array([bytes([255, i]) for i in range(n)], pa.binary()),
        "large-binary": pa.array([b"\xff" * i for i in range(n)], pa.large_binary()),
        "list": pa.array(
            [list(range(i % 4)) if i % 5 else None for i in range(n)], pa.list_(pa.int32())
        ),
        "large-list-of-list": pa.array(
            [[[i], []] for i in range(n)], pa.large_list(pa.list_(pa.uint8()))
        ),
        "fixed-size-list": pa.FixedSizeListArray.from_arrays(
            pa.array(np.arange(2 * n, dtype=np.float32)), 2
        ),
        "struct": pa.StructArray.from_arrays(
            [ints, pa.array([str(i) for i in range(n)])],
            ["a", "b"],
            mask=pa.array([i == 4 for i in range(n)]),
        ),
        "all-null-struct": pa.nulls(n, pa.struct([("x", pa.list_(pa.float32()))])),
        "extension": pa.ExtensionArray.from_storage(
            pa.fixed_shape_tensor(pa.float32(), (2,)),
            pa.FixedSizeListArray.from_arrays(pa.array(np.arange(2 * n), pa.float32()), 2),
        ),
        "empty-list": pa.array([], pa.list_(pa.int64())),
    }


def _read_back(batch: pa.RecordBatch) -> pa.RecordBatch:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


@pytest.mark.parametrize("name", sorted(_supported_columns()))
def test_proves_the_layouts_it_takes(name: str) -> None:
    batch = _one(_supported_columns()[name])
    assert _proven(batch), name
    assert _proven(_read_back(batch)), name


@pytest.mark.parametrize(
    "array",
    [
        pa.array([True, False]),
        pa.nulls(2),
        pa.array(["a", "b"]).dictionary_encode(),
        pa.array(["a", "b"], pa.string_view()),
        pa.array([1, 2, 3], pa.int64()).slice(1),  # at an offset
        pa.array([1, None, 3], pa.int32()).slice(1),  # null count not yet computed
        pa.array([1, 2], pa.decimal128(5, 2)),
        pa.array([1, 2], pa.date32()),
    ],
    ids=["bool", "null", "dictionary", "string-view", "offset", "unknown-nulls", "decimal", "date"],
)
def test_declines_what_it_does_not_take_and_pyarrow_decides(array: pa.Array) -> None:
    batch = _one(array)
    assert not _proven(batch)
    _accel.validate_full(batch)  # pyarrow's validation accepts these


def _broken() -> dict[str, tuple[pa.RecordBatch, bool]]:
    """Batches that only full validation can tell apart, each with whether it is valid."""
    chars = pa.py_buffer(b"abcdef")
    return {
        "offsets-decreasing": (
            _one(pa.Array.from_buffers(pa.string(), 2, [None, _i32(0, 5, 2), chars])),
            False,
        ),
        "offset-past-the-values": (
            _one(pa.Array.from_buffers(pa.binary(), 2, [None, _i32(0, 9, 3), chars])),
            False,
        ),
        "offset-negative": (
            _one(pa.Array.from_buffers(pa.string(), 2, [None, _i32(0, -1, 3), chars])),
            False,
        ),
        "list-offsets-decreasing": (
            _one(
                pa.Array.from_buffers(
                    pa.list_(pa.int32()),
                    2,
                    [None, _i32(0, 3, 1)],
                    children=[pa.array([1, 2, 3], pa.int32())],
                )
            ),
            False,
        ),
        "nested-list-offsets-decreasing": (
            _one(
                pa.ListArray.from_arrays(
                    pa.array([0, 2], pa.int32()),
                    pa.Array.from_buffers(
                        pa.list_(pa.int8()),
                        2,
                        [None, _i32(0, 2, 1)],
                        children=[pa.array([1, 2], pa.int8())],
                    ),
                )
            ),
            False,
        ),
        "invalid-utf8": (
            _one(
                pa.Array.from_buffers(
                    pa.string(), 2, [None, _i32(0, 1, 3), pa.py_buffer(b"a\xc3(")]
                )
            ),
            False,
        ),
        "utf8-split-across-slots": (
            _one(
                pa.Array.from_buffers(
                    pa.string(), 2, [None, _i32(0, 1, 2), pa.py_buffer(b"\xc3\xa9")]
                )
            ),
            False,
        ),
        "null-count-wrong": (
            _one(
                pa.Array.from_buffers(
                    pa.int32(), 3, [pa.py_buffer(b"\x05"), _i32(1, 2, 3)], null_count=2
                )
            ),
            False,
        ),
        "struct-null-count-wrong": (
            _one(
                pa.StructArray.from_buffers(
                    pa.struct([("a", pa.int8())]),
                    2,
                    [pa.py_buffer(b"\x03")],
                    null_count=1,
                    children=[pa.array([1, 2], pa.int8())],
                )
            ),
            False,
        ),
        # Full validation reads no UTF-8 under a null slot: valid, though the walk declines.
        "invalid-utf8-under-a-null": (
            _one(
                pa.Array.from_buffers(
                    pa.string(),
                    2,
                    [pa.py_buffer(b"\x01"), _i32(0, 1, 3), pa.py_buffer(b"a\xc3(")],
                    null_count=1,
                )
            ),
            True,
        ),
    }


@pytest.mark.parametrize("name", sorted(_broken()))
def test_broken_batches_are_not_proven_and_refused_with_pyarrows_error(name: str) -> None:
    batch, valid = _broken()[name]
    expected = _pyarrow_error(batch)
    assert (expected is None) == valid, expected
    assert not _proven(batch)
    if valid:
        _accel.validate_full(batch)
        return
    with pytest.raises(pa.ArrowInvalid) as got:
        _accel.validate_full(batch)
    assert str(got.value) == expected


def test_decode_refuses_a_broken_batch_alike_on_both_paths() -> None:
    batch = ao.to_record_batch(CASES[0](), step=1)
    at = batch.schema.get_field_index("req_id")
    bad = pa.Array.from_buffers(
        pa.string(), batch.num_rows, [None, _i32(0, 5, 2, 6), pa.py_buffer(b"req-0-req-1")]
    )
    broken = batch.set_column(at, batch.schema.field(at), bad)
    custom = ao.step_custom_metadata(batch)
    errors = []
    for path in ("c", "python"):
        with pytest.raises(ao.SchemaMismatchError) as got:
            run_on(path, lambda: ao.from_record_batch(broken, custom_metadata=custom))
        errors.append(str(got.value))
    assert errors[0] == errors[1]
    assert "non-monotonic offset" in errors[0]


def test_decoders_take_the_proof_and_pyarrow_only_where_it_is_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proofs: list[bool] = []
    real = _accel._bridge

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def proven_valid(batch: pa.RecordBatch) -> bool:
            proofs.append(real.proven_valid(batch))
            return proofs[-1]

    monkeypatch.setattr(_accel, "_bridge", Spy())
    out = CASES[0]()
    read, custom = _ipc(ao.to_record_batch(out, step=1))
    run_on(
        "c",
        lambda: ao.assert_outputs_equal(ao.from_record_batch(read, custom_metadata=custom), out),
    )
    assert proofs == [True]
    # The pure path never asks: pyarrow's validation is its only one.
    run_on("python", lambda: ao.from_record_batch(read, custom_metadata=custom))
    assert proofs == [True]


def _batch_metadata(stream: bytes) -> tuple[int, int]:
    """Where the record-batch message's flatbuffer (its field nodes' lengths and null counts,
    its buffers' offsets and sizes) lies in a stream of one schema and one batch."""
    at = 0
    while True:
        size = struct.unpack_from("<i", stream, at + 4)[0]
        message = pa.ipc.read_message(pa.py_buffer(stream[at:]))
        if message.type == "record batch":
            return at + 8, at + 8 + size
        at += 8 + size + (message.body.size if message.body is not None else 0)


def _mutated(stream: bytes, metadata: tuple[int, int], rng: random.Random) -> bytes:
    """Bytes flipped anywhere, or an int64 of the batch's metadata set to a telling value."""
    out = bytearray(stream)
    for _ in range(rng.choice((1, 1, 2, 4))):
        if rng.random() < 0.5:
            at = rng.randrange(len(out))
            out[at] = rng.choice((0, 0xFF, out[at] ^ (1 << rng.randrange(8)), rng.randrange(256)))
        else:
            at = rng.randrange(metadata[0], metadata[1] - 8) & ~7
            value = rng.choice((0, 1, 2, 3, -1, rng.randrange(64), rng.randrange(1 << 20), 1 << 40))
            out[at : at + 8] = struct.pack("<q", value)
    return bytes(out)


def test_whatever_it_proves_pyarrow_accepts_over_mutated_streams() -> None:
    """Written streams of every case, mutated (lengths, null counts and buffer sizes in the
    metadata; offsets, bitmaps and strings in the body): every batch the IPC reader still
    gives is proven valid only if full validation passes."""
    rng = random.Random(20261202)
    streams = [
        _ipc_bytes([ao.to_record_batch(case(), step=i)]).to_pybytes()
        for i, case in enumerate(CASES)
    ]
    streams_at = [(stream, _batch_metadata(stream)) for stream in streams]
    seen = {"proven": 0, "refused": 0, "declined-valid": 0}
    for _ in range(FUZZ_CASES):
        data = _mutated(*rng.choice(streams_at), rng)
        try:
            batches = list(pa.ipc.open_stream(data))
        except (pa.ArrowException, OSError):
            continue
        for batch in batches:
            proven = _proven(batch)
            error = _pyarrow_error(batch)
            assert not (proven and error is not None), error
            if proven:
                seen["proven"] += 1
            elif error is not None:
                seen["refused"] += 1
            else:
                seen["declined-valid"] += 1
    # The fuzzer reaches both sides of the line, not only one.
    assert seen["proven"] > FUZZ_CASES // 10, seen
    assert seen["refused"] > FUZZ_CASES // 100, seen
