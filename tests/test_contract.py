"""ListEstimators is the contract: what the server declares is what each estimator reads and needs.

* every estimator, run in-process on a batch built only from its declared inputs, reads exactly the
  declared inputs and nothing else (a ``Batch`` spy records every read);
* every input declared required (or required under the config) is really required: leaving it out is an
  INVALID_ARGUMENT over gRPC naming it;
* the same holds under every ``semantics`` an estimator offers: nothing undeclared is read, everything
  needed is read;
* the listing matches the proto (estimator names, config fields) and the references' defaults (NeMo RL's
  for the six NeMo RL estimators);
* ``produces_returns`` / ``returns_when`` and ``metrics`` match what results actually carry;
* the registry refuses duplicate names.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_server import AdvantageCore
from advantage_server import core as core_module
from advantage_server.estimators import REGISTRY, Batch
from advantage_server.estimators.inputs import MASK
from advantage_server.errors import InvalidInput
from advantage_server.estimators.registry import EstimatorConfig, register

NEMO_NAMES = {"grpo", "gdpo", "reinforce_plus_plus", "raw_reward", "gae", "opd"}
EXPECTED_NAMES = NEMO_NAMES | {"grpo_passk", "reinforce_plus_plus_baseline", "rloo", "opo", "remax", "gpg",
                               "optimal_token_baseline", "tir_optimal_token_baseline", "pkpo", "qae",
                               "gigpo", "maxrl", "areal"}
B, T = 6, 5
PROMPT_IDS = np.array([3, 1, 3, 1, 1, 3], dtype=np.int64)  # two interleaved groups of 3
GDPO_COMPONENTS = ("reward/a", "reward/b")


@pytest.fixture(scope="module")
def listing(client):
    return {e.name: e for e in client.list_estimators().estimators}


# ------------------------------------------------------------------------------- batch building
def _random_input(name: str, shape: str, kind: str, rng: np.random.Generator) -> np.ndarray:
    dims = {"B": B, "T": T, "L": 4}
    size = tuple(dims[s.strip()] for s in shape.strip("[]").split(",") if s.strip())
    if name == "prompt_ids":
        assert size == (B,), "the first declared prompt_ids shape is [B]"
        return PROMPT_IDS.copy()
    if kind == "mask":
        m = (rng.random(size) < 0.7).astype(np.float32)
        m[:, 0] = 1.0  # every row has a valid token
        return m
    if kind == "integer":
        return rng.integers(0, 3, size=size, dtype=np.int64)
    if name.endswith("logprobs"):
        return -rng.random(size).astype(np.float32) * 2
    if name in ("sum_pi_squared", "rollout_is_weights"):  # a probability mass, a truncated IS weight
        return (0.05 + 0.95 * rng.random(size)).astype(np.float32)
    return rng.standard_normal(size).astype(np.float32)


def full_batch(info, seed: int = 0) -> dict[str, np.ndarray]:
    """One tensor for every declared input (optional ones included), from the listing alone."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in info.inputs:
        if spec.name.endswith("<name>"):
            prefix = spec.name[: -len("<name>")]
            assert prefix == "reward/", spec.name
            for key in GDPO_COMPONENTS:
                tensors[key] = _random_input(key, spec.shapes[0], spec.kind, rng)
        else:
            tensors[spec.name] = _random_input(spec.name, spec.shapes[0], spec.kind, rng)
    return tensors


def all_paths_config(info, semantics: str | None = None) -> dict:
    """A config with every optional path switched on: every bool field true (use_kl_in_reward,
    minus_baseline, normalization, leave-one-out) that applies under ``semantics`` (default: the estimator's
    default semantics; a field listed "false (verl); not applicable otherwise" is left unset for nemo_rl)."""
    if semantics is None:
        semantics = next((f.default_value for f in info.config_fields if f.name == "semantics"), None)

    def applies(f) -> bool:
        if semantics is None or "not applicable" not in f.default_value:
            return True
        where = f.default_value.split("(", 1)[1].split(")", 1)[0]
        return semantics in [w.strip() for w in where.split(",")]

    config = {f.name: True for f in info.config_fields if f.type == "bool" and applies(f)}
    # enum values that open an input path: ROLL's group normalisation reads prompt_ids (gae, reinforce_plus_plus)
    config.update({f.name: "group" for f in info.config_fields
                   if f.name in ("norm_mean_type", "norm_std_type") and applies(f)})
    return config


