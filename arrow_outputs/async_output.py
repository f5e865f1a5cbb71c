"""``AsyncArrowOutput``: vLLM 0.33 Model Runner V2's ``AsyncOutput``, with a record-batch exit.

vLLM's ``AsyncOutput`` (``vllm/v1/worker/gpu/async_utils.py``) starts non-blocking
device-to-host copies of the sampler's tensors on a side stream, and ``get_output()`` waits
and then turns the host copies into Python lists (sampled ids trimmed row by row, sampling
masks built by a loop over rows). This class takes the same arguments, stages the same
tensors into one slab of a :class:`~arrow_outputs.device.StagingPool`, and offers both exits:

- :meth:`AsyncArrowOutput.get_output` returns exactly the ``ModelRunnerOutput`` vLLM's would;
- :meth:`AsyncArrowOutput.get_record_batch` builds the step's record batch straight from the
  staged buffers with vectorised numpy: no per-row loop, no ``list[list[int]]``, and logprob
  columns that point into the slab.
"""

from __future__ import annotations

import dataclasses
import threading
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from . import _accel
from ._checks import arange_offsets, describe
from ._stepmeta import shared_layout
from ._torch import host_numpy
from .batch import _refuse_unknown_fields, encode_staged_step, encode_step, to_record_batch
from .device import Staged, StagingPool, _torch
from .errors import (
    ConsistencyError,
    DTypeError,
    FieldTypeError,
    ShapeError,
    UnsupportedValueError,
)
from .mask_tensors import SamplingMaskTensors, mask_array_supports
from .mask_tensors import _ramp as ramp_of
from .masks import SAMPLING_MASK_TYPE
from .outputs import (
    AsyncModelRunnerOutput,
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
)

__all__ = ["AsyncArrowOutput"]

_POOL: StagingPool | None = None
_POOL_LOCK = threading.Lock()


