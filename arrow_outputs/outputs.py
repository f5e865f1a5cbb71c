"""The model-runner output data model of vLLM v1, without importing torch.

This module re-implements ``vllm/v1/outputs.py`` (vLLM 0.33): the same class names, the
same field names, field order and defaults, and the same method behaviour, so that
objects built here and objects built by vLLM are interchangeable for this library.

Two things differ from vLLM:

* ``import arrow_outputs.outputs`` does not import torch. The few methods that need
  torch (on :class:`LogprobsTensors`) import it when they are called.
* Where vLLM checks its inputs with ``assert``, this module raises an
  :class:`~arrow_outputs.errors.ArrowOutputsError` subclass with a readable message, so
  the checks survive ``python -O``.

Examples
--------
The shared empty output is returned as is when there is nothing to carry:

>>> ModelRunnerOutput.with_kv_conn_output_only(None) is EMPTY_MODEL_RUNNER_OUTPUT
True
>>> ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput()) is EMPTY_MODEL_RUNNER_OUTPUT
True
>>> out = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending={"a"}))
>>> out is EMPTY_MODEL_RUNNER_OUTPUT, EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None
(False, True)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from copy import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

import numpy as np

from arrow_outputs.errors import ConsistencyError, ShapeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AsyncModelRunnerOutput",
    "AuxRequestOutput",
    "CUDAGraphStat",
    "DraftTokenIds",
    "ECConnectorOutput",
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "KVConnectorOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "ModelRunnerOutput",
    "PoolerOutput",
    "SamplerOutput",
    "SamplingMaskLists",
    "make_empty_encoder_model_runner_output",
]


PoolerOutput: TypeAlias = "torch.Tensor | list[torch.Tensor] | list[torch.Tensor | None]"
"""Pooling-model output: one tensor, or one tensor (or ``None``) per request."""


def _describe(value: Any) -> str:
    """Describe ``value`` briefly for an error message (tensors by shape, not contents)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class LogprobsLists(NamedTuple):
    """Sampled logprobs on the host, as numpy arrays.

    Attributes
    ----------
    logprob_token_ids : numpy.ndarray
        ``[num_positions, max_num_logprobs + 1]`` token ids.
    logprobs : numpy.ndarray
        ``[num_positions, max_num_logprobs + 1]`` logprobs of those tokens.
    sampled_token_ranks : numpy.ndarray
        ``[num_positions]`` rank of the sampled token.
    cu_num_generated_tokens : list of int or None
        ``[num_reqs + 1]`` cumulative positions per request, or ``None`` when every
        request has exactly one position.

    Examples
    --------
    >>> import numpy as np
    >>> lists = LogprobsLists(
    ...     np.arange(10).reshape(5, 2), np.zeros((5, 2)), np.arange(5), [0, 2, 5]
    ... )
    >>> part = lists.slice_request(1, 3)
    >>> part.sampled_token_ranks.tolist(), part.cu_num_generated_tokens
    ([2, 3, 4], None)
    >>> LogprobsLists(np.arange(10).reshape(5, 2), np.zeros((5, 2)), np.arange(5)).slice_request(
    ...     1, 1
    ... ).sampled_token_ranks.tolist()
    [1]
    """

    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int) -> LogprobsLists:
        """Return the rows of one request.

        Parameters
        ----------
        req_idx : int
            Index of the request in the batch.
        num_positions : int
            Number of positions (generated tokens) the request has.

        Returns
        -------
        LogprobsLists
            Rows ``start:start + num_positions``, where ``start`` is
            ``cu_num_generated_tokens[req_idx]`` when that is set and ``req_idx``
            otherwise; ``cu_num_generated_tokens`` of the result is ``None``.
        """
        cu = self.cu_num_generated_tokens
        start = req_idx if cu is None else cu[req_idx]
        end = start + num_positions
        return LogprobsLists(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
            None,
        )


