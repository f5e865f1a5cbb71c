"""``arrow_outputs._arrowbridge``: a batch's buffers as the ArrowArray tree pyarrow's export
would give, filled from the batch's own ArrayData (no per-node allocation), for the C decode
walk.

The reference is pyarrow itself: a filled tree imported back with
``RecordBatch._import_from_c`` must equal the batch and share every buffer with it. Layouts
the view does not mirror are declined with the slot untouched (the walk then uses pyarrow's
export); the tree holds the batch alive until it is released, from any thread.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import speedups_c

import arrow_outputs as ao
from arrow_outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, _accel, _pyspeedups

pytestmark = pytest.mark.skipif(
    _accel._bridge is None or speedups_c is None,
    reason=f"arrow_outputs._arrowbridge not loaded: {_accel.BRIDGE_UNAVAILABLE}",
)

# struct ArrowArray: five int64 (length, null_count, offset, n_buffers, n_children), then the
# buffers, children and dictionary pointers, then release and private_data.
RELEASE_AT = 5 * 8 + 3 * 8


def _slot() -> tuple[Any, int]:
    return speedups_c.array_slot()


def _released(address: int) -> bool:
    return ctypes.c_void_p.from_address(address + RELEASE_AT).value is None


def _addresses(batch: pa.RecordBatch) -> list[int | None]:
    """Every buffer address in the batch's tree, depth first."""
    found: list[int | None] = []

    def walk(arr: pa.Array) -> None:
        found.extend(None if b is None else b.address for b in arr.buffers())

    for col in batch.columns:
        walk(col)
    return found


def _struct_batch(n: int) -> pa.RecordBatch:
    rng = np.random.default_rng(n)
    ints = pa.array(rng.integers(-5, 5, n), pa.int64())
    with_nulls = pa.array([None if i % 3 == 0 else i for i in range(n)], pa.int32())
    strs = pa.array([f"r{i}-é" if i % 4 else None for i in range(n)], pa.string())
    lists = pa.array([list(range(i % 5)) for i in range(n)], pa.list_(pa.int32()))
    nested = pa.array(
        [[[i], [i, i + 1]] if i % 2 else None for i in range(n)], pa.list_(pa.list_(pa.int16()))
    )
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(3 * n, dtype=np.float32)), 3)
    struct = pa.StructArray.from_arrays([ints, strs], ["a", "b"])
    tensor_type = pa.fixed_shape_tensor(pa.float32(), (3,))
    tensor = pa.ExtensionArray.from_storage(tensor_type, fixed)
    return pa.RecordBatch.from_arrays(
        [
            ints,
            with_nulls,
            strs,
            pa.array([f"x{i}" for i in range(n)], pa.large_string()),
            pa.array([bytes([i % 256]) * (i % 3) for i in range(n)], pa.binary()),
            pa.array([i % 2 == 0 for i in range(n)], pa.bool_()),
            pa.nulls(n),
            pa.nulls(n, pa.list_(pa.int64())),
            lists,
            pa.array([list(range(i % 3)) for i in range(n)], pa.large_list(pa.float64())),
            nested,
            fixed,
            struct,
            tensor,
        ],
        [f"c{i}" for i in range(14)],
    )


def _step_batches() -> Iterator[tuple[str, pa.RecordBatch, Any]]:
    rng = np.random.default_rng(3)
    req = [f"r{i}" for i in range(6)]
    index = {r: i for i, r in enumerate(req)}
    lp = LogprobsLists(
        rng.integers(0, 1000, (6, 4)), -rng.random((6, 4)).astype(np.float32), np.ones(6, np.int64)
    )
    masks = SamplingMaskLists(np.arange(9, dtype=np.int32), np.array([0, 2, 2, 5, 5, 9, 9]))
    yield "decode", ao.to_record_batch(ModelRunnerOutput(req, index, [[1]] * 6, lp), step=1), None
    yield (
        "mask",
        ao.to_record_batch(ModelRunnerOutput(req, index, [[2]] * 6, sampling_masks=masks)),
        None,
    )
    sink = pa.BufferOutputStream()
    batch = ao.to_record_batch(ModelRunnerOutput(req, index, [[3, 4]] * 6, lp), step=2)
    with pa.ipc.new_stream(sink, ao.run_schema(batch)) as writer:
        writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    read, custom = pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()
    yield "from-ipc", read, custom


