"""The fast paths of the codec: whole-batch assembly through the Arrow C Data Interface
(``_speedups.build_array`` and ``_accel.record_batch``), C offsets from ``cu`` lists
(``int_offsets``), and the step JSON's parse reuse (``_stepmeta.parse``).

Each fast path must give what its specification gives (the pure-Python twin, or the full
parse), refuse what it refuses with the same error, hold and release every buffer it takes,
and copy nothing (buffer addresses compared).
"""

from __future__ import annotations

import gc
import itertools
import json
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import BUILT_IMPLS as BOTH
from conftest import needs_c
from conftest import run_on as _on
from conftest import speedups_c as _speedups
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch import CASES

import arrow_outputs as ao
from arrow_outputs import _accel, _pyspeedups, _stepmeta
from arrow_outputs.batch import _SPEC
from arrow_outputs.errors import StepMetadataError


class IntSub(int):
    pass


# ----------------------------------------------------------------------------- int_offsets


def _int_offsets_everywhere(values: Any, last: Any) -> Any:
    """Every implementation's answer (or exception type), required equal; returns it."""
    outcomes = []
    for m in BOTH:
        try:
            outcomes.append(("ok", m.int_offsets(values, last)))
        except Exception as e:
            outcomes.append(("raised", type(e)))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    return outcomes[0]


@pytest.mark.parametrize(
    ("values", "last", "expected"),
    [
        ([0], 0, [0]),
        ([0, 1, 3], 3, [0, 1, 3]),
        ((0, 0, 2, 2), 2, [0, 0, 2, 2]),
        ([0, 2**31 - 1], 2**31 - 1, [0, 2**31 - 1]),
        ([], 0, None),  # no offsets at all
        ([1, 2], 2, None),  # does not start at 0
        ([0, 2, 1], 1, None),  # decreases
        ([0, 1], 2, None),  # ends elsewhere
        ([0, 3, 2], 2, None),  # passes the end, then comes back
        ([0, True], 1, None),  # a bool is not an int
        ([0, 1.0], 1, None),
        ([0, IntSub(1)], 1, None),
        ([0, 2**70], 5, None),  # past int64: refused, not wrapped
        ([0, 2**31], 2**31, None),
        ([0, -1, 0], 0, None),
        (np.array([0, 1]), 1, None),  # only lists and tuples: numpy takes the slow path
        ("01", 1, None),
        ([0, 1], -1, None),
    ],
)
def test_int_offsets_cases(values: Any, last: int, expected: list[int] | None) -> None:
    kind, got = _int_offsets_everywhere(values, last)
    assert kind == "ok"
    assert (None if got is None else np.frombuffer(got, "<i4").tolist()) == expected


def test_int_offsets_argument_errors_alike() -> None:
    assert _int_offsets_everywhere([0], "1") == ("raised", TypeError)
    assert _int_offsets_everywhere([0], 2**80) == ("raised", OverflowError)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(-3, 2**33), max_size=12),
    st.one_of(st.integers(-1, 2**32), st.none()),
)
def test_int_offsets_agree_with_numpy(values: list[int], last: int | None) -> None:
    values = [0, *values] if values and values[0] > 0 else values
    last = (values[-1] if values else 0) if last is None else last
    _, got = _int_offsets_everywhere(values, last)
    ok = (
        bool(values)
        and values[0] == 0
        and values[-1] == last
        and all(a <= b for a, b in itertools.pairwise(values))
        and 0 <= last <= 2**31 - 1
    )
    if ok:
        assert got == np.array(values, "<i4").tobytes()
    else:
        assert got is None


