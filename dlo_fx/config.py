"""The options of dlo, frozen and validated, each given to the verb that uses it.

[Note: options belong to a verb]
An option is given where what it shapes is made, and nowhere else. `DLOConfig` holds what
a model's runtime needs (slots, blocks, mode, host store, device, budget): it is given
where the runtime is made, ``dlo_fx.offload(model, options)``, ``dlo_fx.load(...,
options=...)`` or ``compile_pipeline(pipe, options=...)``, and every compile of the model
uses it. `CompileOptions` holds what one compile needs (``compiler``, ``trace``,
``dump_dir``, ``debug_passes``, ``user_passes``): it is given to ``torch.compile(model,
backend="dlo", options=...)``, and each compile has its own (none inherited from the
runtime, none replacing the runtime's). A compile option given to ``offload`` or ``load``
is a ``ValueError`` naming ``torch.compile`` (`option_error`), raised before anything
changes, so no option is ever dropped. A runtime option given to ``torch.compile`` of a
model whose runtime exists is accepted only with the value the runtime has (the old
spelling, one dict passed to both verbs, drops nothing); another value raises naming the
verbs that make a runtime (`runtime_conflicts`, `conflict_error`), at the compile and
wherever Dynamo reuses its graph for another model (`GraphSchedule.bind`).
``compile_pipeline`` (and the engine, which calls it) makes the runtimes and compiles: it
takes both kinds in one dict and hands each its half (`split_options`). An unknown key or
a bad value raises ``ValueError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Sequence, Union

import torch

Mode = Optional[Literal["auto", "allgather", "rank_local"]]
Compiler = Literal["eager", "inductor"]
HostStoreKind = Literal["memory", "mmap"]
FileReads = Literal["auto", "direct", "buffered"]

_MODES = (None, "auto", "allgather", "rank_local")
_COMPILERS = ("eager", "inductor")
_HOST_STORES = ("memory", "mmap")
_FILE_READS = ("auto", "direct", "buffered")


def did_you_mean(unknown: Union[str, Sequence[str]], names: Iterable[str]) -> str:
    """``"did you mean 'num_slots'? "`` for a mistyped name (each of several: ``"did you mean
    'prompt' for 'promt'? "``), the closest of ``names`` as difflib finds it; ``""`` where
    none is close. Every error that refuses an unknown name puts it before the list."""
    names = list(names)
    unknown = [unknown] if isinstance(unknown, str) else list(unknown)
    pairs = [(u, close[0]) for u in unknown
             for close in [difflib.get_close_matches(str(u), names, n=1)] if close]
    if not pairs:
        return ""
    if len(unknown) == 1:
        return f"did you mean {pairs[0][1]!r}? "
    return "did you mean " + ", ".join(f"{c!r} for {u!r}" for u, c in pairs) + "? "


@dataclass(frozen=True)
class DLOConfig:
    """Options of a model's runtime: given where the runtime is made (`dlo_fx.offload`,
    `dlo_fx.load`, `compile_pipeline`), used by every compile of the model."""

    mode: Mode = None
    """How a block reaches the device. ``"allgather"``: each rank of the shard group keeps
    1/dp of every block in host memory; the block is completed on the device by an
    AllGather. ``"rank_local"``: every rank keeps whole blocks, no collective. ``"auto"``:
    measure H2D and AllGather bandwidth on the shard group when the first graph is
    scheduled and choose through the policy model (`dlo_fx.planning.modes`). ``None`` picks
    allgather when the shard group has more than one rank, rank-local otherwise.
    Default: ``None``."""

    num_slots: int = 2
    """Number of device slot buffers a block is streamed into (prefetch depth + 1), from
    2 to 64. Default: ``2``."""

    block_bytes: Optional[int] = None
    """Block budget in bytes: blocks are closed once adding the next parameters would
    exceed it. ``None`` uses the largest natural layer (e.g. one transformer block).
    Default: ``None``."""

    resident_bytes: int = 0
    """Parameters smaller than this many bytes stay on the device for the whole run;
    ``0`` streams every parameter that can be streamed. Parameters used far apart
    (shared tables, tied weights) stay resident whatever the setting. Default: ``0``."""

    device_budget: Union[int, str, None] = "auto"
    """Bytes of device memory the weights may use: the slots, the resident parameters and
    the blocks kept resident. What is left after the slots and the parameters resident
    anyway goes to whole blocks chosen to minimise the predicted time per call (copies at
    the measured bandwidths, compute from each block's FLOPs at the measured matmul rate;
    `dlo_fx.planning.budget`, see [Note: resident blocks spread through the stack]); a budget
    below that minimum raises ``ValueError`` at compile. ``"auto"``: planned from measured
    memory (`dlo_fx.planning.device_memory`, see [Note: the auto device budget]): the
    device's capacity (``device_memory``, else its free memory with the model offloaded)
    minus the activations and workspace measured on the first call at each input shape,
    minus a margin; a new input shape re-plans before it runs, and a call that runs out of
    device memory raises `dlo_fx.DeviceMemoryError` and moves blocks back to streaming. On
    the CPU or the meta device without ``device_memory``, ``"auto"`` streams every block.
    ``None``: every block streams. Default: ``"auto"``."""

    device_memory: Optional[int] = None
    """With ``device_budget="auto"``: the device's capacity in bytes, declared instead of
    read from the driver. It makes the planner work on the CPU or the meta device as if the
    compute device had that many bytes (tests, planning for hardware one does not have),
    and caps the budget on an accelerator. Below what a graph's weights need at least
    (``num_slots`` slots of its largest block plus the parameters resident anyway) it is a
    ``ValueError`` at the compile naming both figures. ``None``: the free memory the driver
    reports (no budget on the CPU or the meta device). Default: ``None``."""

    activation_reserve_bytes: Optional[int] = None
    """With ``device_budget="auto"``: device bytes kept for activations and workspace,
    instead of the peak measured on each input shape's first call (an override for a
    workload whose later calls need more than the first, or to plan once at compile).
    ``None``: measured. Default: ``None``."""

    device: Optional[str] = None
    """Device the slots live on and the graph computes on, e.g. ``"cpu"``, ``"cuda:0"``,
    ``"meta"`` (plan and trace without values). ``None``: for `dlo_fx.offload`,
    `dlo_fx.load` and `compile_pipeline` the accelerator ``torch.accelerator`` reports,
    else the CPU. A
    device this machine lacks (an accelerator it has not, an index past its count) is a
    ``ValueError`` naming it where the device is first needed (`dlo_fx.offload`,
    `dlo_fx.load`, `compile_pipeline`), before anything is stored.
    Default: ``None``."""

    pin_memory: bool = True
    """Pin host shards where the platform supports it (ignored on CPU-only runs).
    Default: ``True``."""

    alignment: int = 256
    """Byte alignment of every tensor inside a flattened block, and of shard sizes.
    A power of two from 16 to 1 MiB. Default: ``256``."""

    shard_group: Any = None
    """Ranks a block is gathered over: a ``ProcessGroup``, a list of global ranks, a
    ``DeviceMesh`` (the ranks of this rank's mesh: ``mesh["sp"]`` of a mesh of your own,
    taken as the tuple of its global ranks), or ``None`` for the WORLD group when
    ``torch.distributed`` is initialised (dp = 1 otherwise). Default: ``None``."""

    collective_timeout_s: float = 300.0
    """Timeout of the weight-gather process group; a rank that dies or raises makes the
    others raise within it. More than 0 and at most a week (604800). Default: ``300.0``."""

    host_store: HostStoreKind = "memory"
    """Where this rank's host shards live. ``"memory"``: copied into process memory
    (pinned where the platform supports it) at load. ``"mmap"``: served from the
    checkpoint files themselves (the safetensors files `dlo_fx.load` read, or the per-rank
    files of ``dlo-fx shard``) through the OS page cache, with read-ahead and no copy in
    anonymous memory: for models larger than host RAM. Needs `dlo_fx.load`. See
    `dlo_fx.runtime.host.file_store`. Default: ``"memory"``."""

    storage_dtype: Union[torch.dtype, str, None] = None
    """Store (and stream) the weights of the model's linear and convolution layers in this
    floating-point dtype, and cast them to the parameter's own dtype on the device, in the
    graph, right after the slot view: the same layers and the same casts as diffusers'
    ``enable_layerwise_casting(storage_dtype=..., compute_dtype=<the model's dtype>)``
    (its default skip patterns, the model's ``_skip_layerwise_casting_patterns`` and
    ``_keep_in_fp32_modules``), so the output is bit-identical to that model run
    resident. ``torch.float8_e4m3fn`` halves bf16's host, transfer and slot bytes. A dtype
    or its name (``"float8_e4m3fn"``). See `dlo_fx.model.storage_dtype`. Default: ``None``."""

    file_reads: FileReads = "auto"
    """How ``host_store="mmap"`` reads its files. ``"buffered"``: through the OS page
    cache (it keeps what fits for the next call). ``"direct"``: with ``O_DIRECT``, around
    the page cache (nothing evicted, no copy out of the cache; a file system that refuses it
    is read buffered, with a warning). ``"auto"``: direct when the bytes served on this
    host do not fit in the memory available to the page cache. See
    `dlo_fx.runtime.host.file_reads`. Default: ``"auto"``."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, _MODES)
        _check_choice("host_store", self.host_store, _HOST_STORES)
        _check_choice("file_reads", self.file_reads, _FILE_READS)
        _check_int("num_slots", self.num_slots, minimum=2)
        if self.storage_dtype is not None:
            object.__setattr__(self, "storage_dtype", _floating_dtype(self.storage_dtype))
        if self.num_slots > MAX_SLOTS:
            raise ValueError(
                f"DLOConfig option 'num_slots'={self.num_slots!r} is not allowed: expected an "
                f"integer from 2 to {MAX_SLOTS} (each slot holds the largest block on the device)"
            )
        if self.block_bytes is not None:
            _check_int("block_bytes", self.block_bytes, minimum=1)
        _check_int("resident_bytes", self.resident_bytes, minimum=0)
        if self.device_budget != "auto" and self.device_budget is not None:
            if isinstance(self.device_budget, str):
                raise ValueError(
                    f"DLOConfig option 'device_budget'={self.device_budget!r} is not allowed: "
                    "expected None, 'auto' or an integer number of bytes >= 0"
                )
            _check_int("device_budget", self.device_budget, minimum=0)
        for name, minimum in (("activation_reserve_bytes", 0), ("device_memory", 1)):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value, minimum=minimum)
            if self.device_budget != "auto":
                raise ValueError(
                    f"DLOConfig option {name!r}={value!r} applies only with "
                    f"device_budget='auto' (device_budget={self.device_budget!r}); drop it or "
                    "set device_budget='auto'"
                )
        _check_int("alignment", self.alignment, minimum=16)
        if self.alignment & (self.alignment - 1) or self.alignment > MAX_ALIGNMENT:
            raise ValueError(
                f"DLOConfig option 'alignment'={self.alignment!r} is not allowed: "
                f"it must be a power of two from 16 to {MAX_ALIGNMENT} (1 MiB)"
            )
        _check_bool("DLOConfig", "pin_memory", self.pin_memory)
        check_seconds("DLOConfig option 'collective_timeout_s'", self.collective_timeout_s,
                      MAX_TIMEOUT_S)
        if self.collective_timeout_s == 0:
            raise ValueError(
                "DLOConfig option 'collective_timeout_s'=0 is not allowed: expected > 0"
            )
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(
                    f"DLOConfig option 'device'={self.device!r} is not allowed: {exc}; "
                    "expected a torch device string such as 'cpu' or 'cuda:0'"
                ) from None
        group = self.shard_group
        if _is_device_mesh(group):  # its global ranks: gathers need only those
            group = tuple(int(r) for r in group.mesh.flatten().tolist())
            object.__setattr__(self, "shard_group", group)
        if group is not None and not _is_process_group(group):
            if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in group
            ) or len(set(group)) != len(group) or not group:
                raise ValueError(
                    f"DLOConfig option 'shard_group'={group!r} is not allowed: expected "
                    "None, a ProcessGroup, a DeviceMesh, or a non-empty list of distinct "
                    "global ranks"
                )

    @classmethod
    def from_options(cls, options: Union[Mapping[str, Any], "DLOConfig", None] = None, *,
                     verb: str = "dlo_fx.offload") -> "DLOConfig":
        """The runtime's options from the dict given to ``verb`` (`dlo_fx.offload`,
        `dlo_fx.load`, ``dlo-fx shard``); a compile option there raises naming
        ``torch.compile`` (see [Note: options belong to a verb])."""
        if isinstance(options, DLOConfig):
            return options
        options = _checked(options, cls, verb)
        if isinstance(options.get("shard_group"), list):
            options["shard_group"] = tuple(options["shard_group"])
        return cls(**options)