def _batches() -> Iterator[tuple[str, pa.RecordBatch]]:
    yield "one-row", _struct_batch(1)
    yield "many-rows", _struct_batch(37)
    yield "empty", _struct_batch(0)
    big = _struct_batch(50)
    # Slices: every column at an offset, with null counts pyarrow has not computed yet.
    yield "slice", big.slice(7, 20)
    yield "slice-of-slice", big.slice(3, 40).slice(5, 11)
    yield "no-columns", pa.RecordBatch.from_pydict({})
    for name, batch, _ in _step_batches():
        yield name, batch


# Built in the tests, not at collection: encoding caches its inferred schemas, whose producer
# metadata names torch once it is imported (other modules import it when collected).
BATCH_NAMES = ["one-row", "many-rows", "empty", "slice", "slice-of-slice", "no-columns"]
BATCH_NAMES += ["decode", "mask", "from-ipc"]


@pytest.mark.parametrize("name", BATCH_NAMES)
def test_tree_imports_back_as_the_batch_sharing_every_buffer(name: str) -> None:
    batch = dict(_batches())[name]
    capsule, address = _slot()
    assert _accel._bridge.export_into(batch, address) is True
    back = pa.RecordBatch._import_from_c(address, batch.schema)
    assert _released(address)  # moved into the imported batch
    back.validate(full=True)
    assert back.equals(batch), name
    # Zero-copy: the very buffers, as pyarrow's own export and import give them (the
    # importer gives a buffer it was handed as NULL, an empty one, an address of its own).
    exported, at = _slot()
    batch._export_to_c(at)
    assert _addresses(back) == _addresses(pa.RecordBatch._import_from_c(at, batch.schema))
    for got, was in zip(_addresses(back), _addresses(batch)):
        assert got == was or not was, name
    # The export's null counts: -1 where pyarrow has not counted them is the interface's
    # "unknown"; the importer counts them the same.
    for a, b in zip(back.columns, batch.columns):
        assert a.null_count == b.null_count
    del capsule, exported


def test_tree_holds_the_batch_until_released() -> None:
    data = np.arange(4096, dtype=np.float64)
    batch = pa.RecordBatch.from_arrays([pa.array(data)], ["x"])
    before = sys.getrefcount(batch)
    capsule, address = _slot()
    assert _accel._bridge.export_into(batch, address)
    assert sys.getrefcount(batch) == before + 1
    del capsule  # never imported: the capsule releases the tree
    assert sys.getrefcount(batch) == before

    capsule, address = _slot()
    assert _accel._bridge.export_into(batch, address)
    back = pa.RecordBatch._import_from_c(address, batch.schema)
    del capsule, batch
    gc.collect()
    # The import holds the tree, the tree the batch: its memory is still the array's.
    assert np.array_equal(back.column(0).to_numpy(), data)


def test_tree_released_on_another_thread() -> None:
    # The interface lets a consumer release from any thread: release takes the GIL.
    batch = _struct_batch(9)
    before = sys.getrefcount(batch)
    holder: list[Any] = []
    capsule, address = _slot()
    assert _accel._bridge.export_into(batch, address)
    holder.append(pa.RecordBatch._import_from_c(address, batch.schema))
    del capsule
    assert sys.getrefcount(batch) == before + 1
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    assert sys.getrefcount(batch) == before