@pytest.mark.usefixtures("codec_path")
@pytest.mark.parametrize("cu", [[0, 2, 1, 3], [0, 1, True, 3], [0, 1, 2], [1, 2, 3, 3]])
def test_int_offsets_codec_errors_name_the_field(cu: list[Any]) -> None:
    lp = ao.LogprobsLists(
        np.zeros((3, 2), np.int64), np.zeros((3, 2), np.float32), np.ones(3, np.int64), cu
    )
    out = ao.ModelRunnerOutput(["a", "b", "c"], {"a": 0, "b": 1, "c": 2}, [[1], [2], [3]], lp)
    with pytest.raises(ao.ArrowOutputsError, match=r"logprobs\.cu_num_generated_tokens"):
        ao.to_record_batch(out)


# ----------------------------------------------------------------------------- req_id reuse


class StrSub(str):
    pass


def test_same_items_agree() -> None:
    x, y = "req-0", "req-1"
    cases = [
        (([x, y], [x, y]), True),
        (([x, y], [y, x]), False),
        (([x], [x, y]), False),
        (([x], (x,)), False),  # exact lists only
        (([], []), True),
        (([x], ["".join(["req-", "0"])]), False),  # equal, not the same object
        (([float("1.5")], [float("1.5")]), False),  # two float objects, equal
    ]
    for (a, b), want in cases:
        assert [m.same_items(a, b) for m in BOTH] == [want] * len(BOTH)


@needs_c
def test_req_id_column_reused_only_for_the_same_objects() -> None:
    ids = [f"cmpl-{i:04d}-0" for i in range(5)]
    first_out = ao.ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[0]] * len(ids))
    # A run of its own: no other test's steps count as this run's (reuse follows the run).
    meta = {"test": "req_id_column_reused_only_for_the_same_objects"}
    schema = ao.run_schema(ao.to_record_batch(first_out, step=0, metadata=meta))

    def batch(req_ids: list[Any]) -> pa.RecordBatch:
        out = ao.ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, [[i] for i in range(len(req_ids))]
        )
        return _on("c", lambda: ao.to_record_batch(out, step=1, schema=schema))

    def data_address(b: pa.RecordBatch) -> int:
        return int(b.column("req_id").buffers()[2].address)

    first = batch(ids)
    again = batch(list(ids))  # another list, the same str objects: reused
    assert data_address(again) == data_address(first)
    assert again.column("req_id").to_pylist() == ids
    copies = ["".join(["cmpl-", r[5:]]) for r in ids]  # equal strs, other objects
    other = batch(copies)
    assert data_address(other) != data_address(first)
    assert other.column("req_id").equals(first.column("req_id"))
    mutated = list(ids)
    mutated[2] = "cmpl-changed"
    assert batch(mutated).column("req_id").to_pylist()[2] == "cmpl-changed"
    # A str subclass equal to a cached id is refused as on the pure-Python path.
    sub = [StrSub(r) for r in ids]
    errors = []
    for path in ("c", "python"):
        out = ao.ModelRunnerOutput(sub, {r: i for i, r in enumerate(sub)}, [[1]] * len(sub))
        with pytest.raises(ao.ArrowOutputsError) as e:
            _on(path, lambda out=out: ao.to_record_batch(out, schema=schema))
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]


@needs_c
def test_req_id_column_reuse_after_a_run_of_changing_steps() -> None:
    # Steps that change their requests never reuse, so after a run of them the copy of
    # req_ids is taken only now and then (_SNAPSHOT_EVERY); once the steps settle, reuse
    # comes back within that many steps, and every batch holds its own ids throughout.
    from arrow_outputs import batch as batch_module

    first = [f"warm-{i}" for i in range(4)]
    out = ao.ModelRunnerOutput(first, {r: i for i, r in enumerate(first)})
    meta = {"test": "req_id_column_reuse_after_a_run_of_changing_steps"}  # a run of its own
    schema = ao.run_schema(ao.to_record_batch(out, metadata=meta))

    def encode(req_ids: list[Any]) -> pa.RecordBatch:
        out = ao.ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, [[i] for i in range(len(req_ids))]
        )
        got = _on("c", lambda: ao.to_record_batch(out, step=0, schema=schema))
        assert got.column("req_id").to_pylist() == req_ids
        return got

    for step in range(3 * batch_module._SNAPSHOT_AFTER):  # every step new requests
        encode([f"r{step}-{i}" for i in range(4)])
    steady = [f"steady-{i}" for i in range(4)]
    kept = [encode(list(steady)) for _ in range(batch_module._SNAPSHOT_EVERY + 2)]  # alive
    addresses = [int(b.column("req_id").buffers()[2].address) for b in kept]
    # Reused: the very column of an earlier step, and the steps after it reuse it too.
    assert addresses[-1] in addresses[:-1]
    assert addresses[-1] == addresses[-2]