@dataclass(frozen=True)
class CompileOptions:
    """Options of one ``torch.compile(model, backend="dlo", options=...)``: how the graph
    is compiled and what it records; the model's runtime (`DLOConfig`) is untouched."""

    dump_dir: Optional[str] = None
    """Folder to write schedule dumps into (``DLO_FX_DUMP_DIR`` sets it too).
    Default: ``None``."""

    trace: bool = False
    """Record measured spans of every schedule node (for ``trace.json``).
    Default: ``False``."""

    debug_passes: bool = False
    """Log the graph as planned, what the planning stages decided, and the graph before and
    after every pass at DEBUG level on the ``dlo_fx.passes`` logger
    (``DLO_FX_DEBUG_PASSES=1`` sets it too). Default: ``False``."""

    user_passes: tuple[Callable, ...] = field(default=())
    """Extra FX passes ``(gm, plan) -> gm`` run after scheduling; they see
    ``node.meta["dlo"]`` and the graph's frozen ``GraphPlan`` (blocks, resident set, mode),
    and may add nodes, not move or drop schedule nodes. Default: ``()``."""

    compiler: Compiler = "eager"
    """How the compute between schedule nodes runs. Default: ``"eager"``."""

    def __post_init__(self) -> None:
        _check_choice("compiler", self.compiler, _COMPILERS, "CompileOptions")
        _check_bool("CompileOptions", "trace", self.trace)
        _check_bool("CompileOptions", "debug_passes", self.debug_passes)
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(f"CompileOptions option 'dump_dir'={self.dump_dir!r} is not "
                             "allowed: expected a path")
        if not isinstance(self.user_passes, tuple) or not all(
            callable(p) for p in self.user_passes
        ):
            raise ValueError(
                f"CompileOptions option 'user_passes'={self.user_passes!r} is not allowed: "
                "expected a sequence of callables (gm, plan) -> gm"
            )

    @classmethod
    def from_options(cls, options: Union[Mapping[str, Any], "CompileOptions", None] = None, *,
                     verb: str = "torch.compile(backend='dlo')") -> "CompileOptions":
        """The compile's options from the dict given to ``torch.compile``; a runtime option
        there raises naming the verbs that make a runtime.

        Environment variables fill what the dict leaves unset: ``DLO_FX_DUMP_DIR`` and
        ``DLO_FX_DEBUG_PASSES``.
        """
        if isinstance(options, CompileOptions):
            return options
        options = _checked(options, cls, verb)
        if "dump_dir" not in options and os.environ.get("DLO_FX_DUMP_DIR"):
            options["dump_dir"] = os.environ["DLO_FX_DUMP_DIR"]
        if "debug_passes" not in options and os.environ.get("DLO_FX_DEBUG_PASSES"):
            options["debug_passes"] = os.environ["DLO_FX_DEBUG_PASSES"] not in ("", "0")
        if "user_passes" in options and not isinstance(options["user_passes"], tuple):
            passes = options["user_passes"]
            options["user_passes"] = tuple(passes) if isinstance(passes, (list, tuple)) else passes
        return cls(**options)