def declared_name(info, key: str) -> str | None:
    """The declared input name that ``key`` falls under (``reward/a`` -> ``reward/<name>``), or None."""
    for spec in info.inputs:
        if spec.name.endswith("<name>"):
            prefix = spec.name[: -len("<name>")]
            if key.startswith(prefix) and len(key) > len(prefix):
                return spec.name
        elif key == spec.name:
            return spec.name
    return None


def default_of(info, field: str):
    """The default of ``field`` under the estimator's default semantics, parsed from the listing's text
    ("true (nemo_rl); not applicable otherwise" -> True; "verl" -> "verl")."""
    text = next(f.default_value for f in info.config_fields if f.name == field).split(" (")[0]
    return {"true": True, "false": False}.get(text, text)


def condition_holds(condition: str, info, config: dict) -> bool:
    """A listing condition ("use_kl_in_reward = true", "semantics = verl or semantics = openrlhf") under
    ``config`` (unset fields take their listed default)."""
    def holds(term: str) -> bool:
        field, _, value = (s.strip() for s in term.partition("="))
        assert field and value and field in {f.name for f in info.config_fields}, f"unparsed condition {condition!r}"
        want = {"true": True, "false": False}.get(value, value)
        return config.get(field, default_of(info, field)) == want

    return any(all(holds(term) for term in clause.split(" and ")) for clause in condition.split(" or "))


def needed_under(spec, config: dict, info) -> bool:
    """``required``, or ``required_when`` ("field = value", joined by "and" / "or") holds for ``config``."""
    if spec.required:
        return True
    return bool(spec.required_when) and condition_holds(spec.required_when, info, config)


class SpyBatch(Batch):
    """Batch that also counts ``B``/``T`` (derived from `mask`) as reading `mask`."""

    instances: list["SpyBatch"] = []

    def __init__(self, tensors):
        super().__init__(tensors)
        SpyBatch.instances.append(self)

    @property
    def B(self):
        self.read.add("mask")
        return self._B

    @B.setter
    def B(self, value):
        self._B = value

    @property
    def T(self):
        self.read.add("mask")
        return self._T

    @T.setter
    def T(self, value):
        self._T = value


def run_with_spy(monkeypatch, name: str, config: dict, tensors: dict) -> tuple[set[str], object]:
    SpyBatch.instances.clear()
    monkeypatch.setattr(core_module, "Batch", SpyBatch)
    result = AdvantageCore("cpu").run(name, config, {k: torch.from_numpy(v) for k, v in tensors.items()})
    assert len(SpyBatch.instances) == 1, "core.run must build exactly one Batch"
    return SpyBatch.instances[0].read, result


# ------------------------------------------------------------------------- declared == read
def test_listing_names_exactly_the_estimators(listing):
    assert set(listing) == EXPECTED_NAMES
    assert set(REGISTRY) == EXPECTED_NAMES


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_estimator_reads_exactly_its_declared_inputs(listing, monkeypatch, name):
    info = listing[name]
    tensors = full_batch(info)
    # every input an estimator declares is read under some semantics with every option on (an input only one
    # semantics reads, e.g. grpo's logprobs for openrlhf's KL in the reward, counts), and none it does not declare
    read, configs = set(), []
    for semantics in semantics_configs(info):
        config, seen, result = run_all_paths(monkeypatch, name, info, semantics, tensors)
        assert result.advantages.shape == (B, T)
        read |= seen
        configs.append(config)
    undeclared = {k for k in read if declared_name(info, k) is None}
    assert not undeclared, f"{name} reads inputs it does not declare: {sorted(undeclared)}"
    not_sent = read - set(tensors)
    assert not not_sent, f"{name} looked up inputs that were not in the batch: {sorted(not_sent)}"
    read_declared = {declared_name(info, k) for k in read}
    declared = {s.name for s in info.inputs}
    assert read_declared == declared, (
        f"{name}: declared {sorted(declared)} but read {sorted(read_declared)} under {configs}; "
        f"never read: {sorted(declared - read_declared)}")
    if name == "gdpo":
        assert set(GDPO_COMPONENTS) <= read, "every reward/<name> component must be read"