def default_pool() -> StagingPool:
    """The process's shared pool (made on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = StagingPool()
        return _POOL


def _tensor(x: Any, field: str) -> Any:
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise FieldTypeError(field, "a torch tensor", type(x).__name__)


class AsyncArrowOutput(AsyncModelRunnerOutput):
    """The async output of one engine step, staged through pinned host slabs.

    Parameters
    ----------
    model_runner_output
        The step's ``ModelRunnerOutput`` (``req_ids``, ``req_id_to_index``, prompt logprobs,
        connector outputs...), completed by :meth:`get_output` as vLLM's ``AsyncOutput`` does.
    sampler_output
        Duck typed on MRv2's ``SamplerOutput``: ``sampled_token_ids`` int64
        ``[num_reqs, num_spec + 1]`` (slots past a request's count are never read),
        ``logprobs_tensors``, ``num_nans``, ``sampling_mask_tensors`` (each may be None).
    num_sampled_tokens
        int32 ``[num_reqs]``: how many slots of each row were sampled.
    main_stream, copy_stream
        CUDA streams (optional): the copies run on ``copy_stream`` after ``main_stream``'s work.
    pool
        The :class:`~arrow_outputs.device.StagingPool` to stage into (a shared one by default).
    copy_host
        Stage host (CPU) tensors too. By default they are used where they are, as vLLM's
        ``to_cpu_nonblocking()`` leaves them (the batch then views them); the sampled ids,
        their counts and the NaN counts are always copied, as vLLM copies them.
    """

    def __init__(
        self,
        model_runner_output: Any,
        sampler_output: Any,
        num_sampled_tokens: Any,
        *,
        main_stream: Any = None,
        copy_stream: Any = None,
        pool: StagingPool | None = None,
        copy_host: bool = False,
    ) -> None:
        self.model_runner_output = model_runner_output
        self.sampler_output = sampler_output
        self.num_sampled_tokens = num_sampled_tokens
        sampled = _tensor(sampler_output.sampled_token_ids, "sampler_output.sampled_token_ids")
        counts = _tensor(num_sampled_tokens, "num_sampled_tokens")
        if sampled.ndim != 2 or counts.ndim != 1 or counts.shape[0] != sampled.shape[0]:
            raise ShapeError(
                "num_sampled_tokens",
                f"one count per row of sampled_token_ids {tuple(sampled.shape)}",
                f"shape {tuple(counts.shape)}",
            )
        tensors = [sampled, counts]
        slots = self._slots = {"sampled": 0, "counts": 1}
        # Host tensors used where they are, as vLLM's to_cpu_nonblocking() leaves them; the
        # rest staged (at slots[name] in the slab).
        in_place: dict[str, Any] = {}
        self._in_place = in_place
        named: list[tuple[str, Any]] = []
        num_nans = getattr(sampler_output, "num_nans", None)
        if num_nans is not None:
            # vLLM copies these (copy=True) whatever their device: the runner reuses them.
            slots["num_nans"] = len(tensors)
            tensors.append(_tensor(num_nans, "sampler_output.num_nans"))
        lp = getattr(sampler_output, "logprobs_tensors", None)
        self._lp_cu = None
        if lp is not None:
            named += (
                ("lp_ids", lp.logprob_token_ids),
                ("lp_values", lp.logprobs),
                ("lp_ranks", lp.selected_token_ranks),
            )
            cu = getattr(lp, "cu_num_generated_tokens_tensor", None)
            if cu is not None:
                named.append(("lp_cu", cu))
            self._lp_cu = lp.cu_num_generated_tokens
        masks = getattr(sampler_output, "sampling_mask_tensors", None)
        self._masks = masks
        if masks is not None:
            named += (
                ("mask_ids", masks.token_ids),
                ("mask_bits", masks.packed_mask),
                ("mask_counts", masks.counts),
            )
        for name, t in named:
            if t.is_cpu and not copy_host:
                in_place[name] = t
            else:
                slots[name] = len(tensors)
                tensors.append(t)
        self._staged: Staged = (pool or default_pool()).stage(
            tensors, stream=copy_stream, main_stream=main_stream
        )
        # Per-request prompt tensors are small and irregular: copied as vLLM copies them.
        self._prompt = {
            k: None if v is None else v.to_cpu_nonblocking()
            for k, v in model_runner_output.prompt_logprobs_dict.items()
        }
        self._prompt_ids = {
            k: v.to("cpu", non_blocking=True)
            for k, v in getattr(model_runner_output, "prompt_token_id_logprobs_dict", {}).items()
        }
        self._arrays: dict[str, np.ndarray] | None = None  # _views()

    # ------------------------------------------------------------------ staged views

    def _views(self) -> dict[str, np.ndarray]:
        """Every tensor's host numpy array by name, made once (read them after the copies
        have landed): the staged ones over one Arrow buffer of the slab, the ones used in
        place as views of their tensors."""
        views = self._arrays
        if views is None:
            arrays = self._staged.arrays()
            views = {name: arrays[i] for name, i in self._slots.items()}
            for name, t in self._in_place.items():
                views[name] = host_numpy(t, name)
            self._arrays = views
        return views

    def _host_tensor(self, name: str) -> Any:
        if name in self._in_place:
            return self._in_place[name]
        return self._staged.tensor(self._slots[name])

    def _host_logprobs(self) -> LogprobsLists | None:
        v = self._views()
        if "lp_ids" not in v:
            return None
        cu = self._lp_cu
        if "lp_cu" in v:
            cu = v["lp_cu"].tolist()
        return LogprobsLists(v["lp_ids"], v["lp_values"], v["lp_ranks"], cu)

    def _host_masks(self) -> Any:
        m = self._masks
        if m is None:
            return None
        return SamplingMaskTensors(
            self._host_tensor("mask_ids"),
            self._host_tensor("mask_bits"),
            self._host_tensor("mask_counts"),
            m.vocab_size,
            getattr(m, "rows_per_request", 1),
        )

    def _finish_common(self) -> None:
        """What both exits set on the model-runner output (as vLLM's get_output does)."""
        self._staged.wait()
        out = self.model_runner_output
        out.prompt_logprobs_dict = self._prompt
        out.prompt_token_id_logprobs_dict = self._prompt_ids

    # ------------------------------------------------------------------ the exits

    def get_output(self) -> Any:
        """The step's ``ModelRunnerOutput``, exactly as vLLM 0.33's ``AsyncOutput`` makes it."""
        self._finish_common()
        out = self.model_runner_output
        v = self._views()
        sampled = v["sampled"].tolist()
        for token_ids, n in zip(sampled, v["counts"].tolist()):
            del token_ids[n:]
        out.sampled_token_ids = sampled
        if self._masks is not None:
            out.sampling_masks = self._host_masks().tolists(v["counts"])
        if "num_nans" in v:
            out.num_nans_in_logits = dict(zip(out.req_ids, v["num_nans"].tolist()))
        lp = self._host_logprobs()
        if lp is not None:
            out.logprobs = lp
        return out

    def get_record_batch(
        self, *, step: int | None = None, schema: pa.Schema | None = None
    ) -> pa.RecordBatch:
        """The step's record batch, built from the staged buffers with vectorised numpy.

        Equal to ``to_record_batch(get_output(), step=step, schema=schema)``, without the
        Python lists; the logprob columns' values are the staged slab's memory (zero-copy),
        which stays leased while the batch (or anything made from it) lives.
        """
        self._finish_common()
        out = self.model_runner_output
        n = len(out.req_ids)
        v = self._views()
        padded = v["sampled"]
        counts = v["counts"]
        if padded.shape[0] != n:
            raise ShapeError(
                "sampler_output.sampled_token_ids", f"{n} rows (one per request)", str(len(padded))
            )
        # Columns as the encoder's own would be: nodes for its C assembly, else arrays.
        as_nodes = _as_nodes()
        prebuilt: dict[str, tuple[Any, Any]] = {}
        if n:  # a step without requests has sampled_token_ids == [], which the encoder knows
            list_type = _SAMPLED_TYPE if schema is None else schema.field("sampled_token_ids").type
            prebuilt["sampled_token_ids"] = (
                _sampled_column(padded, counts, list_type, as_nodes),
                "lists",
            )
        if self._masks is not None:
            prebuilt["sampling_mask"] = _mask_column(self._masks, v, counts, as_nodes)
        if "num_nans" in v:
            prebuilt["num_nans_in_logits"] = (_nans_column(v["num_nans"], n, as_nodes), "dict")
        # The logprobs column's encoder is already zero-copy over these staged arrays.
        lp = self._host_logprobs()
        # Fields the format has no place for are refused by name, as the encoder would.
        _refuse_unknown_fields(out, ModelRunnerOutput, "output")
        if as_nodes:
            batch = encode_staged_step(out, lp, prebuilt, step=step, schema=schema)
            if batch is not None:
                return batch
        view = _output_view(out, lp, prebuilt)
        return encode_step(view, step=step, schema=schema, prebuilt=prebuilt)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        """The step's KV connector output; available even when conversion fails."""
        return self.model_runner_output.kv_connector_output


# The fields the encoder reads from the model-runner output itself; every other one is
# prebuilt or staged.
_OWN_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelRunnerOutput)
    if f.name not in ("sampled_token_ids", "logprobs", "sampling_masks", "num_nans_in_logits")
)


