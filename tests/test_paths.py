"""The C accelerator and the pure-Python path give identical batches and identical errors.

Every module that exercises the codec already runs on both paths (the ``codec_path``
fixture); this one compares them directly: the same inputs through each path must give equal
record batches (schema and step metadata included), equal decoded outputs, and the same
exception class and message for every bad input of ``tests/test_errors.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import run_on as _on
from test_batch import CASES
from test_errors import FROM_RECORD_BATCH, TO_RECORD_BATCH

import arrow_outputs as ao
from arrow_outputs import _accel

pytestmark = pytest.mark.skipif(not _accel.AVAILABLE, reason="the C accelerator is not built")


def _outcome(path: str, call: Callable[[], Any]) -> Any:
    try:
        return "ok", _on(path, call)
    except ao.ArrowOutputsError as e:
        return "error", (type(e), str(e))


def _same_batch(a: pa.RecordBatch, b: pa.RecordBatch) -> None:
    assert a.schema.equals(b.schema, check_metadata=True)
    assert a.equals(b)


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.lstrip("_"))
def test_paths_encode_and_decode_identically(make: Callable[[], Any]) -> None:
    out = make()
    c = _on("c", lambda: ao.to_record_batch(out, step=3))
    py = _on("python", lambda: ao.to_record_batch(out, step=3))
    _same_batch(c, py)
    # Each path decodes each path's batch to the same output.
    for batch in (c, py):
        back_c = _on("c", lambda batch=batch: ao.from_record_batch(batch))
        back_py = _on("python", lambda batch=batch: ao.from_record_batch(batch))
        ao.assert_outputs_equal(back_c, back_py)
        ao.assert_outputs_equal(back_c, out, strict=False)


def _params(cases: list[Any]) -> Iterator[Any]:
    for p in cases:
        yield pytest.param(p.values[0].call, id=p.id)


@pytest.mark.parametrize("call", list(_params(TO_RECORD_BATCH + FROM_RECORD_BATCH)))
def test_paths_raise_identical_errors(call: Callable[[], Any]) -> None:
    c, py = _outcome("c", call), _outcome("python", call)
    assert c[0] == py[0] == "error"
    assert c[1] == py[1]


@pytest.mark.parametrize(
    "sampled",
    [
        [[1], [True]],
        [[1], [2.0]],
        [[1], (2,)],
        [[2**31], [1]],
        [[2**63], [1]],
        [[-(2**63) - 1], [1]],
        [[1], [2], [3]],
        [[1]],
    ],
    ids=str,
)
def test_paths_refuse_bad_sampled_ids_alike(sampled: list[Any]) -> None:
    out = ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, sampled)
    schema = ao.output_schema(ao.ColumnTypes(sampled_token_ids="int32"))
    outcomes = []
    for kw in ({}, {"schema": schema}):
        c = _outcome("c", lambda kw=kw: ao.to_record_batch(out, **kw))
        py = _outcome("python", lambda kw=kw: ao.to_record_batch(out, **kw))
        assert c[0] == py[0], (c, py)
        if c[0] == "ok":
            _same_batch(c[1], py[1])
        else:
            assert c[1] == py[1]
        outcomes.append(c[0])
    # Every case is out of range for int32 ids, or bad for any id type.
    assert outcomes[1] == "error"


@pytest.mark.parametrize(
    "req_ids",
    [["a", "\ud800"], ["a", 5], ["a", b"b"]],
    ids=["surrogate", "int", "bytes"],
)
def test_paths_refuse_bad_request_ids_alike(req_ids: list[Any]) -> None:
    out = ao.ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[1], [2]])
    c = _outcome("c", lambda: ao.to_record_batch(out))
    py = _outcome("python", lambda: ao.to_record_batch(out))
    assert c == py
    assert c[0] == "error"


def test_paths_unicode_request_ids_and_speculative_lists() -> None:
    req_ids = ["ascii", "é-ü", "日本", "🙂", ""]
    k = [1, 3, 0, 2, 4]
    out = ao.ModelRunnerOutput(
        req_ids,
        {r: i for i, r in enumerate(req_ids)},
        [list(range(100_000, 100_000 + x)) for x in k],
    )
    c = _on("c", lambda: ao.to_record_batch(out, step=1))
    py = _on("python", lambda: ao.to_record_batch(out, step=1))
    _same_batch(c, py)
    for path in ("c", "python"):
        back = _on(path, lambda: ao.from_record_batch(c.slice(1, 3)))
        assert back.req_ids == req_ids[1:4]
        assert back.sampled_token_ids == out.sampled_token_ids[1:4]
        assert all(type(v) is int for row in back.sampled_token_ids for v in row)
    assert np.asarray(c.column("req_index")).tolist() == list(range(5))
