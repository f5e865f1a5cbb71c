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

import threading
from typing import Any

import numpy as np
import pyarrow as pa

from ._torch import tensor_to_numpy
from .device import Staged, StagingPool
from .errors import FieldTypeError, ShapeError
from .outputs import AsyncModelRunnerOutput, KVConnectorOutput, LogprobsLists

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
    import torch

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
        self._slots: dict[str, int] = {"sampled": 0, "counts": 1}
        # Host tensors used where they are, as vLLM's to_cpu_nonblocking() leaves them.
        self._in_place: dict[str, Any] = {}

        def add(name: str, t: Any, *, always: bool = False) -> None:
            if t.device.type == "cpu" and not (always or copy_host):
                self._in_place[name] = t
                return
            self._slots[name] = len(tensors)
            tensors.append(t)

        num_nans = getattr(sampler_output, "num_nans", None)
        if num_nans is not None:
            # vLLM copies these (copy=True) whatever their device: the runner reuses them.
            add("num_nans", _tensor(num_nans, "sampler_output.num_nans"), always=True)
        lp = getattr(sampler_output, "logprobs_tensors", None)
        self._lp_cu = None
        if lp is not None:
            add("lp_ids", lp.logprob_token_ids)
            add("lp_values", lp.logprobs)
            add("lp_ranks", lp.selected_token_ranks)
            if getattr(lp, "cu_num_generated_tokens_tensor", None) is not None:
                add("lp_cu", lp.cu_num_generated_tokens_tensor)
            self._lp_cu = lp.cu_num_generated_tokens
        masks = getattr(sampler_output, "sampling_mask_tensors", None)
        self._masks = masks
        if masks is not None:
            add("mask_ids", masks.token_ids)
            add("mask_bits", masks.packed_mask)
            add("mask_counts", masks.counts)
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
        self._done = False

    # ------------------------------------------------------------------ staged views

    def _has(self, name: str) -> bool:
        return name in self._slots or name in self._in_place

    def _numpy(self, name: str) -> np.ndarray:
        if name in self._in_place:
            return tensor_to_numpy(self._in_place[name], name)
        return self._staged.numpy(self._slots[name])

    def _host_tensor(self, name: str) -> Any:
        if name in self._in_place:
            return self._in_place[name]
        return self._staged.tensor(self._slots[name])

    def _host_logprobs(self) -> LogprobsLists | None:
        if not self._has("lp_ids"):
            return None
        cu = self._lp_cu
        if self._has("lp_cu"):
            cu = self._numpy("lp_cu").tolist()
        return LogprobsLists(
            self._numpy("lp_ids"), self._numpy("lp_values"), self._numpy("lp_ranks"), cu
        )

    def _host_masks(self) -> Any:
        from .mask_tensors import SamplingMaskTensors

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
        sampled = self._numpy("sampled").tolist()
        for token_ids, n in zip(sampled, self._numpy("counts").tolist()):
            del token_ids[n:]
        out.sampled_token_ids = sampled
        if self._masks is not None:
            out.sampling_masks = self._host_masks().tolists(self._numpy("counts"))
        if self._has("num_nans"):
            out.num_nans_in_logits = dict(zip(out.req_ids, self._numpy("num_nans").tolist()))
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
        from .batch import encode_step

        self._finish_common()
        out = self.model_runner_output
        n = len(out.req_ids)
        padded = self._numpy("sampled")
        counts = self._numpy("counts").astype(np.int64)
        if padded.shape[0] != n:
            raise ShapeError(
                "sampler_output.sampled_token_ids", f"{n} rows (one per request)", str(len(padded))
            )
        prebuilt: dict[str, tuple[pa.Array, Any]] = {}
        # Sampled ids: the first counts[i] slots of row i, in row order (a boolean gather).
        keep = np.arange(padded.shape[1]) < counts[:, None]
        list_type = (
            pa.list_(pa.int64()) if schema is None else schema.field("sampled_token_ids").type
        )
        values = _ids_as(padded[keep], list_type.value_type)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        child = pa.Array.from_buffers(
            list_type.value_type, len(values), [None, pa.py_buffer(values)]
        )
        if n:  # a step without requests has sampled_token_ids == [], which the encoder knows
            prebuilt["sampled_token_ids"] = (
                pa.Array.from_buffers(
                    list_type, n, [None, pa.py_buffer(offsets)], children=[child]
                ),
                "lists",
            )
        if self._masks is not None:
            from .mask_tensors import mask_tensors_to_arrow

            masks = self._host_masks()
            arr = mask_tensors_to_arrow(masks, self._numpy("counts"))
            prebuilt["sampling_mask"] = (
                arr,
                {"offsets": True, "cu": getattr(masks, "rows_per_request", 1) > 1},
            )
        if self._has("num_nans"):
            nans = self._numpy("num_nans")[:n].astype(np.int32)
            valid = None
            if len(nans) < n:  # zip() in vLLM stops at the shorter: the rest have no entry
                valid = np.arange(n) < len(nans)
                nans = np.concatenate([nans, np.zeros(n - len(nans), np.int32)])
            mask = None if valid is None else ~valid
            prebuilt["num_nans_in_logits"] = (pa.array(nans, mask=mask), "dict")
        # The logprobs column's encoder is already zero-copy over these staged arrays.
        view = _OutputView(out, self._host_logprobs(), prebuilt)
        return encode_step(view, step=step, schema=schema, prebuilt=prebuilt)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        """The step's KV connector output; available even when conversion fails."""
        return self.model_runner_output.kv_connector_output


class _OutputView:
    """The model-runner output as the encoder reads it: the step's own fields, the staged
    logprobs, and placeholders where a column was prebuilt (the encoder skips those)."""

    def __init__(self, out: Any, logprobs: Any, prebuilt: dict[str, Any]) -> None:
        self._out = out
        if logprobs is not None:
            self.logprobs = logprobs
        self.sampled_token_ids: list[Any] = []
        if "sampling_mask" in prebuilt:
            self.sampling_masks = None
        if "num_nans_in_logits" in prebuilt:
            self.num_nans_in_logits = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def _ids_as(values: np.ndarray, arrow_type: pa.DataType) -> np.ndarray:
    """Sampled ids as the run's id type, refused (never wrapped) when out of its range."""
    target = np.dtype(str(arrow_type))
    if values.dtype == target:
        return np.ascontiguousarray(values)
    info = np.iinfo(target)
    if values.size and (values.min() < info.min or values.max() > info.max):
        from .errors import UnsupportedValueError

        raise UnsupportedValueError(
            "sampled_token_ids",
            f"token ids within {target} (the run's id type)",
            f"values from {values.min()} to {values.max()}",
        )
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
        from .batch import to_record_batch

        return to_record_batch(self.get_output(), step=step, schema=schema)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        return self.model_runner_output.kv_connector_output
