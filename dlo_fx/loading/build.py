"""The model a load fills, built without its weights, and a resident tensor read into it.

`construct` builds the user's class (a diffusers or transformers class from its config, or
any factory) with every parameter on the meta device (`meta_parameters`); `materialised`
turns one checkpoint tensor into the resident tensor the model holds. `dlo_fx.load`
(loader.py) and ``dlo-fx shard`` (shards.py) both use them.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from .checkpoint import Checkpoint, odd_path
from .plan import Target

__all__ = ["construct", "materialised", "meta_parameters"]


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Move every parameter to the meta device as it is registered; buffers stay real.

    Constructors that call ``reset_parameters`` after assigning a parameter then
    initialise a meta tensor, which costs nothing. Patches ``nn.Module.register_parameter``
    for the duration (process-wide: do not construct modules on other threads meanwhile).
    A parameter assigned without it (written into ``module._parameters`` directly) stays as
    built; the loader replaces it all the same.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            meta = param.detach().to("meta")
            try:
                param = type(param)(meta, requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass with another constructor
                param = nn.Parameter(meta, requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _is_diffusers_class(cls: type) -> bool:
    return hasattr(cls, "from_config") and hasattr(cls, "config_name")


def _is_transformers_class(cls: type) -> bool:
    return isinstance(getattr(cls, "config_class", None), type) and hasattr(cls, "_from_config")


def _config_file(config: Any, ckpt: Checkpoint, name: str) -> Any:
    """The config to build a diffusers/transformers class from: ``config`` itself, the JSON
    file (or folder) it names, or the ``config.json`` beside the checkpoint's weights."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        path = os.path.join(path, name) if os.path.isdir(path) else path
        odd = odd_path(path)
        if odd is not None:
            raise ValueError(f"dlo_fx.load: config={os.fspath(config)!r}: {path} is {odd}, "
                             "not a config file; pass a config.json, a dict or a config object")
        if not os.path.isfile(path):
            raise ValueError(f"dlo_fx.load: config={os.fspath(config)!r}: no such file")
        return _read_config(path)
    if config is not None:
        return config
    folder = ckpt.folder if ckpt.folder is not None else os.path.dirname(ckpt.files[0])
    path = os.path.join(folder, name)
    odd = odd_path(path)
    if odd is not None:
        raise ValueError(f"dlo_fx.load: the {name} beside {ckpt.source!r}'s weights is {odd}, "
                         f"not a config file; replace it with the model's {name}, or pass "
                         "config= (a dict, a config object or a path to a config file)")
    if not os.path.isfile(path):
        raise ValueError(f"dlo_fx.load: {ckpt.source!r} has no {name} beside its weights, "
                         "so the model's configuration is unknown (building the class with "
                         "its defaults would make another model); pass config= (a dict, a "
                         f"config object or a path to a {name}) or add {name} to {folder}")
    return _read_config(path)


def _read_config(path: str) -> Any:
    """A model's JSON config file; a ValueError naming the file where it is not JSON text
    (a weights file passed as ``config=``, a binary file named config.json)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        return json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ValueError(f"dlo_fx.load: cannot read the config file {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"dlo_fx.load: {path} is not a JSON config file: byte "
                         f"0x{raw[exc.start]:02x} at byte {exc.start} is not UTF-8 text (a "
                         "weights file? config= takes a config.json, a dict or a config "
                         "object)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"dlo_fx.load: {path} is not a JSON config file ({exc})") from None


def construct(model: Any, config: Any, ckpt: Checkpoint) -> nn.Module:
    if isinstance(model, nn.Module):
        raise ValueError(f"dlo_fx.load: model is an instance of {type(model).__name__}; pass "
                         "the class or a zero-argument factory so its weights are never allocated")
    if not callable(model):
        raise ValueError(f"dlo_fx.load: model={model!r} is not an nn.Module class or a factory")
    if isinstance(model, type) and not issubclass(model, nn.Module):
        raise ValueError(f"dlo_fx.load: model class {model.__name__} is not an nn.Module")
    diffusers_cls = isinstance(model, type) and _is_diffusers_class(model)
    transformers_cls = isinstance(model, type) and _is_transformers_class(model)
    if diffusers_cls or transformers_cls:
        config = _config_file(config, ckpt, getattr(model, "config_name", "config.json"))
    with meta_parameters():
        if diffusers_cls:
            module = model.from_config(config if isinstance(config, Mapping) else dict(config))
        elif transformers_cls:
            if isinstance(config, Mapping):
                config = model.config_class.from_dict(dict(config))
            module = model(config)
        elif config is None:
            module = model()
        elif isinstance(config, Mapping):
            module = model(**config)
        else:
            module = model(config)
    if not isinstance(module, nn.Module):
        raise ValueError(f"dlo_fx.load: the factory returned {type(module).__name__}, "
                         "not an nn.Module")
    return module


def materialised(target: Target, view: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    t = target.tensor
    if view is None:  # a buffer the checkpoint does not hold (or need not)
        return t.to(device)
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=target.dtype, device=device)
    with torch.no_grad():
        out.copy_(view.view(t.shape))
        if target.stored_as is not None:  # resident, with storage_dtype's values
            out.copy_(out.to(target.stored_as))
    return out


