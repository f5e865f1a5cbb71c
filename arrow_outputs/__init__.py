"""arrow_outputs: vLLM's per-step model-runner outputs in Apache Arrow columnar form.

Importing this package never imports torch; torch is needed only where tensors are made.

Examples
--------
>>> import arrow_outputs as ao
>>> out = ao.ModelRunnerOutput(["r0"], {"r0": 0}, [[42]])
>>> ao.from_record_batch(ao.to_record_batch(out, step=0)).sampled_token_ids
[[42]]
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import analysis as analysis  # ao.analysis.summary(...): numpy and pyarrow only
from .async_output import AsyncArrowOutput, AsyncArrowPoolingOutput
from .batch import (
    from_record_batch,
    run_schema,
    step_custom_metadata,
    step_metadata,
    to_record_batch,
)
from .compare import assert_outputs_equal, first_difference, outputs_equal
from .device import PoolStats, Staged, StagingPool, buffer_to_tensor, tensor_to_buffer
from .errors import (
    ArrowOutputsError,
    ConsistencyError,
    CorruptFileError,
    DTypeError,
    FieldTypeError,
    FormatVersionError,
    OffsetsError,
    OpaqueValueWarning,
    SchemaMismatchError,
    ShapeError,
    StepMetadataError,
    UnsupportedValueError,
    WriterError,
)
from .logprobs import logprobs_from_arrow, logprobs_to_arrow
from .mask_tensors import MAX_COMPACT_SUPPORT, SamplingMaskTensors, mask_tensors_to_arrow
from .masks import sampling_masks_from_arrow, sampling_masks_to_arrow
from .outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    AuxRequestOutput,
    CUDAGraphStat,
    DraftTokenIds,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SamplerOutput,
    SamplingMaskLists,
    make_empty_encoder_model_runner_output,
)
from .reader import (
    RecoveryReport,
    RunReader,
    StepBatch,
    follow,
    iter_batches,
    iter_outputs,
    open_run,
    read_table,
    recover,
)
from .records import Record
from .schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    ColumnTypes,
    column_types,
    infer_schema,
    output_schema,
    run_metadata,
)
from .sharing import (
    CorruptSegmentError,
    ProducerGoneError,
    PublisherStats,
    SharedStep,
    SharingError,
    StepPublisher,
    StepSubscriber,
    StepTimeoutError,
    SubscriberEvictedError,
)
from .tensors import TensorSpec
from .writer import OutputWriter, WriterStats

__all__ = [
    "ArrowOutputsError",
    "AsyncArrowOutput",
    "AsyncArrowPoolingOutput",
    "AsyncModelRunnerOutput",
    "AuxRequestOutput",
    "CUDAGraphStat",
    "ColumnTypes",
    "ConsistencyError",
    "CorruptFileError",
    "CorruptSegmentError",
    "DTypeError",
    "DraftTokenIds",
    "ECConnectorOutput",
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FieldTypeError",
    "FormatVersionError",
    "KVConnectorOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "MAX_COMPACT_SUPPORT",
    "ModelRunnerOutput",
    "OffsetsError",
    "OpaqueValueWarning",
    "OutputWriter",
    "PoolStats",
    "ProducerGoneError",
    "PublisherStats",
    "Record",
    "RecoveryReport",
    "RunReader",
    "SamplerOutput",
    "SamplingMaskLists",
    "SamplingMaskTensors",
    "SchemaMismatchError",
    "ShapeError",
    "SharedStep",
    "SharingError",
    "Staged",
    "StagingPool",
    "StepBatch",
    "StepMetadataError",
    "StepPublisher",
    "StepSubscriber",
    "StepTimeoutError",
    "SubscriberEvictedError",
    "TensorSpec",
    "UnsupportedValueError",
    "WriterError",
    "WriterStats",
    "__version__",
    "assert_outputs_equal",
    "buffer_to_tensor",
    "column_types",
    "first_difference",
    "follow",
    "from_record_batch",
    "infer_schema",
    "iter_batches",
    "iter_outputs",
    "logprobs_from_arrow",
    "logprobs_to_arrow",
    "make_empty_encoder_model_runner_output",
    "mask_tensors_to_arrow",
    "open_run",
    "output_schema",
    "outputs_equal",
    "read_table",
    "recover",
    "run_metadata",
    "run_schema",
    "sampling_masks_from_arrow",
    "sampling_masks_to_arrow",
    "step_custom_metadata",
    "step_metadata",
    "tensor_to_buffer",
    "to_record_batch",
]