# ----------------------------------------------------------------------------- build_array


def _schema(t: pa.DataType) -> pa.Schema:
    return pa.schema([pa.field("a", t)])


@needs_c
def test_build_array_zero_copy_and_values() -> None:
    values = np.arange(5, dtype=np.int64)
    offsets = np.array([0, 2, 2, 5], dtype=np.int32)
    node = (3, 0, (None,), ((3, 0, (None, offsets), ((5, 0, (None, values), ()),)),))
    capsule, address = _speedups.build_array(node)
    batch = pa.RecordBatch._import_from_c(address, _schema(pa.list_(pa.int64())))
    del capsule
    batch.validate(full=True)
    assert batch.column(0).to_pylist() == [[0, 1], [], [2, 3, 4]]
    col = batch.column(0)
    assert col.buffers()[1].address == offsets.ctypes.data
    assert col.values.buffers()[1].address == values.ctypes.data


@needs_c
def test_build_array_holds_buffers_until_arrow_lets_go() -> None:
    # A bytearray cannot be resized while a buffer of it is exported: a clean probe of
    # whether the C code still holds it.
    data = bytearray(np.arange(3, dtype=np.int64).tobytes())

    def held() -> bool:
        try:
            data.extend(b"")
            data.append(0)
            del data[-1]
        except BufferError:
            return True
        return False

    capsule, address = _speedups.build_array((3, 0, (None,), ((3, 0, (None, data), ()),)))
    assert held()
    del capsule  # never imported: the capsule releases the tree
    gc.collect()
    assert not held()

    capsule, address = _speedups.build_array((3, 0, (None,), ((3, 0, (None, data), ()),)))
    batch = pa.RecordBatch._import_from_c(address, _schema(pa.int64()))
    del capsule
    col = batch.column(0)
    del batch
    assert held()  # the column still views the buffer
    assert col.to_pylist() == [0, 1, 2]
    del col
    gc.collect()
    assert not held()


@needs_c
def test_build_array_released_from_another_thread() -> None:
    data = bytearray(8 * 1000)
    capsule, address = _speedups.build_array((1000, 0, (None,), ((1000, 0, (None, data), ()),)))
    batch = pa.RecordBatch._import_from_c(address, _schema(pa.int64()))
    del capsule
    box = [batch]
    del batch
    # The release callback takes the GIL itself: dropping the last reference elsewhere is safe.
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    data.append(0)  # released: resizable again


@needs_c
@pytest.mark.parametrize(
    ("node", "error"),
    [
        ([1, 0, (), ()], TypeError),  # a list, not a tuple
        ((1, 0, ()), TypeError),  # three items
        ((1.0, 0, (), ()), TypeError),
        ((1, True, (), ()), TypeError),  # a bool is not an int
        ((1, 0, [None], ()), TypeError),
        ((1, 0, (), [()]), TypeError),
        ((-1, 0, (), ()), ValueError),
        ((1, 2, (), ()), ValueError),  # more nulls than rows
        ((1, -1, (), ()), ValueError),
        ((2**63, 0, (), ()), OverflowError),
        ((1, 0, (object(),), ()), TypeError),  # no buffer protocol
        ((1, 0, (np.zeros((4, 4))[:, 0],), ()), ValueError),  # not contiguous (numpy says so)
        ((1, 0, (), ((1, 0, (), ((1, 0, (), "x"),)),)), TypeError),  # deep and wrong
    ],
)
def test_build_array_refuses_malformed_nodes(node: Any, error: type) -> None:
    held = bytearray(16)
    root = (1, 0, (None,), ((1, 0, (None, held), ()), node))
    with pytest.raises(error):
        _speedups.build_array(root)
    held.append(0)  # every buffer taken before the error was given back


