"""The released TRL's GRPO advantage code, run in-process as a test oracle (test-only; the service never
imports this module or trl).

Where the code is: TRL 1.16.0 computes GRPO advantages inline in ``GRPOTrainer._generate_and_score_completions``
(``trl/trainer/grpo_trainer.py``), between generation and the returned batch; there is no advantage
function to import. So that whole method is called, unchanged, on a real ``GRPOTrainer`` built with
``object.__new__`` (its ``__init__`` loads models, tokenizers, datasets and accelerate state) and given
the attributes the method reads, at ``GRPOConfig`` defaults unless a test sets them: ``num_generations``,
``scale_rewards``, ``multi_objective_aggregation`` ("sum_then_normalize"), ``reward_weights``, ``beta``
(0: no reference model), no vLLM, no tools, no environments, no images, one optimizer step per
generation (so no old log-probs are computed). What runs as released: the padding of the completions,
``_calculate_rewards`` (the real method: it calls the reward function given here, turns its ``None``
into NaN and builds TRL's float32 ``rewards_per_func``), the weighted ``nansum``, the group mean
(``nanmean``), ``nanstd`` (group, batch or none, by ``scale_rewards``), ``/ (std + 1e-4)``, the
unscorable rows' ``nan_to_num``, the process slice and the logging.

Stand-ins (plain objects, none of them computes a number the advantage depends on):
    * ``_generate``: returns the given prompt/completion token ids (generation is a model call);
      completion lengths and the multi-turn ``tool_mask`` only shape the masks, which TRL's
      advantages do not read.
    * ``accelerator``: one CPU process (``device``, ``process_index`` 0, ``gather`` = identity,
      ``is_main_process``), ``model`` (``training``, no gradient checkpointing), ``_tokenizer``
      (``pad_token_id``), ``state`` (``global_step``), ``args`` (the batch-size/step options read).

Stubbed modules, only while trl is imported (the previous ``sys.modules`` entries are restored
afterwards, so other harnesses' stubs are untouched): ``transformers``, ``accelerate``, ``datasets``,
``huggingface_hub``, ``pandas`` and ``pyarrow``, each holding only the names trl's import chain reads
(:data:`STUBS`): model/tokenizer/trainer base classes used as annotations and base classes,
``is_*_available`` flags (False), ``get_logger`` (the standard ``logging.getLogger``), and
accelerate's collectives ``gather`` / ``gather_object`` / ``broadcast_object_list`` as a single
process computes them (the input itself). Any other stub class cannot be instantiated and any other
stub function raises, so a stub reached by the advantage computation fails the test.

``precise=True``: "the reference run in float64": TRL builds ``rewards_per_func`` in float32 inside
``_calculate_rewards``; for the float64 run that method alone is replaced by one returning the same
rewards (NaN for ``None``) as a float64 ``[B, 1]`` tensor, and torch's default dtype is float64 during
the call (``nanstd``'s Bessel factor ``count / (count - 1)`` divides two integer tensors, which torch
does in the default dtype), so everything after it runs in float64.
"""
from __future__ import annotations

import collections
import importlib
import importlib.metadata
import logging
import sys
import types
from types import SimpleNamespace
from typing import Any, Sequence

import torch

__all__ = ["STUBS", "load", "version", "compute", "compute_rloo"]


class StubUsed(RuntimeError):
    """A stub stood in for code that was actually run: the harness is not honest for this call."""


def _identity(module: str, name: str):
    def single_process(value: Any, *args: Any, **kwargs: Any) -> Any:
        return value

    single_process.__name__ = name
    return single_process


def _false(*args: Any, **kwargs: Any) -> bool:
    return False


_CLASS, _FUNCTION, _FALSE, _IDENTITY = "class", "function", "false", "identity"


def _classes(*names: str) -> dict[str, Any]:
    return {n: _CLASS for n in names}


