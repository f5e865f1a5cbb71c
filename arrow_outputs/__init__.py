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

from .batch import (
    from_record_batch,
    run_schema,
    step_custom_metadata,
    step_metadata,
    to_record_batch,
)
from .compare import assert_outputs_equal, first_difference, outputs_equal
from .errors import (
    ArrowOutputsError,
    ConsistencyError,
    DTypeError,
    FieldTypeError,
    FormatVersionError,
    OffsetsError,
    OpaqueValueWarning,
    SchemaMismatchError,
    ShapeError,
    StepMetadataError,
    UnsupportedValueError,
)
from .logprobs import logprobs_from_arrow, logprobs_to_arrow
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
from .tensors import TensorSpec

__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ArrowOutputsError",
    "AsyncModelRunnerOutput",
    "AuxRequestOutput",
    "CUDAGraphStat",
    "ColumnTypes",
    "ConsistencyError",
    "DTypeError",
    "DraftTokenIds",
    "ECConnectorOutput",
    "FieldTypeError",
    "FormatVersionError",
    "KVConnectorOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "ModelRunnerOutput",
    "OffsetsError",
    "OpaqueValueWarning",
    "Record",
    "SamplerOutput",
    "SamplingMaskLists",
    "SchemaMismatchError",
    "ShapeError",
    "StepMetadataError",
    "TensorSpec",
    "UnsupportedValueError",
    "__version__",
    "assert_outputs_equal",
    "column_types",
    "first_difference",
    "from_record_batch",
    "infer_schema",
    "logprobs_from_arrow",
    "logprobs_to_arrow",
    "make_empty_encoder_model_runner_output",
    "output_schema",
    "outputs_equal",
    "run_metadata",
    "run_schema",
    "sampling_masks_from_arrow",
    "sampling_masks_to_arrow",
    "step_custom_metadata",
    "step_metadata",
    "to_record_batch",
]