def semantics_configs(info) -> list[dict]:
    """One config per semantics the estimator offers (just ``{}`` when it has no semantics field)."""
    field = next((f for f in info.config_fields if f.name == "semantics"), None)
    return [{"semantics": s} for s in field.allowed_values] if field else [{}]


def run_all_paths(monkeypatch, name: str, info, semantics: dict, tensors: dict):
    """Run with every bool field true that applies under ``semantics``: a field the semantics does not use
    is refused naming it (the error contract), and is then left unset."""
    config = {**all_paths_config(info, semantics.get("semantics")), **semantics}
    for _ in range(len(config) + 1):
        try:
            read, result = run_with_spy(monkeypatch, name, config, tensors)
            return config, read, result
        except InvalidInput as err:
            refused = {f.removeprefix("config.") for f, _ in err.violations}
            assert refused and refused <= set(config) - {"semantics"}, (name, semantics, err.violations)
            assert all("does not apply" in d for _, d in err.violations), err.violations
            config = {k: v for k, v in config.items() if k not in refused}
    raise AssertionError(f"{name}: no config accepted under {semantics}")


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_semantics_reads_only_declared_inputs_and_all_it_needs(listing, monkeypatch, name):
    info = listing[name]
    tensors = full_batch(info)
    for semantics in semantics_configs(info):
        config, read, result = run_all_paths(monkeypatch, name, info, semantics, tensors)
        assert result.advantages.shape == (B, T), (semantics, result.advantages.shape)
        assert torch.isfinite(result.advantages).all(), semantics
        undeclared = {k for k in read if declared_name(info, k) is None}
        assert not undeclared, f"{name} {semantics} reads inputs it does not declare: {sorted(undeclared)}"
        needed = {s.name for s in info.inputs if needed_under(s, config, info)}
        assert needed <= {declared_name(info, k) for k in read}, (
            f"{name} {config}: needs {sorted(needed)} but read {sorted(read)}")


def test_spy_detects_an_undeclared_read(monkeypatch):
    """The spy check above can fail: an estimator that reads an input it did not declare is caught."""
    name = "_test_sneaky"

    @register(name, config=EstimatorConfig, inputs=[MASK], reference="test")
    def sneaky(cfg, batch):
        batch.get("values")  # not declared
        from advantage_server.estimators import AdvantageResult
        return AdvantageResult(batch["mask"] * 0)

    try:
        SpyBatch.instances.clear()
        monkeypatch.setattr(core_module, "Batch", SpyBatch)
        spec = REGISTRY[name]
        cfg = EstimatorConfig()
        SpyBatch(AdvantageCore("cpu").prepare(spec, cfg, {"mask": torch.ones(2, 3)}))
        spy = SpyBatch.instances[-1]
        spec.fn(cfg, spy)
        assert "values" in spy.read and "values" not in {s.name for s in spec.inputs}
    finally:
        REGISTRY.pop(name, None)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_required_input_is_enforced_over_grpc(client, listing, name):
    info = listing[name]
    config = all_paths_config(info)
    tensors = full_batch(info)
    client.compute(name, config, **tensors)  # the full batch is valid
    checked = 0
    for spec in info.inputs:
        if not needed_under(spec, config, info):
            continue
        checked += 1
        reduced = {k: v for k, v in tensors.items() if declared_name(info, k) != spec.name}
        assert len(reduced) < len(tensors)
        with pytest.raises(AdvantageServiceError) as exc:
            client.compute(name, config, **reduced)
        err = exc.value
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (spec.name, err.code, str(err))
        assert spec.name in str(err), f"message does not name {spec.name!r}: {err}"
        assert any(spec.name in f for f, _ in err.field_violations), err.field_violations
    assert checked >= 2, f"{name}: expected at least mask and one more needed input"


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_optional_inputs_may_be_left_out(client, listing, name):
    """The converse: inputs not needed under the *default* config really are optional."""
    info = listing[name]
    tensors = full_batch(info)
    defaults = {f.name: default_of(info, f.name) for f in info.config_fields if f.type == "bool"}
    reduced = {k: v for k, v in tensors.items()
               if needed_under(next(s for s in info.inputs if s.name == declared_name(info, k)), defaults, info)}
    result = client.compute(name, None, as_numpy=True, **reduced)
    assert result.advantages.shape == (B, T) and np.isfinite(result.advantages).all()