def test_decoded_arrays_keep_the_producers_memory_and_only_as_long_as_they_live() -> None:
    # to_record_batch wraps the numpy arrays (zero-copy), the view holds that batch, the
    # decoded arrays hold the view: the producer's array lives exactly as long as they do.
    ids = np.arange(400, dtype=np.int64).reshape(-1, 4)
    alive = weakref.ref(ids)
    lp = LogprobsLists(ids, np.zeros((100, 4), np.float32), np.ones(100, np.int64))
    req = [f"r{i}" for i in range(100)]
    out = ModelRunnerOutput(req, {r: i for i, r in enumerate(req)}, [[1]] * 100, lp)
    batch = ao.to_record_batch(out, step=0)
    del out, lp
    back = ao.from_record_batch(batch)
    assert back.logprobs.logprob_token_ids.ctypes.data == ids.ctypes.data
    del ids, batch
    gc.collect()
    assert alive() is not None
    assert np.array_equal(back.logprobs.logprob_token_ids, np.arange(400).reshape(-1, 4))
    del back
    gc.collect()
    assert alive() is None


def _unmirrored() -> Iterator[tuple[str, pa.RecordBatch]]:
    n = 4
    ints = pa.array(range(n), pa.int32())
    yield (
        "dictionary",
        pa.RecordBatch.from_arrays([pa.array(["a", "b", "a", "c"]).dictionary_encode()], ["d"]),
    )
    yield (
        "string-view",
        pa.RecordBatch.from_arrays([pa.array(["a", "bb", "c", "d"], pa.string_view())], ["s"]),
    )
    yield (
        "list-view",
        pa.RecordBatch.from_arrays(
            [pa.ListViewArray.from_arrays([0, 1, 1, 2], [1, 0, 1, 1], ints)], ["l"]
        ),
    )
    yield (
        "union",
        pa.RecordBatch.from_arrays(
            [pa.UnionArray.from_sparse(pa.array([0, 1, 0, 1], pa.int8()), [ints, ints])], ["u"]
        ),
    )
    yield (
        "run-end",
        pa.RecordBatch.from_arrays([pa.RunEndEncodedArray.from_arrays([2, 4], [1, 2])], ["r"]),
    )
    # Nested deeper than the IPC reader allows.
    deep = ints
    for _ in range(70):
        deep = pa.ListArray.from_arrays(pa.array(range(n + 1), pa.int32()), deep)
    yield "too-deep", pa.RecordBatch.from_arrays([deep], ["deep"])
    # Declined inside a struct too, after columns that were fine.
    nested = pa.StructArray.from_arrays([ints, pa.array(["a"] * n).dictionary_encode()], ["i", "d"])
    yield "nested-dictionary", pa.RecordBatch.from_arrays([ints, nested], ["i", "s"])


@pytest.mark.parametrize(
    "name",
    ["dictionary", "string-view", "list-view", "union", "run-end", "too-deep", "nested-dictionary"],
)
def test_declines_what_it_does_not_mirror_and_leaves_the_slot(name: str) -> None:
    batch = dict(_unmirrored())[name]
    before = sys.getrefcount(batch)
    capsule, address = _slot()
    assert _accel._bridge.export_into(batch, address) is False, name
    assert _released(address)
    assert sys.getrefcount(batch) == before
    # pyarrow's export then fills the same slot (the capsule releases it).
    batch._export_to_c(address)
    assert not _released(address)
    del capsule


def test_refuses_a_used_slot_a_null_address_and_what_is_not_a_batch() -> None:
    batch = _struct_batch(2)
    capsule, address = _slot()
    assert _accel._bridge.export_into(batch, address)
    with pytest.raises(ValueError, match="unreleased"):
        _accel._bridge.export_into(batch, address)
    with pytest.raises(ValueError, match="address is 0"):
        _accel._bridge.export_into(batch, 0)
    with pytest.raises(TypeError, match=r"pyarrow\.RecordBatch"):
        _accel._bridge.export_into(pa.table({"a": [1]}), address)
    with pytest.raises(TypeError, match="2 arguments"):
        _accel._bridge.export_into(batch)
    del capsule


