"""The wire format: everything that turns Python values into `advantage.v1` messages and back.

One module for the whole mapping, used by both the client and the server:

* tensors: ``numpy.ndarray`` / ``torch.Tensor`` <-> ``advantage.v1.Tensor`` (raw little-endian,
  C-contiguous bytes; see the .proto);
* estimator configs: ``dict`` with NeMo RL key names <-> the typed ``*Config`` messages of the
  ``ComputeAdvantageRequest.estimator`` oneof;
* the estimator name <-> oneof field table;
* group labels (``prompt_ids`` as ``[B, L]`` rows or strings) -> ``[B]`` int64 ids (:func:`reduce_prompt_ids`).

Errors: :class:`WireError` (a ``ValueError``) names the offending field; the server turns it into
INVALID_ARGUMENT, the client raises it before sending anything.
"""
from __future__ import annotations

import difflib
import math
import numbers
import re
import sys
import types
import warnings
from typing import Any, Mapping

import numpy as np

from advantage_client._proto.advantage.v1 import advantage_pb2 as pb

try:  # torch is optional on the client side
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("advantage_client assumes a little-endian host")

#: estimator name -> (oneof field in ComputeAdvantageRequest, config message class)
ESTIMATOR_FIELDS: dict[str, tuple[str, type]] = {
    "grpo": ("grpo", pb.GRPOConfig),
    "gdpo": ("gdpo", pb.GDPOConfig),
    "reinforce_plus_plus": ("reinforce_plus_plus", pb.ReinforcePlusPlusConfig),
    "raw_reward": ("raw_reward", pb.RawRewardConfig),
    "gae": ("gae", pb.GAEConfig),
    "opd": ("opd", pb.OPDConfig),
    "grpo_passk": ("grpo_passk", pb.GRPOPassKConfig),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", pb.ReinforcePlusPlusBaselineConfig),
    "rloo": ("rloo", pb.RLOOConfig),
    "opo": ("opo", pb.OPOConfig),
    "remax": ("remax", pb.ReMaxConfig),
    "gpg": ("gpg", pb.GPGConfig),
    "optimal_token_baseline": ("optimal_token_baseline", pb.OptimalTokenBaselineConfig),
    "tir_optimal_token_baseline": ("tir_optimal_token_baseline", pb.TIROptimalTokenBaselineConfig),
    "gigpo": ("gigpo", pb.GiGPOConfig),
    "pkpo": ("pkpo", pb.PKPOConfig),
    "qae": ("qae", pb.QAEConfig),
    "maxrl": ("maxrl", pb.MaxRLConfig),
    "areal": ("areal", pb.ArealConfig),
}

#: names other frameworks (or papers) give an estimator -> (the service's name, what to say about it); used only
#: to suggest the name in an "unknown estimator" error, never accepted in its place (the adapters that take a
#: framework's own names map them: advantage_client.openrlhf, advantage_client.verl)
ESTIMATOR_ALIASES: dict[str, tuple[str, str]] = {
    "ppo": ("gae", "PPO's advantage estimator is GAE"),
    "reinforce": ("reinforce_plus_plus", "OpenRLHF's name; advantage_client.openrlhf maps it"),
    "reinforce_baseline": ("reinforce_plus_plus_baseline", "OpenRLHF's name; advantage_client.openrlhf maps it"),
    "group_norm": ("grpo", "OpenRLHF's name; advantage_client.openrlhf maps it"),
    "dr_grpo": ("grpo", "OpenRLHF's name, grpo with normalize_rewards=False; advantage_client.openrlhf maps it"),
    "grpo_vectorized": ("grpo", "verl's name; advantage_client.verl maps it"),
    "rloo_vectorized": ("rloo", "verl's name; advantage_client.verl maps it"),
}