# ------------------------------------------------------------------------- listing vs proto
def _proto_type(fd) -> str:
    if fd.enum_type is not None:
        return fd.enum_type.name
    if fd.message_type is not None:  # a nested config message (AReaL's NormConfig)
        return fd.message_type.name
    base = {fd.TYPE_BOOL: "bool", fd.TYPE_DOUBLE: "double", fd.TYPE_INT32: "int32"}[fd.type]
    return f"repeated {base}" if fd.is_repeated else base


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_enum_fields_list_their_allowed_values(listing, name):
    """An enum field lists the short names it accepts, each a value of the proto enum; others list none."""
    message = pb.DESCRIPTOR.message_types_by_name[listing[name].config_message.split(".")[-1]]
    for field in listing[name].config_fields:
        fd = message.fields_by_name[field.name]
        if fd.enum_type is None:
            assert not field.allowed_values, field.name
            continue
        prefix = fd.enum_type.values[0].name[: -len("UNSPECIFIED")]
        names = {v.name[len(prefix):].lower() for v in fd.enum_type.values if v.number}
        assert field.allowed_values and set(field.allowed_values) <= names, (field.name, field.allowed_values)
        assert field.default_value.split(" (")[0] in field.allowed_values, (field.name, field.default_value)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_config_fields_match_the_proto_message(listing, name):
    info = listing[name]
    assert info.config_field == name
    oneof = pb.ComputeAdvantageRequest.DESCRIPTOR.oneofs_by_name["estimator"]
    fd = next(f for f in oneof.fields if f.name == name)
    assert fd.message_type.full_name == info.config_message
    message = pb.DESCRIPTOR.message_types_by_name[info.config_message.split(".")[-1]]
    listed = [f.name for f in info.config_fields]
    assert len(listed) == len(set(listed)), f"duplicate config fields: {listed}"
    # same names (the order is the config dataclass's: inherited KL fields come first)
    assert set(listed) == {f.name for f in message.fields}
    for field in info.config_fields:
        assert field.type == _proto_type(message.fields_by_name[field.name]), field.name
        assert field.description, f"{name}.{field.name} has no description"
    assert info.description and info.reference
    for spec in info.inputs:
        assert spec.shapes and spec.kind in ("float", "integer", "mask") and spec.description