def test_decode_reads_through_the_view(monkeypatch: pytest.MonkeyPatch) -> None:
    filled: list[bool] = []
    real = _accel._bridge

    class Spy:
        assemble = staticmethod(real.assemble)
        schema_address = staticmethod(real.schema_address)
        proven_valid = staticmethod(real.proven_valid)

        @staticmethod
        def export_into(batch: Any, address: int) -> bool:
            filled.append(real.export_into(batch, address))
            return filled[-1]

    monkeypatch.setattr(_accel, "_bridge", Spy)
    was = _accel.accelerated()
    _accel.set_pure_python(False)
    try:
        for name, batch, custom in _step_batches():
            out = ao.from_record_batch(batch, custom_metadata=custom)
            with monkeypatch.context() as m:
                m.setattr(_accel, "_bridge", None)  # pyarrow's export: the same output
                ao.assert_outputs_equal(out, ao.from_record_batch(batch, custom_metadata=custom))
            assert filled, name
            assert filled[-1] is True, name
    finally:
        _accel.set_pure_python(not was)


# ----------------------------------------------------------------------------- assemble

SCHEMA = pa.schema(
    [("a", pa.int64()), ("n", pa.int32()), ("s", pa.string())], metadata={b"run": b"r1"}
)


def _columns(values: np.ndarray, n_type: pa.DataType | None = None) -> list[Any]:
    """Two node columns (int64 values, strings) around a pyarrow array column."""
    n = len(values)
    offsets = np.arange(n + 1, dtype=np.int32)
    return [
        (n, 0, (None, values), ()),
        pa.nulls(n, n_type or pa.int32()),
        (n, 0, (None, offsets, b"x" * n), ()),
    ]


@pytest.mark.parametrize("metadata", [None, {b"run": b"r1", b"arrow_outputs.step": b"{}"}])
def test_assemble_is_the_specifications_batch_over_the_same_buffers(metadata: Any) -> None:
    values = np.arange(5, dtype=np.int64)
    columns = _columns(values)
    got = _accel._bridge.assemble(SCHEMA, 5, columns, metadata)
    spec = _pyspeedups.record_batch(columns, SCHEMA, 5, metadata)
    imported = _accel._import_record_batch(columns, SCHEMA, 5, metadata)
    for ref in (spec, imported):
        assert got.equals(ref)
        assert got.schema.equals(ref.schema, check_metadata=True)
        assert _addresses(got) == _addresses(ref)  # zero-copy: the nodes' own memory
    assert got.schema.metadata == (SCHEMA.metadata if metadata is None else metadata)
    assert got.column(0).buffers()[1].address == values.ctypes.data
    # Arrow sees each buffer's real size (an imported tree's are computed from lengths).
    assert got.column(0).buffers()[1].size == values.nbytes
    got.validate(full=True)


def test_assemble_holds_the_node_buffers_until_arrow_lets_go() -> None:
    values = np.arange(6, dtype=np.int64)
    alive = weakref.ref(values)
    before = sys.getrefcount(values)
    got = _accel._bridge.assemble(SCHEMA, 6, _columns(values), None)
    assert sys.getrefcount(values) == before + 1  # one Py_buffer
    del values
    gc.collect()
    assert alive() is not None
    assert got.column(0).to_pylist() == list(range(6))
    # Released from another thread: the buffer is given back under the GIL.
    holder = [got]
    del got
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    gc.collect()
    assert alive() is None


def _declined(columns: list[Any], metadata: Any = None, n: int = 4) -> None:
    """assemble declines, holds nothing, and the specification raises or makes it."""
    values = columns[0][2][1] if type(columns[0]) is tuple else None
    before = sys.getrefcount(values)
    assert _accel._bridge.assemble(SCHEMA, n, columns, metadata) is None
    gc.collect()
    assert sys.getrefcount(values) == before