def _name_key(name: str) -> str:
    """``name`` as names are compared for a suggestion: lower case, ``++`` as ``_plus_plus``, ``-``, ``.``
    and spaces as ``_``, ``@`` dropped (``"REINFORCE++ baseline"`` -> ``"reinforce_plus_plus_baseline"``,
    ``"grpo_pass@k"`` -> ``"grpo_passk"``)."""
    key = str(name).strip().lower().replace("++", "_plus_plus").replace("@", "")
    return re.sub(r"_+", "_", re.sub(r"[-. ]", "_", key)).strip("_")


def did_you_mean(name: Any, choices: Any, aliases: Mapping[str, tuple[str, str]] | None = None) -> str:
    """A suggestion for the unknown ``name`` among ``choices``: ``" Did you mean 'gae' (PPO's advantage
    estimator is GAE)?"`` (with a leading space), or ``""`` when nothing is close. Tried in order: the same
    name in another case or spelling (``GAE``, ``reinforce++``: :func:`_name_key`), a known alias
    (``aliases``, e.g. :data:`ESTIMATOR_ALIASES`; only one whose name is among ``choices``), then
    ``difflib``'s close matches (up to 3, compared in lower case)."""
    choices = [str(c) for c in choices]
    by_key = {_name_key(c): c for c in choices}
    key = _name_key(name)
    if key in by_key:
        case = " (names are case-sensitive)" if str(name).strip().lower() == by_key[key].lower() else ""
        return f" Did you mean {by_key[key]!r}{case}?"
    if aliases and key in aliases and aliases[key][0] in choices:
        target, note = aliases[key]
        return f" Did you mean {target!r} ({note})?"
    close = difflib.get_close_matches(key, list(by_key), n=3, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(by_key[c]) for c in close) + "?"


def unknown_estimator(name: Any, known: Any) -> str:
    """The description of an "unknown estimator" error: ``name`` is not among ``known`` (the estimator names
    that side runs), with :func:`did_you_mean`'s suggestion and every name to choose from. The client's
    :class:`WireError`, the server's INVALID_ARGUMENT and the drop-ins all say it so."""
    return (f"unknown estimator {name!r}.{did_you_mean(name, known, ESTIMATOR_ALIASES)} Choose one of "
            f"{', '.join(sorted(known))}")

# dtype enum <-> (numpy dtype used to view the bytes, torch dtype, itemsize, name)
_NP = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),  # numpy has no bfloat16: raw 16-bit view
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BOOL: np.dtype("?"),
    pb.DTYPE_UINT8: np.dtype("u1"),
}
#: ``advantage.v1.DType`` code -> the numpy dtype its bytes are viewed as (bfloat16: raw ``<u2``)
NUMPY_DTYPES = _NP
DTYPE_NAMES = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT64: "float64",
    pb.DTYPE_BFLOAT16: "bfloat16",
    pb.DTYPE_FLOAT16: "float16",
    pb.DTYPE_INT64: "int64",
    pb.DTYPE_INT32: "int32",
    pb.DTYPE_BOOL: "bool",
    pb.DTYPE_UINT8: "uint8",
}
_BY_NAME = {name: code for code, name in DTYPE_NAMES.items()}
_FROM_NP = {np.dtype(n): c for c, n in DTYPE_NAMES.items() if n != "bfloat16"}
if torch is not None:
    _TORCH = {
        pb.DTYPE_FLOAT32: torch.float32,
        pb.DTYPE_FLOAT64: torch.float64,
        pb.DTYPE_BFLOAT16: torch.bfloat16,
        pb.DTYPE_FLOAT16: torch.float16,
        pb.DTYPE_INT64: torch.int64,
        pb.DTYPE_INT32: torch.int32,
        pb.DTYPE_BOOL: torch.bool,
        pb.DTYPE_UINT8: torch.uint8,
    }
    _FROM_TORCH = {v: k for k, v in _TORCH.items()}
    #: torch dtype -> ``advantage.v1.DType`` code (only where torch is installed)
    TORCH_DTYPE_CODES = _FROM_TORCH

