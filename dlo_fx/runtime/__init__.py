"""Runtime: host store, slots, executors and the schedule nodes' targets.

`runtime.py` (the `Runtime` class) composes the subpackages: `device/` (the slots and the
machine under them), `host/` (where the weights live off the device), `ranks/` (what the
ranks of a shard group say to each other), `weights/` (the parameters whose weights it
holds) and `graph/` (the runtime as a compiled graph sees it). `slot_machine.py` is the slot
state machine the schedule nodes drive, `probes.py` what a run measures of its machine for
planning, `store_view.py` the builder of the frozen `StoreView` (dlo_fx/planning/view.py)
planning takes, `lifecycle.py` whether a runtime may run (its process, its lock, failed or
released), and `interrupts.py` defers Ctrl-C.

The subpackages are layered, bottom up: device/, host/, ranks/, weights/, graph/. A module
of one imports none of a subpackage above it; the modules beside runtime.py sit between
weights/ and graph/, except `lifecycle.py` and `interrupts.py`, which import nothing of
the runtime and sit below device/ (tests/test_ownership.py checks the order). Of
planning, the runtime imports only the values it builds and keeps (the view, the budget
plans, the memory records); it never imports the passes.

This module is the runtime's face: every other package imports what it uses of the
runtime from here (`dlo_fx.runtime`), never from a submodule, which are private by
convention (tests may reach them). A name another package needs is added to the list
below.
"""

from .device import platform  # a namespace: the platform layer, looked up at each call
from .device.platform import device_memory_bytes, exchange_device, max_memory_allocated
from .device.procfs import (anon_memory, cgroup_memory, process_memory, tree_pss,
                            tree_rollup)
from .device.trace import Span, Tracer
from .graph.graph_call import (NO_WISH, agree_budget, compile_clock, gather_only,
                               note_graph, run_graph)
from .graph.ops import SCHEDULE_OPS, GraphSchedule
from .host.file_reads import FileChangedError
from .host.file_store import CHECK_SAMPLES, CHECK_WINDOW, Convert, Extent, read_extents
from .host.fingerprint import extent_sources, file_fingerprint
from .host.host_slabs import pinned_figures
from .host.layout import (Entry, ShardSpec, StorageChoice, choose_storage, is_composite,
                          lay_out, plan_offsets, span_bytes, storage_choice,
                          storage_dtype_of, storage_span)
from . import probes  # a namespace: the probes are looked up at each call
from .probes import host_ram_bytes, machine_figures
from .ranks import forward_log
from .ranks.forward_log import logging_to, note_compile
from .ranks.agreement import Fact, compile_facts, differing, plan_fact
from .ranks.clock import word
from .ranks.collectives import all_gather_single, exchange_group, exchange_json, plan_digest
from .runtime import NAMED_RESIDENT, READ_DIRECTLY, Attachment, NewBlock, Runtime
from .store_view import check_streamable, store_view, unstreamable
from .weights.owners import (Owner, claim, owned_by, owner_of, reset_runtimes,
                             runtimes_holding, was_released)
from .weights.stored import (become_real, caller_level, carried_attributes, is_stored,
                             mark_released, parameter_of, real_parameter, release_advice,
                             stored_parameter)
from .weights.tensor_parallel import (DTensorLayout, rebuilt, refusal, shard_fact,
                                      stored_tensor)
from .weights.weight_reads import read_unstored