#: module -> {attribute: kind or value}: the stubbed modules and the only names trl's import chain reads
#: (kinds: a class that cannot be built, a function that raises, a False flag, a single-process collective).
STUBS: dict[str, dict[str, Any]] = {
    "transformers": {
        "__version__": "4.56.2",  # TRL's minimum; read at import by chat-template feature flags only
        **_classes("AddedToken", "AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText",
                   "AutoModelForSequenceClassification", "AutoProcessor", "AutoTokenizer", "BitsAndBytesConfig",
                   "CONFIG_MAPPING", "GenerationConfig", "PreTrainedModel", "PreTrainedTokenizerBase",
                   "PretrainedConfig", "ProcessorMixin", "Trainer", "TrainerCallback", "TrainerControl",
                   "TrainerState", "TrainingArguments"),
        **{n: _FALSE for n in ("is_bitsandbytes_available", "is_comet_available", "is_trackio_available",
                               "is_wandb_available")}},
    "transformers.data": {},
    "transformers.data.data_collator": _classes("DataCollatorMixin"),
    "transformers.integrations": {n: _FALSE for n in ("is_mlflow_available", "is_trackio_available",
                                                      "is_wandb_available")},
    "transformers.integrations.deepspeed": {"is_deepspeed_zero3_enabled": _FALSE},
    "transformers.models": {},
    "transformers.models.auto": {},
    "transformers.models.auto.auto_factory": _classes("_BaseAutoModelClass"),
    "transformers.processing_utils": _classes("ProcessorMixin"),
    "transformers.trainer_utils": {"PREFIX_CHECKPOINT_DIR": "checkpoint", "has_length": _FUNCTION},
    "transformers.utils": {
        **_classes("ModelOutput"), "get_json_schema": _FUNCTION,
        **{n: _FALSE for n in ("is_peft_available", "is_rich_available", "is_torch_mlu_available",
                               "is_torch_mps_available", "is_torch_npu_available", "is_torch_xpu_available",
                               "is_triton_available")}},
    "accelerate": {"__version__": "1.10.1", **_classes("Accelerator", "PartialState")},  # TRL's minimum
    "accelerate.logging": {"get_logger": logging.getLogger},
    "accelerate.state": _classes("AcceleratorState"),
    "accelerate.utils": {"broadcast_object_list": _IDENTITY, "gather": _IDENTITY, "gather_object": _IDENTITY,
                         "is_peft_model": _FALSE, "is_wandb_available": _FALSE, "set_seed": _FUNCTION},
    "accelerate.utils.fsdp_utils": {"get_parameters_from_modules": _FUNCTION},
    "datasets": _classes("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict"),
    "huggingface_hub": {**_classes("CommitScheduler", "DatasetCard", "DatasetCardData", "ModelCard",
                                   "ModelCardData"), "create_repo": _FUNCTION},
    "huggingface_hub.utils": {"send_telemetry": _FUNCTION},
    "pandas": _classes("DataFrame"),
    "pyarrow": _classes("Array", "Table"),
    "pyarrow.compute": {},
    "pyarrow.types": {},
}

_modules: dict[str, types.ModuleType] = {}


def _build_stub(name: str, attrs: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name, f"stub of {name} (tests/references/trl_ref.py): not advantage code")
    module.__path__ = []
    module.__stub__ = True  # type: ignore[attr-defined]
    for attr, kind in attrs.items():
        if kind == _CLASS:
            def __init__(self, *args: Any, _n: str = f"{name}.{attr}", **kwargs: Any) -> None:
                raise StubUsed(f"{_n} is a stub in tests/references/trl_ref.py")
            extra = {"_VALID_DICT_FIELDS": []} if attr == "TrainingArguments" else {}
            value: Any = type(attr, (), {"__init__": __init__, "__module__": name, **extra})
        elif kind == _FUNCTION:
            def value(*args: Any, _n: str = f"{name}.{attr}", **kwargs: Any) -> Any:
                raise StubUsed(f"{_n} is a stub in tests/references/trl_ref.py")
        elif kind == _FALSE:
            value = _false
        elif kind == _IDENTITY:
            value = _identity(name, attr)
        else:
            value = kind
        setattr(module, attr, value)

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: not in tests/references/trl_ref.py STUBS")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def load(trainer: str = "grpo") -> types.ModuleType:
    """``trl.trainer.<trainer>_trainer`` (``grpo`` or ``rloo``) of the installed release, imported once."""
    name = f"trl.trainer.{trainer}_trainer"
    if name in _modules:
        return _modules[name]
    tops = {name.split(".")[0] for name in STUBS}
    saved = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in tops}
    try:
        for name in saved:
            del sys.modules[name]
        for stubbed, attrs in STUBS.items():
            stub = _build_stub(stubbed, attrs)
            sys.modules[stubbed] = stub
            if "." in stubbed:
                parent, child = stubbed.rsplit(".", 1)
                setattr(sys.modules[parent], child, stub)
        _modules[name] = importlib.import_module(name)
    finally:
        for stubbed in [n for n in sys.modules if n.split(".")[0] in tops]:
            del sys.modules[stubbed]
        sys.modules.update(saved)
    return _modules[name]