def test_assemble_declines_what_is_not_its_fields_shape() -> None:
    values = np.arange(4, dtype=np.int64)
    _declined(_columns(values, pa.int64()))  # an array column of another type
    cols = _columns(values)
    cols[1] = pa.nulls(3, pa.int32())  # another length
    _declined(cols)
    cols = _columns(values)
    cols[1] = [None] * 4  # neither node nor array
    _declined(cols)
    _declined(_columns(values), {"run": b"r1"})  # metadata: bytes only
    _declined(_columns(values), {b"run": "r1"})
    _declined(_columns(values)[:2])  # a column short
    _declined(_columns(values), n=5)  # nodes of another length than the batch
    for bad in (
        (4, 0, (None,), ()),  # a buffer short of the layout's
        (4, 0, (None, values, None), ()),  # one too many
        (4, 0, (None, values), ((4, 0, (None, values), ()),)),  # a child int64 has not
        (4, 5, (None, values), ()),  # more nulls than values
        (-1, 0, (None, values), ()),
        (4, 0, (None, values)),  # not a node
        [4, 0, (None, values), ()],
        (4.0, 0, (None, values), ()),
        (4, 0, (None, "not a buffer"), ()),
        (2**70, 0, (None, values), ()),
    ):
        cols = _columns(values)
        cols[0] = bad
        assert _accel._bridge.assemble(SCHEMA, 4, cols, None) is None, bad


def test_assemble_declines_buffers_too_small_for_their_lengths() -> None:
    values = np.arange(4, dtype=np.int64)
    short = _columns(values)
    short[0] = (8, 0, (None, values), ())  # 8 int64 values claimed over 4
    short[1] = pa.nulls(8, pa.int32())
    short[2] = (8, 0, (None, np.arange(9, dtype=np.int32), b"x" * 8), ())
    _declined(short, n=8)
    with pytest.raises(pa.ArrowInvalid, match="too small"):  # the specification's error
        _accel.record_batch(short, SCHEMA, 8)
    past_data = _columns(values)
    past_data[2] = (4, 0, (None, np.array([0, 1, 2, 3, 99], np.int32), b"xxxx"), ())
    _declined(past_data)
    # Inside a list: a child's values short of its length, nulls claimed without a bitmap.
    lists = pa.schema([("l", pa.list_(pa.int64()))])
    offsets = np.array([0, 4, 8], np.int32)
    assert (
        _accel._bridge.assemble(
            lists, 2, [(2, 0, (None, offsets), ((8, 0, (None, values), ()),))], None
        )
        is None
    )
    offsets = np.array([0, 2, 4], np.int32)
    assert (
        _accel._bridge.assemble(
            lists, 2, [(2, 1, (None, offsets), ((4, 0, (None, values), ()),))], None
        )
        is None
    )
    made = _accel._bridge.assemble(
        lists, 2, [(2, 0, (None, offsets), ((4, 0, (None, values), ()),))], None
    )
    assert made.column(0).to_pylist() == [[0, 1], [2, 3]]
    unordered = _columns(values)
    unordered[2] = (4, 0, (None, np.array([0, 3, 2, 3, 4], np.int32), b"xxxx"), ())
    # Offsets out of order are full validation's (as for from_buffers): made, then refused.
    got = _accel._bridge.assemble(SCHEMA, 4, unordered, None)
    with pytest.raises(pa.ArrowInvalid):
        got.validate(full=True)


def test_assemble_refuses_bad_arguments() -> None:
    columns = _columns(np.arange(3, dtype=np.int64))
    with pytest.raises(TypeError, match="4 arguments"):
        _accel._bridge.assemble(SCHEMA, 3)
    for bad in (
        ("schema", 3, columns, None),
        (SCHEMA, 3.0, columns, None),
        (SCHEMA, 3, tuple(columns), None),
        (SCHEMA, 3, columns, [(b"k", b"v")]),
    ):
        with pytest.raises(TypeError, match="assemble"):
            _accel._bridge.assemble(*bad)
    with pytest.raises(OverflowError):
        _accel._bridge.assemble(SCHEMA, 2**70, columns, None)
    assert _accel._bridge.assemble(SCHEMA, -1, columns, None) is None


def test_assemble_declines_trees_too_deep() -> None:
    t: pa.DataType = pa.int32()
    node: Any = (1, 0, (None, np.zeros(1, np.int32)), ())
    for _ in range(70):
        t = pa.list_(t)
        node = (1, 0, (None, np.array([0, 1], np.int32)), (node,))
    schema = pa.schema([("deep", t)])
    assert _accel._bridge.assemble(schema, 1, [node], None) is None


# ----------------------------------------------------------------------------- schema_address