RUNTIME_OPTIONS = tuple(f.name for f in dataclasses.fields(DLOConfig))
"""What a model's runtime is made with: given to `dlo_fx.offload`, `dlo_fx.load`,
`compile_pipeline`."""

COMPILE_OPTIONS = tuple(f.name for f in dataclasses.fields(CompileOptions))
"""What one compile needs: given to ``torch.compile(model, backend="dlo", options=...)``
(and `compile_pipeline`, which compiles)."""

RUNTIME_VERBS = ("dlo_fx.offload(model, options), dlo_fx.load(..., options=...) or "
                 "dlo_fx.compile_pipeline(pipe, options=...)")
COMPILE_VERB = "torch.compile(model, backend='dlo', options=...)"


def option_error(key: str, value: Any, verb: str) -> ValueError:
    """The error for option ``key`` given to ``verb``, which does not take it: it names
    the verb the option belongs to, or the options there are (an unknown key)."""
    if key in RUNTIME_OPTIONS:
        return ValueError(
            f"dlo option {key!r}={value!r} shapes the model's runtime, which {verb} does not "
            f"make: give it where the runtime is made, {RUNTIME_VERBS} (see [Note: options "
            "belong to a verb])")
    if key in COMPILE_OPTIONS:
        return ValueError(
            f"dlo option {key!r}={value!r} belongs to each compile, not to {verb}: give it to "
            f"{COMPILE_VERB} (or dlo_fx.compile_pipeline, which compiles)")
    every = (*RUNTIME_OPTIONS, *COMPILE_OPTIONS)
    return ValueError(f"unknown dlo option {key!r} (value {value!r}); "
                      f"{did_you_mean(key, every)}allowed options: "
                      f"{', '.join(sorted(RUNTIME_OPTIONS))} (the runtime's: {RUNTIME_VERBS}); "
                      f"{', '.join(sorted(COMPILE_OPTIONS))} (a compile's: {COMPILE_VERB})")