_KL_TYPES = {"k1": pb.KL_TYPE_K1, "k2": pb.KL_TYPE_K2, "k3": pb.KL_TYPE_K3}
KL_TYPE_NAMES = {v: k for k, v in _KL_TYPES.items()} | {pb.KL_TYPE_UNSPECIFIED: None}


_ENUM_NAMES: dict[str, Mapping[int, str | None]] = {}


def enum_names(enum_descriptor: Any) -> Mapping[int, str | None]:
    """Enum value -> its short config name, the value name without the enum's prefix, in lower case
    (``KL_TYPE_K3`` -> ``"k3"``, ``SEMANTICS_NEMO_RL`` -> ``"nemo_rl"``); the ``_UNSPECIFIED`` zero
    value -> ``None`` (unset). A read-only mapping, made once per enum (the server reads it on every call)."""
    names = _ENUM_NAMES.get(enum_descriptor.full_name)
    if names is None:
        values = list(enum_descriptor.values)
        prefix = values[0].name[: -len("UNSPECIFIED")]
        names = _ENUM_NAMES[enum_descriptor.full_name] = types.MappingProxyType(
            {v.number: (None if v.number == 0 else v.name[len(prefix):].lower()) for v in values})
    return names


class WireError(ValueError):
    """A value that cannot be encoded or decoded; ``field`` names it (``inputs['mask']``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


def dtype_code(name_or_code: Any) -> int:
    """``"float32"`` / ``torch.float32`` / ``np.float32`` / enum value -> ``DType`` enum value."""
    if isinstance(name_or_code, int) and name_or_code in DTYPE_NAMES:
        return name_or_code
    if isinstance(name_or_code, str) and name_or_code in _BY_NAME:
        return _BY_NAME[name_or_code]
    if torch is not None and isinstance(name_or_code, torch.dtype) and name_or_code in _FROM_TORCH:
        return _FROM_TORCH[name_or_code]
    try:
        return _FROM_NP[np.dtype(name_or_code)]
    except (TypeError, KeyError):
        raise WireError("output_dtype", f"unsupported dtype {name_or_code!r}; use one of {sorted(_BY_NAME)}") from None



#: the result dtypes the service returns (``ComputeAdvantageRequest.output_dtype``; the server refuses every
#: other code with INVALID_ARGUMENT): float32 is the default
OUTPUT_DTYPES = ("float32", "float64", "bfloat16", "float16")


def output_dtype_code(value: Any) -> int:
    """An ``output_dtype`` (``"float64"``, ``torch.float64``, ``np.float64``, the ``DType`` value) -> its
    ``DType`` value, when it is one of :data:`OUTPUT_DTYPES`. Raises :class:`WireError` (a ``ValueError``)
    naming the four otherwise, before anything is sent: the results are floating point, and the server
    refuses an integer or bool ``output_dtype`` (INVALID_ARGUMENT) although tensors of those dtypes are
    valid inputs."""
    try:
        code = dtype_code(value)
    except WireError:
        code = None
    if code is None or DTYPE_NAMES[code] not in OUTPUT_DTYPES:
        what = DTYPE_NAMES[code] if code is not None else value
        raise WireError("output_dtype", f"{what!r} is not a dtype the service returns results in: it returns "
                                        f"float32 (the default), float64, bfloat16 or float16. Pass one of "
                                        f"{', '.join(repr(n) for n in OUTPUT_DTYPES)} (or None), and cast the "
                                        "result if you need another dtype")
    return code


# ----------------------------------------------------------------------------------------- tensors
#: integer dtypes the schema has no code for, sent as the narrowest wire integer that holds all of their
#: values exactly (the server takes integers for masks and for every float input: rewards from a 0/1
#: verifier); uint64 only while its values fit int64
_WIDEN = {np.dtype(np.int8): np.dtype("<i4"), np.dtype(np.int16): np.dtype("<i4"),
          np.dtype(np.uint16): np.dtype("<i4"), np.dtype(np.uint32): np.dtype("<i8"),
          np.dtype(np.uint64): np.dtype("<i8")}


def _unsupported(field: str, dtype: Any) -> WireError:
    return WireError(field, f"dtype {dtype} is not supported; use one of {sorted(_BY_NAME)} (int8, int16, uint16, "
                            "uint32 and uint64 are sent as int32 or int64)")


def tensor_array(value: Any, field: str = "tensor") -> tuple[int, tuple[int, ...], np.ndarray]:
    """(``DType`` code, shape, the elements as a C-contiguous little-endian array: bfloat16 as int16) of a
    ``torch.Tensor``, ``numpy.ndarray`` or nested list: what :func:`encode_tensor` writes.

    Copies at most once (to make it contiguous, move it to the CPU, or widen it). Python floats become
    float32; int8, int16 and uint16 go as int32, uint32 and uint64 as int64 (all values exact).
    Raises :class:`WireError` naming ``field`` for dtypes the schema does not have (complex, strings,
    float8, ...) and for uint64 values beyond int64's range.
    """
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        shape = tuple(t.shape)
        if t.dtype in _FROM_TORCH:
            t = t.to("cpu").contiguous()
            return _FROM_TORCH[value.dtype], shape, (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
        if t.is_floating_point() or t.is_complex():
            raise _unsupported(field, t.dtype)
        try:  # an integer dtype the wire lacks (int8, uint16, ...): widened below
            arr = t.to("cpu").contiguous().numpy()
        except (TypeError, RuntimeError):  # quantized and other dtypes numpy has no view of
            raise _unsupported(field, t.dtype) from None
    else:
        arr = np.asarray(value)
        if arr.dtype == np.float64 and not isinstance(value, np.ndarray):
            arr = arr.astype(np.float32)  # Python floats: float32, the dtype trainers use
    if arr.dtype in _WIDEN:
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise WireError(field, f"holds the uint64 value {int(arr.max())}, beyond int64's range (the widest "
                                   "integer the wire carries): rescale it, or send it as float64 if rounding it is "
                                   "acceptable")
        arr = arr.astype(_WIDEN[arr.dtype])
    if arr.dtype not in _FROM_NP:
        raise _unsupported(field, arr.dtype)
    return _FROM_NP[arr.dtype], tuple(arr.shape), np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))


def encode_tensor(value: Any, field: str = "tensor") -> pb.Tensor:
    """Encode a ``torch.Tensor``, ``numpy.ndarray`` or nested list as an ``advantage.v1.Tensor``.

    Copies the bytes once (into the message), after :func:`tensor_array` (which may copy once: a tensor
    on a GPU is moved to the CPU first, a narrow or unsigned integer widened).
    Raises :class:`WireError` for dtypes the schema does not have (complex, strings, ...).
    """
    code, shape, arr = tensor_array(value, field)
    return pb.Tensor(dtype=code, shape=shape, data=arr.tobytes())


#: most dimensions a tensor may have (numpy's limit)
MAX_DIMS = 64


def _checked_layout(msg: pb.Tensor, field: str) -> tuple[np.dtype, tuple[int, ...]]:
    if msg.dtype not in _NP:
        raise WireError(
            f"{field}.dtype",
            f"dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype} is not "
            f"supported; set one of {', '.join(pb.DType.Name(c) for c in _NP)}",
        )
    if len(msg.shape) > MAX_DIMS:  # numpy (and so the server) lays out at most 64 dimensions
        raise WireError(f"{field}.shape", f"has {len(msg.shape)} dimensions; at most {MAX_DIMS} are supported")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{field}.shape", f"negative dimension in shape {list(shape)}")
    np_dtype = _NP[msg.dtype]
    expected = math.prod(shape) * np_dtype.itemsize
    if expected != len(msg.data):
        raise WireError(
            f"{field}.data",
            f"holds {len(msg.data)} bytes but shape {list(shape)} of {DTYPE_NAMES[msg.dtype]} needs {expected} "
            "(prod(shape) * itemsize, little-endian, C order)",
        )
    return np_dtype, shape


def decode_numpy(msg: pb.Tensor, field: str = "tensor") -> np.ndarray:
    """Decode to a read-only ``numpy.ndarray`` view of the message bytes (bfloat16 as ``uint16``)."""
    np_dtype, shape = _checked_layout(msg, field)
    return np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)


def decode_torch(msg: pb.Tensor, field: str = "tensor") -> "torch.Tensor":
    """Decode to a ``torch.Tensor`` sharing the message bytes; treat it as read-only."""
    if torch is None:  # pragma: no cover
        raise RuntimeError("decode_torch needs torch installed")
    arr = decode_numpy(msg, field)
    t = from_readonly_numpy(arr)
    return t.view(torch.bfloat16) if msg.dtype == pb.DTYPE_BFLOAT16 else t


_readonly_warned = False


def from_readonly_numpy(arr: np.ndarray) -> "torch.Tensor":
    """``torch.from_numpy`` of a possibly read-only array, without torch's "not writable" warning. torch warns
    once per process (``TORCH_WARN_ONCE``): only that first conversion runs under ``warnings.catch_warnings``
    (which costs ~10 us and swaps the process-wide filters, racing other threads); later ones are plain."""
    global _readonly_warned
    if _readonly_warned or arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        t = torch.from_numpy(arr)
    _readonly_warned = True
    return t


# ----------------------------------------------------------------------------------------- configs
def config_message(estimator: str, config: Any = None) -> Any:
    """Build the typed config message for ``estimator``.

    ``config`` may be ``None`` (all defaults), the config message itself, or a mapping with NeMo RL
    key names (``{"gae_lambda": 0.95, "reference_policy_kl_type": "k3"}``). Enum fields take their
    short names (``"k3"``, ``"verl"``, ``"group"``; see :func:`enum_names`) or the enum value.
    ``None`` values mean "unset". Unknown keys raise :class:`WireError` listing the valid ones.
    """
    if estimator not in ESTIMATOR_FIELDS:
        raise WireError("estimator", unknown_estimator(estimator, ESTIMATOR_FIELDS))
    _, cls = ESTIMATOR_FIELDS[estimator]
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if not isinstance(config, Mapping):
        raise WireError("config", f"expected a dict or {cls.__name__}, got {type(config).__name__}")
    if config.get("name") not in (None, estimator):
        raise WireError("config.name", f"{config['name']!r} does not match estimator {estimator!r}")
    msg = cls()
    _fill(msg, {k: v for k, v in config.items() if k != "name"}, "config")
    return msg


def _fill(msg: Any, config: Mapping[str, Any], path: str) -> None:
    """Set the fields of ``msg`` from the mapping ``config`` (see :func:`config_message`); a message-typed
    field (AReaL's ``reward_norm``) takes a nested mapping or the message. ``path`` prefixes error fields."""
    cls = type(msg)
    fields = cls.DESCRIPTOR.fields_by_name
    for key, value in config.items():
        if key not in fields:
            raise WireError(f"{path}.{key}", f"{cls.__name__} has no field {key!r}.{did_you_mean(key, fields)} "
                                             f"Valid: {sorted(fields)}")
        if value is None:
            continue
        try:
            if fields[key].message_type is not None:
                sub = getattr(msg, key)
                if isinstance(value, type(sub)):
                    sub.CopyFrom(value)
                elif isinstance(value, Mapping):
                    sub.SetInParent()  # an empty mapping still sets the field (all its defaults)
                    _fill(sub, value, f"{path}.{key}")
                else:
                    raise WireError(f"{path}.{key}", f"expected a dict or {type(sub).__name__}, got {type(value).__name__}")
            elif fields[key].enum_type is not None:
                codes = {name: code for code, name in enum_names(fields[key].enum_type).items() if name}
                if isinstance(value, str) and value.lower() in codes:
                    setattr(msg, key, codes[value.lower()])
                elif isinstance(value, int) and not isinstance(value, bool) and value in enum_names(fields[key].enum_type):
                    setattr(msg, key, value)
                else:
                    hint = did_you_mean(value, codes) if isinstance(value, str) else ""
                    raise WireError(f"{path}.{key}", f"{value!r} is not one of {sorted(codes)}.{hint}")
            elif fields[key].is_repeated:
                getattr(msg, key).extend(float(v) for v in value)
            elif fields[key].type == fields[key].TYPE_BOOL:
                if not isinstance(value, (bool, np.bool_)):
                    raise WireError(f"{path}.{key}", f"expected a bool, got {value!r}")
                setattr(msg, key, bool(value))
            elif fields[key].type in (fields[key].TYPE_INT32, fields[key].TYPE_INT64):
                if isinstance(value, (bool, np.bool_)) or not float(value).is_integer():
                    raise WireError(f"{path}.{key}", f"expected an integer, got {value!r}")
                setattr(msg, key, int(value))
            else:
                setattr(msg, key, float(value))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, WireError):
                raise
            raise WireError(f"{path}.{key}", f"bad value {value!r}: {exc}") from None