@needs_c
def test_build_array_refuses_too_deep_trees() -> None:
    node: Any = (0, 0, (), ())
    for _ in range(100):
        node = (0, 0, (), (node,))
    with pytest.raises(ValueError, match="deep"):
        _speedups.build_array(node)


# ----------------------------------------------------------------------------- record_batch


@pytest.fixture(params=["bridge", "import"])
def assembly(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, list[int]]:
    """The C path's two ways to make the batch: ``_arrowbridge.assemble`` (Arrow's C++
    library) and the import through pyarrow's API (where the bridge is not loaded, and for
    what it declines). Returns the route and the list that counts the import path's calls."""
    if request.param == "bridge" and _accel._bridge is None:
        pytest.skip(f"arrow_outputs._arrowbridge not loaded: {_accel.BRIDGE_UNAVAILABLE}")
    if request.param == "import":
        monkeypatch.setattr(_accel, "_bridge", None)
    imports: list[int] = []
    real = _accel._import_record_batch
    monkeypatch.setattr(_accel, "_import_record_batch", lambda *a: imports.append(1) or real(*a))
    return request.param, imports


@needs_c
@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.lstrip("_"))
def test_record_batch_c_assembly_runs_for_every_case(
    make: Any, monkeypatch: Any, assembly: tuple[str, list[int]]
) -> None:
    """The C path assembles every case itself (no fallback to the specification; the bridge
    declines none), and the nodes of every column describe it exactly
    (array_of(node_of(col)) == col)."""
    fallbacks = []
    spec = _pyspeedups.record_batch
    monkeypatch.setattr(_pyspeedups, "record_batch", lambda *a: fallbacks.append(1) or spec(*a))
    out = make()
    batch = _on("c", lambda: ao.to_record_batch(out, step=1))
    assert fallbacks == []
    route, imports = assembly
    assert (imports == []) is (route == "bridge")
    assert batch.equals(_on("python", lambda: ao.to_record_batch(out, step=1)))
    assert batch.schema.equals(
        _on("python", lambda: ao.to_record_batch(out, step=1)).schema, check_metadata=True
    )
    for col, field in zip(batch.columns, batch.schema):
        node = _pyspeedups.node_of(col)
        assert node is not None
        assert _pyspeedups.array_of(node, field.type).equals(col)


@needs_c
@pytest.mark.usefixtures("assembly")
def test_record_batch_falls_back_for_what_a_node_cannot_say() -> None:
    out = CASES[0]()
    batch = _on("python", lambda: ao.to_record_batch(out, step=1))
    schema, n = batch.schema, batch.num_rows
    cols: list[Any] = list(batch.columns)
    # A slice (offset 1), which no node can say: the C assembly adds it as the array it is
    # (add_column), and the answer is the same batch.
    bigger = pa.concat_arrays([cols[1], cols[1]]).slice(n, n)
    assert _pyspeedups.node_of(bigger) is None
    cols[1] = bigger
    got = _on("c", lambda: _accel.record_batch(cols, schema, n))
    assert got.equals(batch)
    # An array of another type than its field is never read as the field's type: the C path
    # hands it to the specification (from_arrays casts int64 -> int32 when it can, and
    # raises when it cannot), so both paths answer alike.
    cols[1] = batch.column(1)
    for wrong in (np.arange(n, dtype=np.int64), np.full(n, 2**40, dtype=np.int64)):
        cols[2] = pa.array(wrong)
        outcomes = []
        for path in ("c", "python"):
            try:
                outcomes.append(("ok", _on(path, lambda: _accel.record_batch(cols, schema, n))))
            except (pa.ArrowInvalid, TypeError, ValueError) as e:
                outcomes.append(("error", (type(e), str(e))))
        assert outcomes[0][0] == outcomes[1][0]
        if outcomes[0][0] == "ok":
            assert outcomes[0][1].equals(outcomes[1][1])
            assert outcomes[0][1].column(2).type == pa.int32()
        else:
            assert outcomes[0] == outcomes[1]