def _stream(n_batches: int) -> list[tuple[pa.RecordBatch, Any]]:
    req = ["a", "b"]
    out = ModelRunnerOutput(req, {"a": 0, "b": 1}, [[1], [2]])
    first = ao.to_record_batch(out, step=0)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ao.run_schema(first)) as writer:
        for i in range(n_batches):
            batch = ao.to_record_batch(out, step=i, schema=ao.run_schema(first))
            writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    reader = pa.ipc.open_stream(sink.getvalue())
    return [reader.read_next_batch_with_custom_metadata() for _ in range(n_batches)]


def test_schema_address_is_shared_by_a_streams_batches_only() -> None:
    got = _stream(3)
    addresses = {_accel._bridge.schema_address(b) for b, _ in got}
    assert len(addresses) == 1
    other = _stream(1)[0][0]
    assert _accel._bridge.schema_address(other) not in addresses
    with pytest.raises(TypeError, match="RecordBatch"):
        _accel._bridge.schema_address(pa.table({"a": [1]}))


def test_a_streams_schema_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from arrow_outputs import batch as batch_module

    checked: list[int] = []
    real = batch_module.check_format
    monkeypatch.setattr(batch_module, "check_format", lambda s: checked.append(1) or real(s))
    was = _accel.accelerated()
    _accel.set_pure_python(False)
    try:
        for b, custom in _stream(5):
            assert ao.from_record_batch(b, custom_metadata=custom).req_ids == ["a", "b"]
        assert checked == [1]
        # A schema of another format is refused every time, never remembered.
        bad = pa.RecordBatch.from_pydict({"x": [1]})
        for _ in range(2):
            with pytest.raises(ao.SchemaMismatchError):
                ao.from_record_batch(bad)
        assert checked == [1, 1, 1]
    finally:
        _accel.set_pure_python(not was)


def test_refuses_to_load_under_another_arrow_and_the_codec_runs_without_it() -> None:
    # A module built against one Arrow must not unwrap another's objects: it refuses to
    # import, and the C path's crossings go through the C Data Interface instead.
    script = """
import numpy as np, pyarrow
pyarrow.cpp_version = "0.0.1"  # as if pyarrow had changed version after the build
import arrow_outputs as ao
from arrow_outputs import _accel
assert _accel._bridge is None and _accel.accelerated(), _accel.BRIDGE_UNAVAILABLE
print(_accel.BRIDGE_UNAVAILABLE)
lp = ao.LogprobsLists(np.arange(8).reshape(2, 4), np.zeros((2, 4), np.float32), np.ones(2, int))
out = ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2]], lp)
ao.assert_outputs_equal(ao.from_record_batch(ao.to_record_batch(out, step=1)), out)
"""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_OUTPUTS_PURE_PYTHON"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert f"built against Arrow {_accel._bridge.ARROW_VERSION}" in done.stdout
    assert "pyarrow's Arrow is 0.0.1" in done.stdout


# ----------------------------------------------------------------------------- write_message


def _pyarrows_stream(batch: pa.RecordBatch, custom: dict[bytes, bytes]) -> tuple[bytes, int]:
    """What pyarrow's stream writer writes for one batch, and where its schema ends."""
    options = pa.ipc.IpcWriteOptions(use_threads=False)
    head = pa.BufferOutputStream()
    pa.ipc.new_stream(head, batch.schema, options=options).close()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch, custom_metadata=custom)
    return sink.getvalue().to_pybytes(), head.getvalue().size - 8


@pytest.mark.parametrize("name", BATCH_NAMES)
def test_write_message_writes_pyarrows_bytes(name: str) -> None:
    batch = dict(_batches())[name]
    custom = {b"arrow_outputs.step": b'{"step": 1}', b"k": b"\x00\xff"}
    expected, schema_len = _pyarrows_stream(batch, custom)
    dest = bytearray(b"\xaa" * (len(expected) + 100))
    end = _accel._bridge.write_message(batch, custom, dest, schema_len)
    assert end == len(expected)
    assert bytes(dest[schema_len:end]) == expected[schema_len:]
    assert dest[:schema_len] == b"\xaa" * schema_len  # nothing before the offset
    assert dest[end:] == b"\xaa" * 100  # nothing after the end