def config_to_dict(msg: Any) -> dict[str, Any]:
    """The fields set in a config message, as a dict with NeMo RL key names (unset fields omitted)."""
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        if fd.is_repeated:
            values = list(getattr(msg, fd.name))
            if values:
                out[fd.name] = values
        elif fd.enum_type is not None:
            name = enum_names(fd.enum_type).get(getattr(msg, fd.name))
            if name is not None:
                out[fd.name] = name
        elif fd.message_type is not None:
            if msg.HasField(fd.name):
                out[fd.name] = config_to_dict(getattr(msg, fd.name))
        elif msg.HasField(fd.name):
            out[fd.name] = getattr(msg, fd.name)
    return out


def _factorize(labels: np.ndarray) -> np.ndarray:
    """Hashable labels -> int64 ids, equal labels (``==``) sharing an id, in order of first appearance."""
    ids: dict[Any, int] = {}
    return np.fromiter((ids.setdefault(x, len(ids)) for x in labels), dtype=np.int64, count=len(labels))


#: inputs that are labels (equal values = same group, trajectory or anchor state), reduced by
#: :func:`reduce_prompt_ids` before they are sent: ``prompt_ids`` (every group estimator), ``trajectory_ids``
#: and ``anchor_ids`` (gigpo)
LABEL_INPUTS = frozenset({"prompt_ids", "trajectory_ids", "anchor_ids"})