def version() -> str:
    """The installed trl's version (from its distribution metadata)."""
    return importlib.metadata.version("trl")


def _generate_and_score(cls: type, trainer: Any, values: list, precise: bool) -> torch.Tensor:
    """``cls._generate_and_score_completions`` (the released method) on ``trainer`` for one prompt per value,
    returning its ``advantages``. ``precise``: the float64 run (``_calculate_rewards`` replaced by one giving
    ``values`` as float64 ``[B, 1]``, NaN for None, and torch's default dtype float64 during the call: nanstd's
    ``count / (count - 1)`` is in the default dtype)."""
    if precise:
        def calculate_rewards(inputs, prompts, completions, completion_ids_list):
            return torch.tensor([[float("nan") if r is None else float(r)] for r in values], dtype=torch.float64)
        trainer._calculate_rewards = calculate_rewards
    inputs = [{"prompt": "p"} for _ in values]
    default = torch.get_default_dtype()
    if precise:
        torch.set_default_dtype(torch.float64)
    try:
        return cls._generate_and_score_completions(trainer, inputs)["advantages"]
    finally:
        torch.set_default_dtype(default)


def compute(rewards: Sequence[float | None], num_generations: int, *, scale_rewards: str = "group",
            loss_type: str = "dapo", completion_lengths: Sequence[int] | None = None,
            tool_masks: Sequence[Sequence[int]] | None = None, precise: bool = False) -> torch.Tensor:
    """Advantages ``[B]`` from the released ``GRPOTrainer._generate_and_score_completions``.

    rewards: one reward per completion (``None``: the reward function could not score it), in TRL's
    order: prompt g's ``num_generations`` completions are rows ``g * n .. g * n + n - 1``;
    scale_rewards: "group", "batch" or "none"; loss_type: ``GRPOConfig.loss_type`` (the method does not
    read it: advantages do not depend on it); completion_lengths / tool_masks: the completions' token
    counts and multi-turn tool masks (shape the masks only). Returns the ``advantages`` entry of the
    returned batch: float32 (TRL's ``rewards_per_func``), float64 with ``precise``.
    Raises what the released code raises (a ``B`` not divisible by ``num_generations``: RuntimeError).
    """
    gt = load()
    B = len(rewards)
    lengths = list(completion_lengths) if completion_lengths is not None else [1] * B
    trainer = object.__new__(gt.GRPOTrainer)
    values = list(rewards)

    def reward_fn(prompts, completions, completion_ids, **kwargs):
        return values

    mode_metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    attrs = dict(
        accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=0, is_main_process=True,
                                    gather=lambda t: t),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        args=SimpleNamespace(per_device_train_batch_size=B, per_device_eval_batch_size=B, steps_per_generation=1,
                             gradient_accumulation_steps=1, gradient_checkpointing_kwargs=None, report_to=[],
                             loss_type=loss_type),
        state=SimpleNamespace(global_step=0),
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        eos_token_ids=[1], environment_factories=None, environments=None, tools=None, use_vllm=False,
        vllm_importance_sampling_correction=False, beta=0.0, ref_model=None, num_iterations=1,
        num_generations=num_generations, num_generations_eval=num_generations, scale_rewards=scale_rewards,
        multi_objective_aggregation="sum_then_normalize", reward_funcs=[reward_fn], reward_processing_classes=[None],
        reward_func_names=["reward"], reward_weights=torch.ones(1, dtype=torch.float32), chat_template_kwargs={},
        _metrics={"train": mode_metrics["train"], "eval": mode_metrics["eval"]},
        _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
               "extra": collections.defaultdict(list), "images": []},
        _pending_extra_logs=collections.defaultdict(list), _pending_metrics=collections.defaultdict(list),
        log_multimodal=False, loss_type=loss_type,
    )
    for key, value in attrs.items():
        setattr(trainer, key, value)

    def generate(prompts):
        completion_ids = [[2] * n for n in lengths]
        masks = [list(m) for m in tool_masks] if tool_masks is not None else None
        return ([[3, 4] for _ in prompts], completion_ids, masks, ["c"] * len(prompts), None, {}, None, None)

    trainer._generate = generate
    return _generate_and_score(gt.GRPOTrainer, trainer, values, precise)