class LogprobsTensors(NamedTuple):
    """Sampled or prompt logprobs as torch tensors (possibly on a device).

    Attributes
    ----------
    logprob_token_ids : torch.Tensor
        ``[num_reqs x num_generated_tokens, max_num_logprobs + 1]`` token ids.
    logprobs : torch.Tensor
        ``[num_reqs x num_generated_tokens, max_num_logprobs + 1]`` logprobs.
    selected_token_ranks : torch.Tensor
        ``[num_reqs x num_generated_tokens]`` rank of the selected token.
    cu_num_generated_tokens : list of int or None
        ``[num_reqs + 1]`` cumulative positions per request.
    cu_num_generated_tokens_tensor : torch.Tensor or None
        ``[num_reqs + 1]``; set instead of ``cu_num_generated_tokens`` when the
        boundaries only exist on the device (adaptive verification). It rides along on
        the asynchronous device-to-host copy.
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor
    cu_num_generated_tokens: list[int] | None = None
    cu_num_generated_tokens_tensor: torch.Tensor | None = None

    def tolists(self, cu_num_generated_tokens: list[int] | None = None) -> LogprobsLists:
        """Copy to the host as :class:`LogprobsLists`.

        Parameters
        ----------
        cu_num_generated_tokens : list of int, optional
            Request boundaries for the result. When ``None``, the boundaries come from
            ``cu_num_generated_tokens_tensor`` if set, else from
            ``cu_num_generated_tokens``.

        Returns
        -------
        LogprobsLists
            The three tensors as numpy arrays (same values and dtypes).
        """
        if cu_num_generated_tokens is None:
            if self.cu_num_generated_tokens_tensor is not None:
                cu_num_generated_tokens = self.cu_num_generated_tokens_tensor.tolist()
            else:
                cu_num_generated_tokens = self.cu_num_generated_tokens
        return LogprobsLists(
            self.logprob_token_ids.cpu().numpy(),
            self.logprobs.cpu().numpy(),
            self.selected_token_ranks.cpu().numpy(),
            cu_num_generated_tokens,
        )

    def to_cpu_nonblocking(self) -> LogprobsTensors:
        """Start a non-blocking copy to the CPU.

        Returns
        -------
        LogprobsTensors
            ``self`` when ``logprob_token_ids`` is already on the CPU; otherwise new
            tensors whose contents are valid once the copy stream is synchronised.
        """
        if self.logprob_token_ids.device.type == "cpu":
            return self
        cu_tensor = self.cu_num_generated_tokens_tensor
        if cu_tensor is not None:
            cu_tensor = cu_tensor.to("cpu", non_blocking=True)
        return LogprobsTensors(
            self.logprob_token_ids.to("cpu", non_blocking=True),
            self.logprobs.to("cpu", non_blocking=True),
            self.selected_token_ranks.to("cpu", non_blocking=True),
            self.cu_num_generated_tokens,
            cu_tensor,
        )

    def filter(self, mask: torch.Tensor) -> LogprobsTensors:
        """Filter the logprobs tensors with the given bool mask.

        Parameters
        ----------
        mask : torch.Tensor
            Boolean ``[num_positions]`` mask of the rows to keep.

        Returns
        -------
        LogprobsTensors
            The kept rows, without request boundaries.

        Raises
        ------
        ConsistencyError
            If ``cu_num_generated_tokens`` or ``cu_num_generated_tokens_tensor`` is set:
            a mask over positions would invalidate the boundaries.
        """
        if self.cu_num_generated_tokens is not None:
            raise ConsistencyError(
                "cu_num_generated_tokens",
                "None (filter works on one position per request)",
                _describe(self.cu_num_generated_tokens),
            )
        if self.cu_num_generated_tokens_tensor is not None:
            raise ConsistencyError(
                "cu_num_generated_tokens_tensor",
                "None (filter works on one position per request)",
                _describe(self.cu_num_generated_tokens_tensor),
            )
        return LogprobsTensors(
            self.logprob_token_ids[mask],
            self.logprobs[mask],
            self.selected_token_ranks[mask],
        )

    @staticmethod
    def cat(
        tensors: Sequence[LogprobsTensors],
        cu_num_generated_tokens: list[int] | None = None,
    ) -> LogprobsTensors:
        """Concatenate flattened logprob tensors.

        Parameters
        ----------
        tensors : sequence of LogprobsTensors
            The chunks, in order; at least one.
        cu_num_generated_tokens : list of int, optional
            Request boundaries of the result. Required when any chunk carries
            ``cu_num_generated_tokens``.

        Returns
        -------
        LogprobsTensors
            With a single chunk: that chunk itself when ``cu_num_generated_tokens`` is
            ``None``, else a copy with it replaced. With several: the concatenation.

        Raises
        ------
        ShapeError
            If ``tensors`` is empty.
        ConsistencyError
            If a chunk carries ``cu_num_generated_tokens`` but none is given, or if
            several chunks are given and one carries ``cu_num_generated_tokens_tensor``.
        """
        if len(tensors) == 0:
            raise ShapeError("tensors", "at least one LogprobsTensors", "an empty sequence")
        if cu_num_generated_tokens is None:
            for i, tensor in enumerate(tensors):
                if tensor.cu_num_generated_tokens is not None:
                    raise ConsistencyError(
                        "cu_num_generated_tokens",
                        "a list of request boundaries when an input carries them",
                        f"None while tensors[{i}].cu_num_generated_tokens is "
                        f"{_describe(tensor.cu_num_generated_tokens)}",
                    )
        if len(tensors) == 1:
            tensor = tensors[0]
            if cu_num_generated_tokens is None:
                return tensor
            return tensor._replace(cu_num_generated_tokens=cu_num_generated_tokens)
        # Several chunks: the boundaries are rebuilt from the CPU layout, which the
        # device-only boundaries of adaptive verification never use.
        for i, tensor in enumerate(tensors):
            if tensor.cu_num_generated_tokens_tensor is not None:
                raise ConsistencyError(
                    f"tensors[{i}].cu_num_generated_tokens_tensor",
                    "None when concatenating several chunks",
                    _describe(tensor.cu_num_generated_tokens_tensor),
                )
        import torch

        return LogprobsTensors(
            logprob_token_ids=torch.cat([tensor.logprob_token_ids for tensor in tensors]),
            logprobs=torch.cat([tensor.logprobs for tensor in tensors]),
            selected_token_ranks=torch.cat([tensor.selected_token_ranks for tensor in tensors]),
            cu_num_generated_tokens=cu_num_generated_tokens,
        )

    @staticmethod
    def empty_cpu(num_positions: int, num_tokens_per_position: int) -> LogprobsTensors:
        """Create empty LogprobsTensors on CPU.

        Parameters
        ----------
        num_positions : int
            Number of rows.
        num_tokens_per_position : int
            Number of columns (``max_num_logprobs + 1``).

        Returns
        -------
        LogprobsTensors
            Uninitialised int32 token ids, float32 logprobs and int32 ranks, in pinned
            memory when CUDA is available.
        """
        import torch

        pin_memory = torch.cuda.is_available()
        logprob_token_ids = torch.empty(
            (num_positions, num_tokens_per_position),
            dtype=torch.int32,
            device="cpu",
            pin_memory=pin_memory,
        )
        logprobs = logprob_token_ids.new_empty(
            (num_positions, num_tokens_per_position),
            dtype=torch.float32,
            pin_memory=pin_memory,
        )
        selected_token_ranks = logprob_token_ids.new_empty(num_positions, pin_memory=pin_memory)
        return LogprobsTensors(
            logprob_token_ids=logprob_token_ids,
            logprobs=logprobs,
            selected_token_ranks=selected_token_ranks,
        )


class SamplingMaskLists(NamedTuple):
    """CSR sampling masks; a request slice may contain multiple positions.

    Attributes
    ----------
    token_ids : numpy.ndarray
        ``[num_kept_tokens]`` the allowed token ids of every position, concatenated.
    offsets : numpy.ndarray or None
        ``[num_positions + 1]`` CSR offsets into ``token_ids``, or ``None`` for a single
        position.
    cu_num_generated_tokens : list of int or None
        ``[num_requests + 1]`` cumulative positions per request, for multi-position
        request batches.

    Examples
    --------
    >>> import numpy as np
    >>> masks = SamplingMaskLists(
    ...     np.array([5, 6, 7, 8, 9]), np.array([0, 2, 2, 5]), [0, 1, 3]
    ... )
    >>> masks.to_nested_list()
    [[5, 6], [], [7, 8, 9]]
    >>> masks.slice_request(0, 1)
    SamplingMaskLists(token_ids=array([5, 6]), offsets=None, cu_num_generated_tokens=None)
    >>> masks.slice_request(1, 2).offsets.tolist()
    [0, 0, 3]
    >>> SamplingMaskLists(np.array([1, 2])).to_nested_list()
    [[1, 2]]
    """

    token_ids: np.ndarray
    offsets: np.ndarray | None = None
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int) -> SamplingMaskLists:
        """Return the masks of one request.

        Parameters
        ----------
        req_idx : int
            Index of the request in the batch.
        num_positions : int
            Number of positions the request has.

        Returns
        -------
        SamplingMaskLists
            For one position, its token ids with ``offsets=None``; otherwise the token
            ids of the positions with offsets rebased to start at 0.

        Raises
        ------
        ConsistencyError
            If ``offsets`` is ``None``.
        """
        if self.offsets is None:
            raise ConsistencyError("offsets", "CSR offsets (slice_request needs them)", "None")
        cu = self.cu_num_generated_tokens
        start = req_idx if cu is None else cu[req_idx]
        end = start + num_positions
        lo, hi = self.offsets[start], self.offsets[end]
        if num_positions == 1:
            return SamplingMaskLists(self.token_ids[lo:hi])
        return SamplingMaskLists(self.token_ids[lo:hi], self.offsets[start : end + 1] - lo)

    def to_nested_list(self) -> list[list[int]]:
        """Return one list of allowed token ids per position.

        Returns
        -------
        list of list of int
            ``[token_ids]`` when ``offsets`` is ``None``; otherwise ``token_ids`` split
            at the offsets (empty positions give empty lists).
        """
        token_ids = self.token_ids.tolist()
        if self.offsets is None:
            return [token_ids]
        offsets = self.offsets.tolist()
        return [token_ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


@dataclass
class SamplerOutput:
    """Output of the sampler for one step.

    Attributes
    ----------
    sampled_token_ids : torch.Tensor
        ``[num_reqs, max_num_generated_tokens]``, padded with ``-1``.
    logprobs_tensors : LogprobsTensors or None
        Logprobs of the sampled tokens, when requested.
    """

    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None


@dataclass
class KVConnectorOutput:
    """What the KV connector reports for one step.

    Attributes
    ----------
    finished_sending, finished_recving : set of str or None
        Request ids whose KV transfer finished.
    kv_connector_stats, kv_cache_events, kv_connector_worker_meta : object
        Connector-specific opaque objects.
    invalid_block_ids : set of int
        Blocks that failed to load.
    failed_recving : set of str
        Requests whose KV receive failed (keyed by request, unambiguous when block ids of
        several cache pools overlap).
    expected_finished_count : int
        How many workers must report a request finished.

    Examples
    --------
    >>> KVConnectorOutput().is_empty(), KVConnectorOutput(invalid_block_ids={3}).is_empty()
    (True, False)
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    expected_finished_count: int = 0

    def is_empty(self) -> bool:
        """Return whether there is nothing to report.

        Returns
        -------
        bool
            ``True`` when every field but ``expected_finished_count`` is falsy.
        """
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.kv_connector_stats
            and not self.kv_cache_events
            and not self.invalid_block_ids
            and not self.failed_recving
            and not self.kv_connector_worker_meta
        )