def reduce_prompt_ids(prompt_ids: Any, name: str = "prompt_ids") -> np.ndarray:
    """Group labels -> ``[B]`` int64 group ids (equal labels share an id, different labels never do).

    * ``[B]`` integer ids pass through unchanged; ``uint64`` ids (e.g. 8 bytes of a hash) are reinterpreted
      as int64, bit for bit, and a list of Python ints beyond int64 is factorized, so no two ids merge;
    * ``[B]`` labels of any other kind: a NumPy ``str``/``bytes``/``object`` array or a list of strings
      (verl's uid strings, verl-agent's anchor observations). Labels are compared as given, so ``"007"`` and
      ``"7"`` are two groups;
    * ``[B, L]`` prompt token rows (integers, or strings): equal rows share an id.

    ``name``: the input (one of :data:`LABEL_INPUTS`), for the message of the ``WireError`` (a ValueError)
    raised for labels of another rank.
    """
    if hasattr(prompt_ids, "detach"):
        arr = prompt_ids.detach().cpu().numpy()
    else:
        arr = np.asarray(prompt_ids)
        if arr.dtype.kind in "US" and isinstance(prompt_ids, (list, tuple)):
            labels = np.asarray(prompt_ids, dtype=object)
            if not all(isinstance(x, (str, bytes)) for x in labels.ravel()):
                arr = labels  # a list mixing 7 and "7": numpy would turn both into "7"
        elif arr.dtype.kind in "fO" and isinstance(prompt_ids, (list, tuple)):
            labels = np.asarray(prompt_ids, dtype=object)
            if labels.ndim == 1 and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in labels):
                return _factorize(labels)  # ints beyond int64 (numpy made them object or float): exact
    if arr.dtype.kind in "USO":
        if arr.ndim == 2:
            if arr.dtype.kind == "O":
                return _factorize(np.fromiter((tuple(row) for row in arr), dtype=object, count=len(arr)))
            return np.unique(arr, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
        if arr.ndim != 1:
            raise WireError(f"inputs['{name}']", f"labels must be [B] or [B, L], got shape {list(arr.shape)}")
        if arr.dtype.kind == "O":
            try:
                return np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64)
            except TypeError:  # labels of mixed, unorderable types
                return _factorize(arr)
        return np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]  # one-token rows: equal rows are equal values, the ids as they are
    if arr.dtype == np.uint64:
        arr = arr.view(np.int64)  # bijective: equal ids stay equal, distinct ones distinct
    if arr.ndim == 2:
        return _row_ids(arr)
    return arr