NEMO_DEFAULTS = {
    # OpenRLHF 0.11.2's --reward.clip_range and --algo.advantage.no_std_norm defaults (openrlhf semantics only)
    "reward_clip_min": -10.0,
    "reward_clip_max": 10.0,
    "no_std_norm": False,
    "normalize_rewards": True,
    "use_leave_one_out_baseline": True,
    "minus_baseline": True,
    "normalize_advantages": True,
    "use_kl_in_reward": False,
    "gae_lambda": 0.95,
    "gae_gamma": 1.0,
    "length_adaptive_alpha": 0.0,
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "gae_lambda_value": "unset",
    "gae_lambda_policy": "unset",
    "reward_weights": ("unset", "[]"),
    "semantics": "nemo_rl",
    "epsilon": 1e-6,
    "scale_rewards": "group",  # trl only; the first word of the listed default
    "gamma": 1.0,              # verl and openrlhf only
    # options asked for in public bug reports (issue 10): off by default, so the references are reproduced
    "exclude_empty_responses": False,
    "sum_rewards_over_mask": False,   # verl semantics only
    "allow_missing_rewards": False,   # gdpo
}
#: defaults of the estimators that follow verl (and of fields whose listed default is per estimator)
VERL_DEFAULTS = {
    ("rloo", "normalize_advantages"): False,  # TRL 1.16.0 RLOOConfig (trl semantics only)
    # slime (slime semantics only): its rollout's reward normalisation is on by default, --normalize-advantages
    # is off, but slime requires it for reinforce_plus_plus and reinforce_plus_plus_baseline
    ("grpo", "rewards_normalization"): True,
    ("grpo", "normalize_advantages"): False,
    ("reinforce_plus_plus", "normalize_advantages"): True,
    ("reinforce_plus_plus_baseline", "rewards_normalization"): True,
    ("reinforce_plus_plus_baseline", "normalize_advantages"): True,
    # prime-rl (prime_rl semantics only): its length_penalty is unset by default; LinearLengthPenaltyConfig's weights
    ("grpo", "length_penalty"): False,
    ("grpo", "num_output_tokens_weight"): 0.25,
    ("grpo", "num_input_tokens_weight"): 0.1,
    ("grpo", "num_turns_weight"): 0.1,
    ("grpo_passk", "normalize_rewards"): True,
    ("grpo_passk", "epsilon"): 1e-6,
    ("gpg", "f_norm"): 1.0,
    ("optimal_token_baseline", "handle_zero_tail"): True,   # verl 0.9.1's function default
    ("reinforce_plus_plus", "reset_returns_at_holes"): False,  # verl only; true = verl 0.8's recursion
    ("optimal_token_baseline", "epsilon"): 1e-8,
    ("tir_optimal_token_baseline", "handle_zero_tail"): True,
    ("tir_optimal_token_baseline", "epsilon"): 1e-8,
    ("reinforce_plus_plus_baseline", "semantics"): "verl",
    ("rloo", "semantics"): "verl",
    ("pkpo", "k"): "1",                 # rLLM algorithm.pass_at_k (PR #743)
    ("qae", "quantile_k"): 0.4,         # the QAE release's recommended value
    ("gigpo", "semantics"): "verl_agent",
    ("gigpo", "gamma"): 0.95,           # verl-agent's GiGPO example scripts (trinity: 1.0)
    ("gigpo", "step_advantage_weight"): 1.0,
    ("gigpo", "mode"): "mean_norm",
    ("gigpo", "epsilon"): 1e-6,
    ("maxrl", "semantics"): "skyrl",
    ("maxrl", "epsilon"): 1e-6,         # SkyRL's compute_maxrl_advantage default
    # AReaL 1.0.4's PPOActorConfig defaults (areal/api/cli_args.py); the two NormConfigs unset = None
    ("areal", "semantics"): "areal",
    ("areal", "reward_bias"): 0.0,
    ("areal", "reward_scaling"): 1.0,
    ("areal", "reward_clip"): 20.0,
    ("areal", "reward_norm"): "unset",
    ("areal", "kl_ctl"): 0.1,
    ("areal", "kl_estimator"): "k1",
    ("areal", "discount"): 1.0,
    ("areal", "gae_lambda"): 1.0,
    ("areal", "adv_norm"): "unset",
    ("areal", "mask_no_eos_with_zero"): False,
    ("areal", "recompute_logprob"): False,
    ("areal", "use_decoupled_loss"): False,
    # ROLL's PPOConfig defaults (roll/configs/base_config.py at the roll reference's commit)
    **{(est, "reward_clip"): "unset" for est in ("grpo", "reinforce_plus_plus", "gae")},
    **{(est, "advantage_clip"): "unset" for est in ("grpo", "reinforce_plus_plus", "gae")},
    **{(est, "whiten_rewards"): False for est in ("grpo", "reinforce_plus_plus", "gae")},
    ("reinforce_plus_plus", "segment_returns"): False,  # roll only: true = ROLL's agentic_reinforce
    **{(est, f): "none" for est in ("reinforce_plus_plus", "gae") for f in ("norm_mean_type", "norm_std_type")},
    ("grpo", "gamma"): 1.0,
}
#: the full listed text of each default that depends on the semantics
PER_SEMANTICS_TEXT = {
    ("gigpo", "gamma"): "0.95 (verl_agent, roll); 1.0 (trinity)",
    ("grpo", "use_leave_one_out_baseline"): "true (nemo_rl); not applicable otherwise",
    ("grpo", "epsilon"): "1e-06 (nemo_rl, verl, skyrl, slime); 1e-09 (openrlhf); 0.0001 (trl)",
    ("grpo", "scale_rewards"): "group (trl); not applicable otherwise",
    ("reinforce_plus_plus", "minus_baseline"): "true (nemo_rl); not applicable otherwise",
    ("reinforce_plus_plus", "gamma"): "1.0 (verl, openrlhf, skyrl, slime, roll); not applicable to nemo_rl",
    ("gae", "gae_lambda"): "0.95 (nemo_rl, roll); 1.0 (verl, skyrl, openrlhf, slime)",
    ("grpo", "use_kl_in_reward"): "false (openrlhf, roll); not applicable otherwise",
    ("gae", "length_adaptive_alpha"): "0.0 (nemo_rl); not applicable otherwise",
    ("grpo", "sum_rewards_over_mask"): "false (verl); not applicable otherwise",
    ("rloo", "sum_rewards_over_mask"): "false (verl); not applicable otherwise",
    ("reinforce_plus_plus_baseline", "sum_rewards_over_mask"): "false (verl); not applicable otherwise",
    ("reinforce_plus_plus", "exclude_empty_responses"): "false (nemo_rl); not applicable otherwise",
    ("reinforce_plus_plus", "reset_returns_at_holes"): "false (verl); not applicable otherwise",
    ("gdpo", "use_leave_one_out_baseline"): "true (nemo_rl); not applicable to verl",
    ("gdpo", "epsilon"): "1e-06 (verl); not applicable to nemo_rl",
    ("gae", "reward_clip_min"): "-10.0 (openrlhf); not applicable otherwise",
    ("gae", "reward_clip_max"): "10.0 (openrlhf); not applicable otherwise",
    ("grpo", "reward_clip_min"): "-10.0 (openrlhf); not applicable otherwise",
    ("grpo", "reward_clip_max"): "10.0 (openrlhf); not applicable otherwise",
    ("reinforce_plus_plus", "reward_clip_min"): "-10.0 (openrlhf); not applicable otherwise",
    ("reinforce_plus_plus", "reward_clip_max"): "10.0 (openrlhf); not applicable otherwise",
    ("reinforce_plus_plus_baseline", "reward_clip_min"): "-10.0 (openrlhf); not applicable otherwise",
    ("reinforce_plus_plus_baseline", "reward_clip_max"): "10.0 (openrlhf); not applicable otherwise",
    ("rloo", "reward_clip_min"): "-10.0 (openrlhf); none (trl); not applicable otherwise",
    ("rloo", "reward_clip_max"): "10.0 (openrlhf); none (trl); not applicable otherwise",
    ("rloo", "normalize_advantages"): "false (trl); not applicable otherwise",
    ("rloo", "exclude_empty_responses"): "false (verl, openrlhf, skyrl); not applicable otherwise",
    ("rloo", "reference_policy_kl_type"): "k3 (verl, openrlhf, skyrl); k1 (trl: RLOOTrainer's log-prob difference)",
    ("rloo", "kl_input_clamp_value"): "20.0 (verl, openrlhf, skyrl); none (trl)",
    ("rloo", "kl_output_clamp_value"): "10.0 (verl, openrlhf, skyrl); none (trl)",
    ("gae", "no_std_norm"): "false (openrlhf); not applicable otherwise",
    ("reinforce_plus_plus", "no_std_norm"): "false (openrlhf); not applicable otherwise",
    ("reinforce_plus_plus_baseline", "no_std_norm"): "false (openrlhf); not applicable otherwise",
    # slime (issue #38)
    ("grpo", "rewards_normalization"): "true (slime); not applicable otherwise",
    ("grpo", "normalize_advantages"): "false (slime); false (roll); not applicable otherwise",
    ("reinforce_plus_plus", "normalize_advantages"): "true (slime); false (roll); not applicable otherwise",
    ("reinforce_plus_plus_baseline", "rewards_normalization"): "true (slime); not applicable otherwise",
    ("reinforce_plus_plus_baseline", "normalize_advantages"): "true (slime); not applicable otherwise",
    ("gae", "normalize_advantages"): "true (nemo_rl, verl, skyrl, openrlhf); false (slime: --normalize-advantages is off by default; roll: ROLL's whiten_advantages)",
    ("reinforce_plus_plus", "reference_policy_kl_type"): "k3 (nemo_rl, verl, openrlhf, skyrl); k1 (slime, roll)",
    ("reinforce_plus_plus", "kl_input_clamp_value"): "20.0 (nemo_rl, verl, openrlhf, skyrl); none (slime, roll)",
    ("reinforce_plus_plus", "kl_output_clamp_value"): "10.0 (nemo_rl, verl, openrlhf, skyrl); none (slime, roll)",
    ("reinforce_plus_plus_baseline", "reference_policy_kl_type"): "k3 (verl, openrlhf); k1 (slime)",
    ("reinforce_plus_plus_baseline", "kl_input_clamp_value"): "20.0 (verl, openrlhf); none (slime)",
    ("reinforce_plus_plus_baseline", "kl_output_clamp_value"): "10.0 (verl, openrlhf); none (slime)",
    ("gae", "reference_policy_kl_type"): "k3 (nemo_rl, verl, skyrl, openrlhf); k1 (slime, roll)",
    ("gae", "kl_input_clamp_value"): "20.0 (nemo_rl, verl, skyrl, openrlhf); none (slime, roll)",
    ("gae", "kl_output_clamp_value"): "10.0 (nemo_rl, verl, skyrl, openrlhf); none (slime, roll)",
    # ROLL's RLVR step (issue #38): its PPOConfig defaults (roll/configs/base_config.py)
    **{(est, "reward_clip"): "unset (roll); not applicable otherwise"
       for est in ("grpo", "reinforce_plus_plus", "gae")},
    **{(est, "advantage_clip"): "unset (roll); not applicable otherwise"
       for est in ("grpo", "reinforce_plus_plus", "gae")},
    **{(est, "whiten_rewards"): "false (roll); not applicable otherwise" for est in ("grpo", "reinforce_plus_plus", "gae")},
    ("reinforce_plus_plus", "segment_returns"): "false (roll); not applicable otherwise",
    **{(est, f): "none (roll); not applicable otherwise"
       for est in ("reinforce_plus_plus", "gae") for f in ("norm_mean_type", "norm_std_type")},
    ("grpo", "gamma"): "1.0 (roll); not applicable otherwise",
    ("grpo", "reference_policy_kl_type"): "k3 (nemo_rl, verl, openrlhf, trl, skyrl, slime); k1 (roll)",
    ("grpo", "kl_input_clamp_value"): "20.0 (nemo_rl, verl, openrlhf, trl, skyrl, slime); none (roll)",
    ("grpo", "kl_output_clamp_value"): "10.0 (nemo_rl, verl, openrlhf, trl, skyrl, slime); none (roll)",
    # prime-rl (issue #38)
    ("grpo", "length_penalty"): "false (prime_rl); not applicable otherwise",
    ("grpo", "num_output_tokens_weight"): "0.25 (prime_rl); not applicable otherwise",
    ("grpo", "num_input_tokens_weight"): "0.1 (prime_rl); not applicable otherwise",
    ("grpo", "num_turns_weight"): "0.1 (prime_rl); not applicable otherwise",
    ("maxrl", "epsilon"): "1e-06 (skyrl); not applicable otherwise",
}


