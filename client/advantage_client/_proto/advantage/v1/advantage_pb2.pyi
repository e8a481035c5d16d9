from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class KLType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KL_TYPE_UNSPECIFIED: _ClassVar[KLType]
    KL_TYPE_K1: _ClassVar[KLType]
    KL_TYPE_K2: _ClassVar[KLType]
    KL_TYPE_K3: _ClassVar[KLType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_BOOL: DType
DTYPE_UINT8: DType
KL_TYPE_UNSPECIFIED: KLType
KL_TYPE_K1: KLType
KL_TYPE_K2: KLType
KL_TYPE_K3: KLType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GRPOConfig(_message.Message):
    __slots__ = ("normalize_rewards", "use_leave_one_out_baseline")
    NORMALIZE_REWARDS_FIELD_NUMBER: _ClassVar[int]
    USE_LEAVE_ONE_OUT_BASELINE_FIELD_NUMBER: _ClassVar[int]
    normalize_rewards: bool
    use_leave_one_out_baseline: bool
    def __init__(self, normalize_rewards: _Optional[bool] = ..., use_leave_one_out_baseline: _Optional[bool] = ...) -> None: ...

class GDPOConfig(_message.Message):
    __slots__ = ("normalize_rewards", "use_leave_one_out_baseline", "reward_weights")
    NORMALIZE_REWARDS_FIELD_NUMBER: _ClassVar[int]
    USE_LEAVE_ONE_OUT_BASELINE_FIELD_NUMBER: _ClassVar[int]
    REWARD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    normalize_rewards: bool
    use_leave_one_out_baseline: bool
    reward_weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, normalize_rewards: _Optional[bool] = ..., use_leave_one_out_baseline: _Optional[bool] = ..., reward_weights: _Optional[_Iterable[float]] = ...) -> None: ...

class ReinforcePlusPlusConfig(_message.Message):
    __slots__ = ("minus_baseline", "use_kl_in_reward", "reference_policy_kl_penalty", "reference_policy_kl_type", "kl_input_clamp_value", "kl_output_clamp_value")
    MINUS_BASELINE_FIELD_NUMBER: _ClassVar[int]
    USE_KL_IN_REWARD_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_POLICY_KL_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_POLICY_KL_TYPE_FIELD_NUMBER: _ClassVar[int]
    KL_INPUT_CLAMP_VALUE_FIELD_NUMBER: _ClassVar[int]
    KL_OUTPUT_CLAMP_VALUE_FIELD_NUMBER: _ClassVar[int]
    minus_baseline: bool
    use_kl_in_reward: bool
    reference_policy_kl_penalty: float
    reference_policy_kl_type: KLType
    kl_input_clamp_value: float
    kl_output_clamp_value: float
    def __init__(self, minus_baseline: _Optional[bool] = ..., use_kl_in_reward: _Optional[bool] = ..., reference_policy_kl_penalty: _Optional[float] = ..., reference_policy_kl_type: _Optional[_Union[KLType, str]] = ..., kl_input_clamp_value: _Optional[float] = ..., kl_output_clamp_value: _Optional[float] = ...) -> None: ...

class RawRewardConfig(_message.Message):
    __slots__ = ("normalize_advantages",)
    NORMALIZE_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    normalize_advantages: bool
    def __init__(self, normalize_advantages: _Optional[bool] = ...) -> None: ...

class GAEConfig(_message.Message):
    __slots__ = ("gae_lambda", "gae_gamma", "normalize_advantages", "gae_lambda_value", "gae_lambda_policy", "length_adaptive_alpha", "use_kl_in_reward", "reference_policy_kl_penalty", "reference_policy_kl_type", "kl_input_clamp_value", "kl_output_clamp_value")
    GAE_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    GAE_GAMMA_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_VALUE_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_POLICY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_ADAPTIVE_ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_KL_IN_REWARD_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_POLICY_KL_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_POLICY_KL_TYPE_FIELD_NUMBER: _ClassVar[int]
    KL_INPUT_CLAMP_VALUE_FIELD_NUMBER: _ClassVar[int]
    KL_OUTPUT_CLAMP_VALUE_FIELD_NUMBER: _ClassVar[int]
    gae_lambda: float
    gae_gamma: float
    normalize_advantages: bool
    gae_lambda_value: float
    gae_lambda_policy: float
    length_adaptive_alpha: float
    use_kl_in_reward: bool
    reference_policy_kl_penalty: float
    reference_policy_kl_type: KLType
    kl_input_clamp_value: float
    kl_output_clamp_value: float
    def __init__(self, gae_lambda: _Optional[float] = ..., gae_gamma: _Optional[float] = ..., normalize_advantages: _Optional[bool] = ..., gae_lambda_value: _Optional[float] = ..., gae_lambda_policy: _Optional[float] = ..., length_adaptive_alpha: _Optional[float] = ..., use_kl_in_reward: _Optional[bool] = ..., reference_policy_kl_penalty: _Optional[float] = ..., reference_policy_kl_type: _Optional[_Union[KLType, str]] = ..., kl_input_clamp_value: _Optional[float] = ..., kl_output_clamp_value: _Optional[float] = ...) -> None: ...