_UNSET = object()


def _output_view(out: Any, logprobs: Any, prebuilt: dict[str, Any]) -> ModelRunnerOutput:
    """The model-runner output as the encoder reads it: a shallow ``ModelRunnerOutput`` with
    the step's own fields, the staged logprobs, and empty placeholders where a column was
    prebuilt (the encoder skips those). A field ``out`` lacks (an older vLLM's object) stays
    unset, and the encoder takes its default as it would from ``out``. Plain attributes: a
    delegating ``__getattr__`` costs a failed lookup per field read."""
    view = ModelRunnerOutput.__new__(ModelRunnerOutput)
    d = view.__dict__
    for name in _OWN_FIELDS:
        value = getattr(out, name, _UNSET)
        if value is not _UNSET:
            d[name] = value
    d["sampled_token_ids"] = []
    if logprobs is not None:
        d["logprobs"] = logprobs
    elif hasattr(out, "logprobs"):
        d["logprobs"] = out.logprobs
    for column, name in (("sampling_mask", "sampling_masks"), ("num_nans_in_logits",) * 2):
        if column in prebuilt:
            d[name] = None
        elif hasattr(out, name):
            d[name] = getattr(out, name)
    return view


_SAMPLED_TYPE = pa.list_(pa.int64())  # the sampled-ids column of an inferred schema
_SAMPLED_VALUE_TYPE = _SAMPLED_TYPE.value_type  # a property that makes a new object per call
_NANS_TYPE = pa.int32()