def runtime_conflicts(given: Mapping[str, Any], config: "DLOConfig") -> list[str]:
    """The runtime options in ``given`` that ask for something other than ``config`` (a
    runtime's), one line each; none where they agree. Runtime options given again with
    the runtime's own values (the same dict passed to ``offload`` and ``torch.compile``, as
    before options had a verb) drop nothing, and are accepted where a runtime exists."""
    asked = DLOConfig.from_options(given)
    return [f"{key}={getattr(asked, key)!r} (the runtime has {key}={getattr(config, key)!r})"
            for key in given if not _same(key, getattr(asked, key), getattr(config, key))]


def conflict_error(conflicts: Sequence[str], verb: str, what: str = "the model") -> ValueError:
    """The error for runtime options given to ``verb`` that the runtime of ``what``, made
    before, does not have (`runtime_conflicts`)."""
    return ValueError(
        f"dlo: {verb}: runtime options differ from those the runtime of {what} was made "
        f"with: {'; '.join(conflicts)}; nothing was changed. Runtime options are given where "
        f"the runtime is made ({RUNTIME_VERBS}): give {verb} the runtime's values or none "
        f"(compile options alone: {', '.join(COMPILE_OPTIONS)}), or dlo_fx.release {what} "
        "and make its runtime again with the new ones (see [Note: options belong to a verb])")