# ----------------------------------------------------------------------------- step JSON


def _raw(step: Any, rows: Any, rest: str) -> bytes:
    return b'{"step":%s,"rows":%s,%s}' % (
        json.dumps(step).encode(),
        json.dumps(rows).encode(),
        rest.encode(),
    )


def _rest_of(batch: pa.RecordBatch) -> str:
    raw = batch.schema.metadata[b"arrow_outputs.step"].decode()
    head = raw.index(',"', raw.index('"rows":'))
    return raw[head + 1 : -1]


def _full(raw: bytes) -> Any:
    try:
        return "ok", _stepmeta._parse(raw, "p", _SPEC)
    except StepMetadataError as e:
        return "error", str(e)


def _fast(raw: bytes) -> Any:
    try:
        return "ok", _stepmeta.parse(raw, "p", _SPEC)
    except StepMetadataError as e:
        return "error", str(e)


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(st.none(), st.integers(-(2**64), 2**64)),
    st.integers(-5, 2**33),
)
def test_step_json_reuse_gives_the_full_parse(step: int | None, rows: int) -> None:
    rest = _rest_of(ao.to_record_batch(CASES[0](), step=0))
    _fast(_raw(0, 1, rest))  # known from here on
    raw = _raw(step, rows, rest)
    assert _fast(raw) == _full(raw)


@pytest.mark.parametrize("dup", ['"step":7', '"rows":9', '"step":null'])
def test_step_json_reuse_never_hides_a_duplicate_key(dup: str) -> None:
    rest = _rest_of(ao.to_record_batch(CASES[0](), step=0)) + "," + dup
    for step in (1, 2):  # the second would be the reuse
        raw = _raw(step, 1, rest)
        assert _fast(raw) == _full(raw)
        if "step" in dup:
            assert _fast(raw)[1]["step"] == json.loads(dup.join("{}"))["step"]


def test_step_json_reuse_is_not_changed_by_callers() -> None:
    out = CASES[-1]()
    batch = ao.to_record_batch(out, step=3)
    meta = ao.step_metadata(batch)
    meta["dropped"].append({"field": "x", "type": "y"})
    meta["logprobs"] = "changed"
    for value in meta.values():
        if isinstance(value, dict):
            value.clear()
    again = ao.to_record_batch(out, step=4)
    assert ao.step_metadata(again)["dropped"] == []
    ao.assert_outputs_equal(ao.from_record_batch(again), out, strict=False)


def test_step_json_reuse_refuses_what_the_full_parse_refuses() -> None:
    rest = _rest_of(ao.to_record_batch(CASES[0](), step=0))
    for raw in (
        _raw(2**63, 1, rest),
        _raw(1, 2**31, rest),
        b'{"step":01,"rows":1,' + rest.encode() + b"}",
        b'{"step":1,"rows":1,' + rest.encode() + b"} ",
        b'{"step":1, "rows":1,' + rest.encode() + b"}",
        # The last tail's bytes at the end, after a head that is not only step and rows.
        b'{"step":1,"rows":1,"rows":5,' + rest.encode() + b"}",
        b'{"step":1,"rows":1,"x":2,' + rest.encode() + b"}",
        b'{"rows":1,"step":1,' + rest.encode() + b"}",
    ):
        _fast(_raw(0, 1, rest))
        _fast(_raw(1, 2, rest))  # the tail is now the last one used (_stepmeta._LAST_TAIL)
        assert _stepmeta._LAST_TAIL is not None
        assert _stepmeta._LAST_TAIL[1] == rest.encode() + b"}"
        assert _fast(raw) == _full(raw)