# A column as the batch codec's own encoders hand it over: a node (length, null_count,
# buffers, children) when the codec assembles the batch in C, else a pyarrow array.
Node = tuple[int, int, tuple[Any, ...], tuple[Any, ...]]


def _as_nodes() -> bool:
    """Whether prebuilt columns go to the encoder as nodes (its C assembly is in use)."""
    return _accel.accelerated() and hasattr(_accel, "record_batch")


def _column(node: Node, arrow_type: pa.DataType, as_nodes: bool) -> Any:
    return node if as_nodes else _array_of(node, arrow_type)


def _array_of(node: Node, arrow_type: pa.DataType) -> pa.Array:
    """The pyarrow array a node describes (``Array.from_buffers``, no copy)."""
    length, null_count, buffers, children = node
    kids = [_array_of(k, arrow_type.field(i).type) for i, k in enumerate(children)]
    bufs = [b if b is None or isinstance(b, pa.Buffer) else pa.py_buffer(b) for b in buffers]
    return pa.Array.from_buffers(arrow_type, length, bufs, null_count=null_count, children=kids)


@lru_cache(maxsize=64)
def _uniform_offsets(n: int, step: int) -> np.ndarray:
    """``[0, step, ..., n * step]`` int32 (steps repeat their sizes: cached, read-only)."""
    return arange_offsets(n, step)


