"""``from_pretrained``: a patched transformers model saved with ``save_pretrained``, rebuilt as it was built.

The class named by its config is built with the constructor options it was saved with (read from the
checkpoint's keys unless passed: ``families.CONSTRUCTOR_OPTIONS``) by transformers' own ``from_pretrained``,
patched as ``config.vispos`` records as soon as it is built (``_patching``), and loaded by transformers' loader
(its keywords, key conversions and shards): what the checkpoint lacks newly initialised, what the model has no
place for dropped, both said, except the positional weights, which must all be there.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._validate import check_bool
from .families import CONSTRUCTOR_OPTIONS
from .patching import CONFIG_KEY, patch

# transformers' from_pretrained keywords that are about loading, not the config or the constructor: passed to it
LOADER_KEYWORDS = frozenset({
    "dtype", "torch_dtype", "device_map", "max_memory", "offload_folder", "offload_buffers", "offload_state_dict",
    "output_loading_info", "ignore_mismatched_sizes", "use_safetensors", "low_cpu_mem_usage", "weights_only",
    "key_mapping", "variant", "subfolder", "revision", "local_files_only", "disable_mmap", "quantization_config",
    "tp_plan", "device_mesh", "cache_dir", "token", "force_download",
})  # fmt: skip


def from_pretrained(path: str | Path, **kwargs: Any) -> nn.Module:
    """A patched model saved with ``save_pretrained``, rebuilt: the transformers class of its config, built as it
    was saved, patched as recorded in ``config.vispos`` before its weights arrive, and loaded by transformers'
    own ``from_pretrained`` (equal outputs).

    ``kwargs`` are transformers' loader keywords with transformers' meaning (``config``: a config object used as it
    is, the other keywords then the constructor's, or a config folder; ``dtype`` including ``"auto"``,
    ``device_map`` including ``"auto"`` and offloading to ``"cpu"`` / ``"disk"`` with ``offload_folder``,
    ``output_loading_info``, ``ignore_mismatched_sizes``, ``use_safetensors``, ``low_cpu_mem_usage``...: the
    checkpoint may be sharded, and its keys go through the family's checkpoint conversions), attributes of the
    config (e.g. ``attn_implementation="sdpa"``) or options of the class's constructor. A constructor option not
    passed is read from the checkpoint's keys: a ``ViTModel`` / ``DeiTModel`` saved without its pooler
    (``add_pooling_layer=False``) comes back without it, one saved with a mask token (``use_mask_token=True``)
    with it; the other families' optional parts (DINOv2's mask token, SigLIP's and SigLIP 2's pooling head) are
    config fields and come back with the config. Weights the checkpoint lacks are newly initialised and those
    the model has no place for dropped, both named in a warning, as transformers loads them; the positional
    weights (``vispos.``) must all be there. A folder of an unpatched model is refused: load it with
    transformers and patch it."""
    import transformers

    path = Path(path)
    record = _record(path)
    loader = {k: kwargs.pop(k) for k in list(kwargs) if k in LOADER_KEYWORDS}
    attn = kwargs.pop("attn_implementation", None)
    given = kwargs.pop("config", None)
    if isinstance(given, transformers.PretrainedConfig):  # transformers' meaning: this config, the rest options
        config, unused = copy.deepcopy(given), kwargs
    else:  # a folder or name of a config (or None: the checkpoint's own), its attributes overridden by kwargs
        source = path if given is None else given
        config, unused = transformers.AutoConfig.from_pretrained(source, return_unused_kwargs=True, **kwargs)
    cls = model_class(config)
    options = constructor_options(cls, unused, _keys(path))
    if attn:
        options["attn_implementation"] = attn
    wanted = loader.pop("output_loading_info", False)
    check_bool("output_loading_info", wanted)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not contain metadata")
        model, info = _patching(cls, record).from_pretrained(path, config=config, output_loading_info=True,
                                                             **options, **loader)  # fmt: skip
    _check_loaded(model, info, path, record["pos"])
    _restore_records(model, path)
    model.eval()
    return (model, info) if wanted else model


def _patching(cls: type, record: dict[str, Any]) -> type:
    """``cls`` for transformers' loader: each instance is patched as ``record`` says once built (before its weights
    arrive), then is of ``cls`` patched, as ``vispos.patch`` leaves a model."""

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, config, *args, **kwargs)
        self.__class__ = cls
        with torch.device("cpu"):  # the positions' fixed buffers are computed, not loaded: built where they can be
            patch(self, record["pos"], inherit=False, **record["options"])

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})  # fmt: skip


def model_class(config: Any) -> type:
    """The class ``config.architectures`` names: exported by transformers, or (a VLM's vision tower, such as
    Qwen2-VL's) defined in the modeling module beside its configuration's."""
    import transformers

    name = config.architectures[0]
    cls = getattr(transformers, name, None)
    if cls is None:
        modeling = type(config).__module__.replace(".configuration_", ".modeling_")
        cls = getattr(importlib.import_module(modeling), name, None)
    if cls is None:
        raise ValueError(f"transformers has no model class {name!r} (the architecture this checkpoint's config names)")
    return cls


def constructor_options(cls: type, given: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The keyword options ``cls`` is built with: those ``given`` (each one its constructor takes), then its
    optional parts (``CONSTRUCTOR_OPTIONS``) not given, each on where the checkpoint's ``keys`` hold it."""
    params = inspect.signature(cls.__init__).parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [n for n, p in params.items() if n not in ("self", "config") and p.kind not in variadic]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for name in given:
            if name not in named:
                raise ValueError(
                    f"{cls.__name__} takes no option {name!r}: pass an attribute of its config (e.g. "
                    f"attn_implementation, hidden_dropout_prob) or one of its constructor options "
                    f"({', '.join(named) or 'it has none'})"
                )
    parts = CONSTRUCTOR_OPTIONS.get(cls.__name__, {})
    for name in given.keys() & parts.keys():
        check_bool(name, given[name])
    keys = list(keys)
    read = {name: any(k == part or k.startswith(f"{part}.") for k in keys) for name, part in parts.items()}
    return {name: value for name, value in read.items() if name not in given} | given


def _record(path: Path) -> dict[str, Any]:
    """The ``vispos`` entry of the folder's ``config.json``: what the model was patched with."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a save_pretrained folder")
    record = json.loads(config_file.read_text()).get(CONFIG_KEY)
    if record is None:
        raise ValueError(
            f"{path} holds an unpatched transformers model (its config has no 'vispos' entry): load it with "
            "transformers' from_pretrained and patch it with vispos.patch"
        )
    return record


def _keys(path: Path) -> list[str]:
    """The weight names of the folder's safetensors files (every shard)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors weights")
    keys: list[str] = []
    for file in files:
        with safe_open(file, "pt") as handle:
            keys += list(handle.keys())
    return keys


def _restore_records(model: nn.Module, path: Path) -> None:
    """The positions' settings records (``*vispos*._extra_state``: scaling, log-n, training grid), set from the
    checkpoint on the modules that hold them. A device map that offloads ``vispos`` to disk (accelerate fills memory in
    module order, and ``vispos`` is registered last) leaves them out of the loaded state; read here, they apply
    whatever the map (on a model loaded whole this sets what the load set). Parents first, as ``load_state_dict``
    sets them, then each ``Positions`` puts its settings on its one training grid."""
    from safetensors import safe_open

    from ..positions import Positions

    records: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            records |= {k: handle.get_tensor(k) for k in handle.keys() if ".vispos" in f".{k}" and  # noqa: SIM118
                        k.endswith("._extra_state")}  # fmt: skip
    prefix = getattr(model, "base_model_prefix", "")
    names = dict(model.named_modules())
    for key in sorted(records, key=lambda k: k.count(".")):
        name = key[: -len("._extra_state")]
        module = names.get(name) or names.get(name.removeprefix(f"{prefix}.")) or names.get(f"{prefix}.{name}")
        if module is None:
            raise ValueError(f"{path} holds the record {key}, which no module of the loaded model takes")
        module.set_extra_state(records[key])
    for module in model.modules():
        if isinstance(module, Positions):
            module.follow_scaling_grid()


def _check_loaded(model: nn.Module, info: dict[str, Any], path: Path, pos: list[str]) -> None:
    """transformers' loading report, read as vispos reads a checkpoint: a positional weight lacking or left over
    is refused (the folder does not hold the positions it records); any other weight newly initialised or dropped
    is named in a warning."""
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    lacking = [k for k in missing if ".vispos." in f".{k}"]
    extra = [k for k in unexpected if ".vispos." in f".{k}"]
    if lacking or extra:
        said = [f"lacks the positional weights {', '.join(lacking)}"] if lacking else []
        said += [f"holds positional weights it has no place for: {', '.join(extra)}"] if extra else []
        raise ValueError(
            f"{path} does not hold the positions its config records ({' + '.join(pos)}): it {'; it '.join(said)}. "
            "Save the patched model again with save_pretrained"
        )
    if missing or unexpected:
        said = [f"newly initialised: {', '.join(missing)}"] if missing else []
        said += [f"dropped: {', '.join(unexpected)}"] if unexpected else []
        warnings.warn(
            f"{path} does not hold the weights of {model.config.architectures[0]} as built, and loads as "
            f"transformers' from_pretrained loads it: {'; '.join(said)} (pass the constructor options it was "
            "saved with, or leave them out to have them read from its keys)",
            UserWarning,
            stacklevel=3,
        )