@dataclass
class ECConnectorOutput:
    """What the encoder-cache connector reports for one step.

    Attributes
    ----------
    finished_sending, finished_recving : set of str or None
        Request ids whose encoder-cache transfer finished.
    ec_connector_stats : object
        Connector transfer statistics (vLLM's ``ECConnectorStats``, a dataclass).
    ec_connector_worker_meta : object
        Connector-specific object.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    ec_connector_stats: Any = None
    ec_connector_worker_meta: Any = None

    def is_empty(self) -> bool:
        """Return whether there is nothing to report.

        Returns
        -------
        bool
            ``True`` when every field is falsy.
        """
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.ec_connector_stats
            and not self.ec_connector_worker_meta
        )


@dataclass(frozen=True)
class CUDAGraphStat:
    """Padding statistics of one CUDA-graph execution.

    Attributes
    ----------
    num_unpadded_tokens, num_padded_tokens, num_paddings : int
        Token counts before and after padding, and their difference.
    runtime_mode : str
        The CUDA-graph mode the step ran in.
    """

    num_unpadded_tokens: int
    num_padded_tokens: int
    num_paddings: int
    runtime_mode: str


@dataclass
class AuxRequestOutput:
    """Per-request auxiliary output (routed-experts "R3" rows).

    Attributes
    ----------
    token_start : int
        Position of the first token the rows belong to.
    rows : numpy.ndarray
        3-D uint8/uint16 ``[num_tokens, num_layers, num_experts_per_tok]``.
    """

    token_start: int
    rows: np.ndarray


@dataclass
class ModelRunnerOutput:
    """Everything the model runner returns to the scheduler for one step.

    Attributes
    ----------
    req_ids : list of str
        ``[num_reqs]`` request ids.
    req_id_to_index : dict of str to int
        Request id to index in ``req_ids``.
    sampled_token_ids : list of list of int
        ``num_reqs x num_generated_tokens``; the number of tokens can differ per request
        (speculative decoding).
    logprobs : LogprobsLists or None
        Logprobs of the sampled tokens.
    prompt_logprobs_dict : dict of str to LogprobsTensors or None
        Request id to prompt logprobs.
    prompt_token_id_logprobs_dict : dict of str to torch.Tensor
        Request id to ``[num_scored_rows, num_token_ids]`` prompt token-id scores.
    pooler_output : list of torch.Tensor or None, or None
        ``[num_reqs, hidden_size]`` pooling output.
    kv_connector_output : KVConnectorOutput or None
    ec_connector_output : ECConnectorOutput or None
    num_nans_in_logits : dict of str to int, or None
        Request id to number of NaNs in its logits.
    cudagraph_stats : CUDAGraphStat or None
        Information related to CUDA-graph execution.
    aux_output_connector_output : dict of str to AuxRequestOutput, or None
    sampling_masks : SamplingMaskLists or None
        ``None`` when ``return_sampling_mask`` is off.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: LogprobsLists | None = None
    prompt_logprobs_dict: dict[str, LogprobsTensors | None] = field(default_factory=dict)
    prompt_token_id_logprobs_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    pooler_output: list[torch.Tensor | None] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    ec_connector_output: ECConnectorOutput | None = None
    num_nans_in_logits: dict[str, int] | None = None
    cudagraph_stats: CUDAGraphStat | None = None
    aux_output_connector_output: dict[str, AuxRequestOutput] | None = None
    sampling_masks: SamplingMaskLists | None = None

    @staticmethod
    def with_kv_conn_output_only(
        kv_connector_output: KVConnectorOutput | None,
    ) -> ModelRunnerOutput:
        """Return ModelRunnerOutput containing the provided KVConnectorOutput,
        otherwise empty.

        Parameters
        ----------
        kv_connector_output : KVConnectorOutput or None
            The connector output to carry.

        Returns
        -------
        ModelRunnerOutput
            :data:`EMPTY_MODEL_RUNNER_OUTPUT` itself when ``kv_connector_output`` is
            ``None`` or empty; otherwise a shallow copy of it carrying the output.
        """
        if kv_connector_output is None or kv_connector_output.is_empty():
            return EMPTY_MODEL_RUNNER_OUTPUT
        output = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        output.kv_connector_output = kv_connector_output
        return output

    @staticmethod
    def with_ec_conn_output_only(
        ec_connector_output: ECConnectorOutput | None,
    ) -> ModelRunnerOutput:
        """Return an otherwise-empty output carrying ``ec_connector_output``.

        Parameters
        ----------
        ec_connector_output : ECConnectorOutput or None
            The connector output to carry.

        Returns
        -------
        ModelRunnerOutput
            :data:`EMPTY_MODEL_RUNNER_OUTPUT` itself when ``ec_connector_output`` is
            ``None`` or empty; otherwise a shallow copy of it carrying the output.
        """
        return ModelRunnerOutput.with_ec_conn_output(EMPTY_MODEL_RUNNER_OUTPUT, ec_connector_output)

    @staticmethod
    def with_ec_conn_output(
        output: ModelRunnerOutput,
        ec_connector_output: ECConnectorOutput | None,
    ) -> ModelRunnerOutput:
        """Return ``output`` carrying ``ec_connector_output``.

        The shared empty output is copied rather than written to, so callers must use
        the return value.

        Parameters
        ----------
        output : ModelRunnerOutput
            The output to attach to; modified in place unless it is
            :data:`EMPTY_MODEL_RUNNER_OUTPUT`.
        ec_connector_output : ECConnectorOutput or None
            The connector output to carry.

        Returns
        -------
        ModelRunnerOutput
            ``output`` unchanged when ``ec_connector_output`` is ``None`` or empty.
        """
        if ec_connector_output is None or ec_connector_output.is_empty():
            return output
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        output.ec_connector_output = ec_connector_output
        return output


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})
"""The shared empty output. Never modify it; copy it instead."""