def _same(key: str, mine: Any, theirs: Any) -> bool:
    if key == "device":
        return mine is None or theirs is None or same_device(mine, theirs)
    return mine is theirs or mine == theirs


def split_options(options: Union[Mapping[str, Any], DLOConfig, None],
                  verb: str = "dlo_fx.compile_pipeline") -> tuple[dict, dict]:
    """``options`` given to a verb that makes runtimes and compiles (`compile_pipeline`,
    the engine) as (runtime options, compile options), each a dict; an unknown key raises.
    Both halves are validated here, before anything is made."""
    if isinstance(options, DLOConfig):
        return {f: getattr(options, f) for f in RUNTIME_OPTIONS}, {}
    options = _mapping(options, verb)
    for key, value in options.items():
        if key not in RUNTIME_OPTIONS and key not in COMPILE_OPTIONS:
            raise option_error(key, value, verb)
    runtime = {k: v for k, v in options.items() if k in RUNTIME_OPTIONS}
    compile_ = {k: v for k, v in options.items() if k in COMPILE_OPTIONS}
    DLOConfig.from_options(runtime, verb=verb)
    CompileOptions.from_options(compile_, verb=verb)
    return runtime, compile_


def _mapping(options: Any, verb: str) -> dict:
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"{verb}: dlo options={options!r} are not allowed: expected a "
                         "mapping of option names to values (a dict)")
    return dict(options or {})