class OPDConfig(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ComputeAdvantageRequest(_message.Message):
    __slots__ = ("grpo", "gdpo", "reinforce_plus_plus", "raw_reward", "gae", "opd", "inputs", "output_dtype")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    GRPO_FIELD_NUMBER: _ClassVar[int]
    GDPO_FIELD_NUMBER: _ClassVar[int]
    REINFORCE_PLUS_PLUS_FIELD_NUMBER: _ClassVar[int]
    RAW_REWARD_FIELD_NUMBER: _ClassVar[int]
    GAE_FIELD_NUMBER: _ClassVar[int]
    OPD_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    grpo: GRPOConfig
    gdpo: GDPOConfig
    reinforce_plus_plus: ReinforcePlusPlusConfig
    raw_reward: RawRewardConfig
    gae: GAEConfig
    opd: OPDConfig
    inputs: _containers.MessageMap[str, Tensor]
    output_dtype: DType
    def __init__(self, grpo: _Optional[_Union[GRPOConfig, _Mapping]] = ..., gdpo: _Optional[_Union[GDPOConfig, _Mapping]] = ..., reinforce_plus_plus: _Optional[_Union[ReinforcePlusPlusConfig, _Mapping]] = ..., raw_reward: _Optional[_Union[RawRewardConfig, _Mapping]] = ..., gae: _Optional[_Union[GAEConfig, _Mapping]] = ..., opd: _Optional[_Union[OPDConfig, _Mapping]] = ..., inputs: _Optional[_Mapping[str, Tensor]] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class AdvantageResult(_message.Message):
    __slots__ = ("advantages", "returns", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    advantages: Tensor
    returns: Tensor
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, advantages: _Optional[_Union[Tensor, _Mapping]] = ..., returns: _Optional[_Union[Tensor, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ListEstimatorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEstimatorsResponse(_message.Message):
    __slots__ = ("estimators",)
    ESTIMATORS_FIELD_NUMBER: _ClassVar[int]
    estimators: _containers.RepeatedCompositeFieldContainer[EstimatorInfo]
    def __init__(self, estimators: _Optional[_Iterable[_Union[EstimatorInfo, _Mapping]]] = ...) -> None: ...

class EstimatorInfo(_message.Message):
    __slots__ = ("name", "config_field", "config_message", "description", "reference", "config_fields", "inputs", "produces_returns", "metrics")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_FIELD_NUMBER: _ClassVar[int]
    CONFIG_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELDS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PRODUCES_RETURNS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_field: str
    config_message: str
    description: str
    reference: str
    config_fields: _containers.RepeatedCompositeFieldContainer[ConfigField]
    inputs: _containers.RepeatedCompositeFieldContainer[InputSpec]
    produces_returns: bool
    metrics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., config_field: _Optional[str] = ..., config_message: _Optional[str] = ..., description: _Optional[str] = ..., reference: _Optional[str] = ..., config_fields: _Optional[_Iterable[_Union[ConfigField, _Mapping]]] = ..., inputs: _Optional[_Iterable[_Union[InputSpec, _Mapping]]] = ..., produces_returns: _Optional[bool] = ..., metrics: _Optional[_Iterable[str]] = ...) -> None: ...

class ConfigField(_message.Message):
    __slots__ = ("name", "type", "default_value", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    default_value: str
    description: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default_value: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class InputSpec(_message.Message):
    __slots__ = ("name", "shapes", "required", "required_when", "kind", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_WHEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    shapes: _containers.RepeatedScalarFieldContainer[str]
    required: bool
    required_when: str
    kind: str
    description: str
    def __init__(self, name: _Optional[str] = ..., shapes: _Optional[_Iterable[str]] = ..., required: _Optional[bool] = ..., required_when: _Optional[str] = ..., kind: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...