class AsyncModelRunnerOutput(ABC):
    """A model-runner output whose device-to-host copies may still be in flight."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Get the ModelRunnerOutput for this async output.

        This is a blocking call that waits until the results are ready, which
        might involve copying device tensors to the host.
        This method should only be called once per AsyncModelRunnerOutput.
        """

    @abstractmethod
    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        """Get the underlying kv_connector_output.

        When get_output() fails, this is used to salvage the step's KV
        output instead of losing it with the failure.
        """


@dataclass
class DraftTokenIds:
    """Draft (speculative) token ids proposed for the next step.

    Attributes
    ----------
    req_ids : list of str
        ``[num_reqs]`` request ids.
    draft_token_ids : list of list of int
        ``num_reqs x num_draft_tokens`` proposed token ids.
    """

    req_ids: list[str]
    draft_token_ids: list[list[int]]


class _HasNumScheduledTokens(Protocol):
    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...


def make_empty_encoder_model_runner_output(
    scheduler_output: _HasNumScheduledTokens,
) -> ModelRunnerOutput:
    """Create a ModelRunnerOutput stub that contains the correct
    per-request bookkeeping but no generated data yet.

    Parameters
    ----------
    scheduler_output : object
        Anything with a ``num_scheduled_tokens`` mapping of request id to token count,
        such as vLLM's ``SchedulerOutput``.

    Returns
    -------
    ModelRunnerOutput
        :data:`EMPTY_MODEL_RUNNER_OUTPUT` itself when nothing is scheduled; otherwise
        one empty token list and one ``None`` pooler output per request, in the
        mapping's order.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> out = make_empty_encoder_model_runner_output(
    ...     SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 1})
    ... )
    >>> out.req_ids, out.req_id_to_index, out.sampled_token_ids, out.pooler_output
    (['a', 'b'], {'a': 0, 'b': 1}, [[], []], [None, None])
    """
    if not scheduler_output.num_scheduled_tokens:
        return EMPTY_MODEL_RUNNER_OUTPUT

    # A list gives a deterministic, indexable sequence.
    req_ids: list[str] = list(scheduler_output.num_scheduled_tokens.keys())
    # Every request gets its own contiguous index.
    req_id_to_index: dict[str, int] = {rid: idx for idx, rid in enumerate(req_ids)}
    # An encoder instance never samples, so it emits no tokens at all; the scheduler
    # finishes these requests once their prompt is fully encoded.
    sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
    # Pooler outputs are not available yet: None placeholders.
    pooler_output: list[torch.Tensor | None] = [None for _ in req_ids]

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=req_id_to_index,
        sampled_token_ids=sampled_token_ids,
        pooler_output=pooler_output,
    )