def _checked(options: Any, cls: type, verb: str) -> dict:
    """``options`` as a dict of ``cls``'s fields; any other key raises (`option_error`)."""
    options = _mapping(options, verb)
    allowed = {f.name for f in dataclasses.fields(cls)}
    for key, value in options.items():
        if key not in allowed:
            raise option_error(key, value, verb)
    return options


MAX_SLOTS = 64
"""Most slots a runtime may have: each is the size of the largest block on the device."""

MAX_ALIGNMENT = 1 << 20
"""Largest ``alignment``: every tensor of a block, and the data of a shard file, starts at a
multiple of it, so each costs up to that many bytes of padding."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest ``collective_timeout_s`` (a week): longer ones overflow the process group's
timeout, and a hang that long is no timeout."""

def canonical_device(device: Any) -> torch.device:
    """The one spelling of a device every check, key and message uses: the CPU and the
    meta device without an index (``"cpu:0"`` is ``cpu``), an accelerator with one
    (``"cuda"`` is the current CUDA device, ``cuda:0`` where that is device 0), as a
    tensor made there reports its device."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return torch.device(device.type)
    if device.index is None:
        return torch.device(device.type, _current_index(device.type))
    return device


def same_device(a: Any, b: Any) -> bool:
    """Whether two device spellings name one device (``"cpu"``, ``"cpu:0"``,
    ``torch.device("cpu", 0)`` do; ``"cuda"`` is the current CUDA device)."""
    return canonical_device(a) == canonical_device(b)


def _current_index(kind: str) -> int:
    module = getattr(torch, kind, None)
    try:
        return module.current_device() if module is not None else 0
    except (AssertionError, AttributeError, RuntimeError):  # no device of that kind: index 0
        return 0


def _is_process_group(obj: Any) -> bool:
    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(obj, ProcessGroup)


def _is_device_mesh(obj: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(obj, DeviceMesh)


def _check_choice(name: str, value: Any, allowed: Sequence[str],
                  kind: str = "DLOConfig") -> None:
    if value not in allowed:
        raise ValueError(
            f"{kind} option {name!r}={value!r} is not allowed: expected one of "
            f"{', '.join(repr(a) for a in allowed)}"
        )


def _check_bool(kind: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{kind} option {name!r}={value!r} is not allowed: expected True or False")


def check_seconds(what: str, value: Any, most: float) -> None:
    """``ValueError`` naming ``what`` unless ``value`` is a finite number of seconds from 0
    to ``most``."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value <= most):
        raise ValueError(f"{what}={value!r} is not allowed: expected a number of seconds "
                         f"from 0 to {most}")


def _floating_dtype(value: Any) -> torch.dtype:
    """``storage_dtype`` as a floating-point torch dtype (a dtype or its name)."""
    dtype = value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"DLOConfig option 'storage_dtype'={value!r} is not allowed: expected a "
            "floating-point torch dtype or its name, such as torch.float8_e4m3fn, "
            "'float8_e5m2', 'bfloat16' or 'float16' (integer quantisation is torchao's: "
            "quantize the model, then compile it)")
    return dtype


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"DLOConfig option {name!r}={value!r} is not allowed: expected an integer >= {minimum}"
        )