#: elements of ``[B, L]`` rows hashed at once by :func:`_row_ids` (bounds its temporaries to ~16 MiB each)
_ROW_CHUNK_ELEMENTS = 1 << 21
_ROW_KEY = np.random.SeedSequence().generate_state(2, dtype=np.uint64)  # per process: collisions cannot be made
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """``[B, L]`` integer or bool rows -> ``[B]`` int64 ids, equal rows sharing one, different rows never.

    Each row is hashed (the sum over its elements of splitmix64's finalizer of ``x ^ key[j]``, a random key
    per process), the ``[B]`` hashes are ranked (``np.unique``, one sort of B numbers) and every row is
    compared with its group's first row: rows that differ under one hash (a collision) fall back to the exact
    row sort. Linear in the ``B * L`` elements plus the sort of B hashes: uint8 ``[4M, 1]`` 4.9 s -> 0 (one
    column: the values are the ids), int64 ``[64k, 2048]`` minutes -> about 2 s (``np.unique(axis=0)``'s
    comparisons of structured rows before)."""
    if rows.dtype.kind not in "biu" or 0 in rows.shape:
        return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    B, L = rows.shape
    key = _ROW_KEY[0] * np.arange(L, dtype=np.uint64) + _ROW_KEY[1]
    hashes = np.empty(B, dtype=np.uint64)
    step = max(1, _ROW_CHUNK_ELEMENTS // L)
    with np.errstate(over="ignore"):
        for lo in range(0, B, step):
            z = rows[lo:lo + step].astype(np.uint64) ^ key
            z ^= z >> np.uint64(30)
            z *= _MIX1
            z ^= z >> np.uint64(27)
            z *= _MIX2
            z ^= z >> np.uint64(31)
            hashes[lo:lo + step] = z.sum(axis=1, dtype=np.uint64)
    _, first, ids = np.unique(hashes, return_index=True, return_inverse=True)
    first = first[ids.reshape(-1)]
    for lo in range(0, B, step):
        if not np.array_equal(rows[lo:lo + step], rows[first[lo:lo + step]]):
            return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return ids.reshape(-1).astype(np.int64)


def check_mask_columns(tensors: dict[str, Any]) -> None:
    """``mask_columns`` gives the width of the mask that ``lengths`` stands for: with a ``mask`` (its width is
    the mask's) or without ``lengths`` it makes no sense, a ``WireError`` (a ValueError) names it."""
    value = tensors.get("mask_columns")
    if value is None:
        tensors.pop("mask_columns", None)
        return
    if tensors.get("lengths") is None or tensors.get("mask") is not None:
        where = "with mask= the width is the mask's" if tensors.get("mask") is not None else "no lengths= given"
        raise WireError("mask_columns", f"{value!r}: it is the width T of the mask that lengths= [B] stands "
                             f"for and is given only with lengths= ({where}): drop mask_columns")
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)) or value < 0:
        raise WireError("mask_columns", f"{value!r}: give the mask width as an integer >= 0")