def _sampled_column(
    padded: np.ndarray, counts: np.ndarray, list_type: pa.DataType, as_nodes: bool
) -> Any:
    """The sampled-ids column: row i's first ``counts[i]`` slots of ``padded``, as vLLM's
    ``del row[counts[i]:]`` keeps them (a count past the row keeps the whole row).

    int64 ids with int32 counts (what vLLM stages) take one walk in C
    (``_accel.sampled_rows``); elsewhere a decode step (every count equal) takes one strided
    copy, any other step one boolean gather over ``[rows, slots]``.
    """
    n, width = padded.shape
    value_type = _SAMPLED_VALUE_TYPE if list_type is _SAMPLED_TYPE else list_type.value_type
    if _id_dtype(value_type) is _NP_INT64:
        # One walk in C (or its twin) for int64 ids and 1-D int32 counts, first; None sends
        # anything else (a negative count too) to the checks below and their precise errors.
        got = _accel.sampled_rows(padded, counts)
        if got is not None:
            ids, ragged, k = got
            child = (len(ids) // 8, 0, (None, ids), ())
            outer = _uniform_offsets(n, k) if ragged is None else ragged
            return _column((n, 0, (None, outer), (child,)), list_type, as_nodes)
    if counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise FieldTypeError("num_sampled_tokens", "a 1-D integer tensor", describe(counts))
    lo, hi = _count_range(counts)
    if lo < 0:
        i = int(np.argmax(counts < 0))
        raise ConsistencyError(f"num_sampled_tokens[{i}]", "a count >= 0", str(int(counts[i])))
    if lo == hi or lo >= width:
        # Uniform rows: every row keeps k slots, one strided copy. A copy even when k is the
        # width: a few KiB, and the batch then leaves the slab free for the next step.
        k = min(lo, width)
        values = _ids_as(padded[:, :k], value_type, copy=True).reshape(-1)
        offsets = _uniform_offsets(n, k)
    else:
        keep = _ramp(width) < counts[:, None]
        values = _ids_as(padded[keep], value_type)
        offsets = np.empty(n + 1, dtype=np.int32)
        offsets[0] = 0
        np.cumsum(np.minimum(counts, width), out=offsets[1:])
    node = (n, 0, (None, offsets), ((values.size, 0, (None, values), ()),))
    return _column(node, list_type, as_nodes)


def _count_range(counts: np.ndarray) -> tuple[int, int]:
    """The smallest and largest count (of at least one). A step whose counts all equal the
    first, as every decode step's do, is recognised by one comparison of its bytes with the
    first count's repeated: a few times cheaper than the two reductions, which the other
    steps take."""
    raw = counts.tobytes()
    size = counts.itemsize
    if raw == raw[:size] * len(counts):
        first = int(counts[0])
        return first, first
    # The ufuncs' reduce: ndarray.min/max add a Python-level wrapper each.
    return int(_MIN(counts)), int(_MAX(counts))


def _nans_column(nans: np.ndarray, n: int, as_nodes: bool) -> Any:
    """int32 NaN counts, one per request; zip() in vLLM stops at the shorter, so requests past
    the tensor's length have no entry (null)."""
    if nans.ndim != 1:
        raise ShapeError("sampler_output.num_nans", "a 1-D tensor", f"shape {nans.shape}")
    # Copied, as the sampled ids: the batch does not hold the slab for a few bytes. int32
    # counts for every request (what vLLM stages) in one C call; the rest below.
    head = _accel.int32_head(nans, n)
    if head is not None:
        return _column((n, 0, (None, head), ()), _NANS_TYPE, as_nodes)
    values = _ints_as(
        nans[:n], _NP_INT32, "sampler_output.num_nans", "counts within int32", copy=True
    )
    k = len(values)
    if k == n:
        return _column((n, 0, (None, values), ()), _NANS_TYPE, as_nodes)
    padded = np.zeros(n, np.int32)
    padded[:k] = values
    validity = np.packbits(_ramp(n) < k, bitorder="little")
    return _column((n, n - k, (validity, padded), ()), _NANS_TYPE, as_nodes)


def _mask_column(
    masks: Any, views: dict[str, np.ndarray], counts: np.ndarray, as_nodes: bool
) -> tuple[Any, Any]:
    """The sampling-mask column (and its layout) from the staged mask arrays: compact rows
    selected by their counts, wide rows read from the bitmask (``mask_array_supports``,
    whose C walk runs first and whose checks raise the precise error when it declines)."""
    rpr = getattr(masks, "rows_per_request", 1)
    ids, inner, outer = mask_array_supports(
        views["mask_ids"], views["mask_bits"], views["mask_counts"], masks.vocab_size, rpr, counts
    )
    node = (
        len(outer) - 1,
        0,
        (None, outer),
        ((len(inner) - 1, 0, (None, inner), ((len(ids), 0, (None, ids), ()),)),),
    )
    return _column(node, SAMPLING_MASK_TYPE, as_nodes), shared_layout(offsets=True, cu=rpr > 1)


def _ramp(n: int) -> np.ndarray:
    return ramp_of(n, np.int64)


def _ids_as(values: np.ndarray, arrow_type: pa.DataType, *, copy: bool = False) -> np.ndarray:
    """Sampled ids as the run's id type, refused (never wrapped) when out of its range.

    A schema of another id type gets int64 here; the encoder then refuses that schema with
    the precise error."""
    target = _id_dtype(arrow_type)
    if values.dtype == target:  # the common case, before the message is formatted
        return values.copy() if copy else np.ascontiguousarray(values)
    what = f"token ids within {target} (the run's id type)"
    return _ints_as(values, target, "sampled_token_ids", what, copy=copy)


def _id_dtype(arrow_type: pa.DataType) -> np.dtype[Any]:
    """The numpy dtype sampled ids take for the run's id type (int64 for any other type,
    which the encoder then refuses with the precise error)."""
    if arrow_type is _SAMPLED_VALUE_TYPE:
        return _NP_INT64
    return _NP_OF.get(arrow_type.id, _NP_INT64)


_NP_OF: dict[int, np.dtype[Any]] = {
    pa.int32().id: np.dtype(np.int32),
    pa.int64().id: np.dtype(np.int64),
}
_NP_INT64 = _NP_OF[pa.int64().id]
_NP_INT32 = _NP_OF[pa.int32().id]
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def _ints_as(
    values: np.ndarray, target: np.dtype, field: str, what: str, *, copy: bool = False
) -> np.ndarray:
    """Integers as ``target`` (contiguous; a new array with ``copy``), refused (never wrapped)
    when out of its range (``what`` says the expected range in the message)."""
    if values.dtype == target:
        return values.copy() if copy else np.ascontiguousarray(values)
    if values.dtype.kind not in "iu":
        raise DTypeError(field, "integers", str(values.dtype))
    info = np.iinfo(target)
    if values.size and (values.min() < info.min or values.max() > info.max):
        raise UnsupportedValueError(field, what, f"values from {values.min()} to {values.max()}")
    return values.astype(target)


class AsyncArrowPoolingOutput(AsyncModelRunnerOutput):
    """vLLM 0.33's ``AsyncPoolingOutput``, staged through a :class:`StagingPool`.

    A pooler tensor whose requests all finished is copied whole (its rows come back as views
    of one tensor, so the record batch's tensor column is that memory, no per-row copy); else
    each finished request's row is copied and unfinished ones are None, as in vLLM.
    """

    def __init__(
        self,
        model_runner_output: Any,
        pooler_output: Any,
        finished_mask: list[bool],
        *,
        main_stream: Any = None,
        copy_stream: Any = None,
        pool: StagingPool | None = None,
    ) -> None:
        import torch

        self.model_runner_output = model_runner_output
        self.pooler_output = pooler_output
        count = pooler_output.shape[0] if isinstance(pooler_output, torch.Tensor) else None
        if count is None and not isinstance(pooler_output, list):
            raise FieldTypeError(
                "pooler_output", "a tensor or a list", type(pooler_output).__name__
            )
        if len(finished_mask) != (len(pooler_output) if count is None else count):
            raise ShapeError(
                "finished_mask", "one flag per pooler output row", str(len(finished_mask))
            )
        self._whole = count is not None and all(finished_mask)
        if self._whole:
            rows = [pooler_output]
            self._where: list[int | None] = [0]
        else:
            outputs = (
                pooler_output.unbind() if isinstance(pooler_output, torch.Tensor) else pooler_output
            )
            rows, self._where = [], []
            for output, finished in zip(outputs, finished_mask):
                if output is None or not finished:
                    self._where.append(None)
                else:
                    self._where.append(len(rows))
                    rows.append(output)
        self._staged = (pool or default_pool()).stage(
            rows, stream=copy_stream, main_stream=main_stream
        )

    def get_output(self) -> Any:
        self._staged.wait()
        if self._whole:
            pooler = list(self._staged.tensor(0).unbind(dim=0))
        else:
            pooler = [None if i is None else self._staged.tensor(i) for i in self._where]
        self.model_runner_output.pooler_output = pooler
        return self.model_runner_output

    def get_record_batch(
        self, *, step: int | None = None, schema: pa.Schema | None = None
    ) -> pa.RecordBatch:
        """The step's record batch; the pooler column is the staged slab's memory when the
        rows are consecutive there (always for a whole tensor)."""
        return to_record_batch(self.get_output(), step=step, schema=schema)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        return self.model_runner_output.kv_connector_output