def _check_default(name: str, field: str, got: str, want) -> None:
    first = got.split(" (")[0]
    if isinstance(want, bool):
        assert first == str(want).lower(), (name, field, got)
    elif isinstance(want, float):
        assert float(first) == want, (name, field, got)
    elif isinstance(want, tuple):
        assert got in want, (name, field, got)
    else:
        assert first == want, (name, field, got)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_defaults_are_the_references_defaults(listing, name):
    """The six NeMo RL estimators list NeMo RL's defaults (under their default semantics, nemo_rl); the
    others verl's; a default that depends on the semantics is listed with each reference's value."""
    for field in listing[name].config_fields:
        key = (name, field.name)
        if key in PER_SEMANTICS_TEXT:
            assert field.default_value == PER_SEMANTICS_TEXT[key], (key, field.default_value)
        want = VERL_DEFAULTS.get(key, NEMO_DEFAULTS.get(field.name, KeyError))
        assert want is not KeyError, f"no expected default for {name}.{field.name}"
        _check_default(name, field.name, field.default_value, want)


def test_every_default_listed():
    """The defaults tables above cover each field at least once (so a new field forces a new row)."""
    # the estimators' config messages (not the messages nested in them: AReaL's ArealNormConfig)
    configs = [fd.message_type for fd in pb.ComputeAdvantageRequest.DESCRIPTOR.oneofs_by_name["estimator"].fields]
    names = {f.name for e in configs for f in e.fields}
    assert names == set(NEMO_DEFAULTS) | {f for _, f in VERL_DEFAULTS}