def compute_rloo(rewards: Sequence[float | None], num_generations: int, *, beta: float = 0.0,
                 logps: Any = None, ref_logps: Any = None, completion_lengths: Sequence[int] | None = None,
                 normalize_advantages: bool = False, reward_clip_range: tuple[float, float] | None = None,
                 precise: bool = False) -> torch.Tensor:
    """Advantages ``[B]`` from the released ``RLOOTrainer._generate_and_score_completions`` (TRL 1.16.0
    computes RLOO advantages inline there too), run as :func:`compute` runs GRPO's.

    rewards: one per completion (``None``: unscorable), prompt g's completions at rows ``g * n .. g * n + n - 1``;
    beta: ``RLOOConfig.beta`` (0: no KL, no reference model); logps / ref_logps: ``[B, T]`` per-token log-probs
    of the policy and the reference (needed when beta != 0; T = max completion length), returned by the stand-in
    for ``_get_per_token_logps_and_entropies`` (a model call) in the order the method makes its calls (policy,
    then reference, which it reaches through ``ref_model``); completion_lengths: token counts (TRL builds
    ``completion_mask`` from them and pads to the longest; default all T); normalize_advantages, reward_clip_range: ``RLOOConfig``'s.
    Returns the ``advantages`` entry: float32, float64 with ``precise`` (rewards, log-probs and torch's default
    dtype in float64, as :func:`compute`). Stand-ins beyond :func:`compute`'s: ``accelerator.reduce`` (one
    process: the input) for the logged KL, ``ref_model`` (an object the stand-in recognises).
    """
    rt = load("rloo")
    B = len(rewards)
    dtype = torch.float64 if precise else torch.float32
    lp = None if logps is None else torch.as_tensor(logps, dtype=dtype)
    ref = None if ref_logps is None else torch.as_tensor(ref_logps, dtype=dtype)
    T = lp.shape[1] if lp is not None else max(list(completion_lengths or [1]))
    lengths = list(completion_lengths) if completion_lengths is not None else [T] * B
    trainer = object.__new__(rt.RLOOTrainer)
    values = list(rewards)

    def reward_fn(prompts, completions, completion_ids, **kwargs):
        return values

    ref_model = SimpleNamespace(name="reference")
    policy = SimpleNamespace(training=True, is_gradient_checkpointing=False)

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        # TRL pads the completions to the longest one: logits_to_keep = max(completion_lengths) <= T
        assert logits_to_keep == max(lengths), (logits_to_keep, lengths)
        if model is ref_model:
            return ref[:, :logits_to_keep], None, None
        return (lp[:, :logits_to_keep] if lp is not None else torch.zeros((B, logits_to_keep), dtype=dtype)), \
            None, None

    mode_metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    attrs = dict(
        accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=0, is_main_process=True,
                                    gather=lambda t: t, reduce=lambda t, reduction="sum": t),
        model=policy,
        args=SimpleNamespace(per_device_train_batch_size=B, per_device_eval_batch_size=B, steps_per_generation=1,
                             gradient_accumulation_steps=1, gradient_checkpointing_kwargs=None, report_to=[]),
        state=SimpleNamespace(global_step=0),
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        eos_token_ids=[1], use_vllm=False, beta=beta, ref_model=ref_model if beta != 0.0 else None,
        num_iterations=1, num_generations=num_generations, num_generations_eval=num_generations,
        normalize_advantages=normalize_advantages, reward_clip_range=reward_clip_range,
        reward_funcs=[reward_fn], reward_processing_classes=[None], reward_func_names=["reward"],
        reward_weights=torch.ones(1, dtype=torch.float32), chat_template_kwargs={},
        _metrics={"train": mode_metrics["train"], "eval": mode_metrics["eval"]},
        _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
               "extra": collections.defaultdict(list), "images": []},
        _pending_extra_logs=collections.defaultdict(list), _pending_metrics=collections.defaultdict(list),
        log_multimodal=False,
    )
    for key, value in attrs.items():
        setattr(trainer, key, value)

    def generate(prompts):
        return [[3, 4] for _ in prompts], [[2] * n for n in lengths], ["c"] * len(prompts)

    trainer._generate = generate
    trainer._get_per_token_logps_and_entropies = per_token_logps
    return _generate_and_score(rt.RLOOTrainer, trainer, values, precise)