def test_write_message_declines_what_does_not_fit_or_is_not_a_dict_of_bytes() -> None:
    batch = _struct_batch(40)
    custom = {b"k": b"v"}
    expected, schema_len = _pyarrows_stream(batch, custom)
    size = len(expected) - schema_len  # the message and the end-of-stream marker
    assert _accel._bridge.write_message(batch, custom, bytearray(size - 1), 0) is None
    assert _accel._bridge.write_message(batch, custom, bytearray(size), 0) == size
    for bad in ({"k": b"v"}, {b"k": "v"}, pa.KeyValueMetadata(custom), [(b"k", b"v")]):
        assert _accel._bridge.write_message(batch, bad, bytearray(size), 0) is None


def test_write_message_refuses_bad_arguments() -> None:
    batch = _struct_batch(2)
    with pytest.raises(TypeError, match=r"pyarrow\.RecordBatch"):
        _accel._bridge.write_message(pa.table({"a": [1]}), {}, bytearray(10), 0)
    with pytest.raises(TypeError, match="4 arguments"):
        _accel._bridge.write_message(batch, {}, bytearray(10))
    with pytest.raises(BufferError):  # read-only: no writable buffer
        _accel._bridge.write_message(batch, {}, bytes(1000), 0)
    for at in (-1, 11):
        with pytest.raises(ValueError, match="outside a buffer of 10 bytes"):
            _accel._bridge.write_message(batch, {}, bytearray(10), at)


# ----------------------------------------------------------------------------- read_message


def _message_of(batch: pa.RecordBatch, custom: dict[bytes, bytes]) -> bytes:
    stream, schema_len = _pyarrows_stream(batch, custom)
    return stream[schema_len:-8]  # the batch message alone


@pytest.mark.parametrize("name", BATCH_NAMES)
def test_read_message_reads_what_pyarrow_reads_over_the_same_memory(name: str) -> None:
    batch = dict(_batches())[name]
    custom = {b"arrow_outputs.step": b'{"step": 1}', b"": b"\x00"}
    data = pa.py_buffer(_message_of(batch, custom))
    got = _accel._bridge.read_message(data, batch.schema)
    assert got is not None
    read, pairs = got
    expected = pa.ipc.read_record_batch(pa.ipc.read_message(data), batch.schema)
    assert read.equals(expected)
    assert read.equals(batch)
    assert pairs == list(custom.items())
    lo, hi = data.address, data.address + data.size
    for col in read.columns:  # every buffer with bytes inside the message: no copy
        for b in col.buffers():
            assert b is None or b.size == 0 or lo <= b.address < b.address + b.size <= hi


def test_read_message_declines_anything_but_one_whole_batch_message() -> None:
    batch = _struct_batch(3)
    message = _message_of(batch, {b"k": b"v"})
    stream, schema_len = _pyarrows_stream(batch, {b"k": b"v"})
    declined = {
        "trailing bytes": message + b"\x00" * 8,
        "truncated": message[:-8],
        "end of stream": b"\xff\xff\xff\xff\x00\x00\x00\x00",
        "schema message": stream[:schema_len],
        "empty": b"",
        "garbage": b"\xa5" * 64,
    }
    for name, raw in declined.items():
        assert _accel._bridge.read_message(pa.py_buffer(raw), batch.schema) is None, name
    # Against another schema it reads what pyarrow reads (full validation comes after).
    other = pa.schema([("x", pa.int8())])
    got = _accel._bridge.read_message(pa.py_buffer(message), other)
    data = pa.py_buffer(message)
    assert got is not None
    assert got[0].equals(pa.ipc.read_record_batch(pa.ipc.read_message(data), other))
    with pytest.raises(TypeError, match=r"pyarrow\.Buffer and a pyarrow\.Schema"):
        _accel._bridge.read_message(message, batch.schema)
    with pytest.raises(TypeError, match="2 arguments"):
        _accel._bridge.read_message(pa.py_buffer(message))