# ------------------------------------------------------------------ returns / metrics contract
ALWAYS_RETURNS = {"gae", "remax", "optimal_token_baseline", "tir_optimal_token_baseline", "areal"}
RETURNS_WHEN = {"grpo": "semantics = openrlhf or semantics = slime or semantics = roll",
                "reinforce_plus_plus": "semantics = verl or semantics = openrlhf or semantics = skyrl or "
                                       "semantics = slime or semantics = roll",
                "reinforce_plus_plus_baseline": "semantics = openrlhf or semantics = slime",
                "rloo": "semantics = openrlhf"}


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_returns_and_metrics_match_the_listing(client, listing, name):
    info = listing[name]
    assert info.produces_returns == (name in ALWAYS_RETURNS)
    assert info.returns_when == RETURNS_WHEN.get(name, "")
    assert not (info.produces_returns and info.returns_when)
    assert bool(info.metrics) == (name == "opd")
    for semantics in semantics_configs(info):
        config = {**all_paths_config(info, semantics.get("semantics")), **semantics}
        if semantics and semantics["semantics"] != default_of(info, "semantics"):
            config = {"semantics": semantics["semantics"]}  # the other semantics do not take the NeMo-only bools
        result = client.compute(name, config, as_numpy=True, **full_batch(info, seed=1))
        assert result.advantages.shape == (B, T)
        expect = info.produces_returns or (bool(info.returns_when) and condition_holds(info.returns_when, info, config))
        if expect:
            assert result.returns is not None and result.returns.shape == (B, T), (name, config)
            assert np.isfinite(result.returns).all()
        else:
            assert result.returns is None, f"{name} must not set returns under {config}"
        assert set(result.metrics) == set(info.metrics)
        assert all(np.isfinite(v) for v in result.metrics.values())


def test_opd_metric_values(client, listing):
    tensors = full_batch(listing["opd"], seed=2)
    result = client.compute("opd", None, as_numpy=True, **tensors)
    valid = tensors["mask"].astype(bool)
    gap = (tensors["teacher_logprobs"] - tensors["prev_logprobs"]).astype(np.float64)
    np.testing.assert_allclose(result.advantages, gap * tensors["mask"], rtol=1e-6, atol=1e-6)
    m = result.metrics
    np.testing.assert_allclose(m["on_policy_distillation/teacher_student_logprob_gap_mean"], gap[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["on_policy_distillation/adv_mean"], gap[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["on_policy_distillation/adv_std"], gap[valid].std(ddof=1), rtol=1e-5)


# ------------------------------------------------------------------------------- registry
def test_registry_rejects_a_duplicate_name():
    before = REGISTRY["grpo"]
    with pytest.raises(ValueError, match="grpo"):
        register("grpo", config=EstimatorConfig, inputs=[MASK], reference="x")(lambda cfg, batch: None)
    assert REGISTRY["grpo"] is before


def test_registry_requires_mask():
    with pytest.raises(ValueError, match="mask"):
        register("_no_mask", config=EstimatorConfig, inputs=[], reference="x")(lambda cfg, batch: None)
    assert "_no_mask" not in REGISTRY
