"""An engine factory for fault-injection tests: the diffusers factory's pipeline with a
fault point inside its transformer's compiled graph.

A custom op (`fault_point`, opaque to Dynamo, so it runs inside the graph between the
first transformer block and the second) returns its input, except on the global rank a
request names in ``extra_args["hang_rank"]``, where it never returns: that rank hangs
mid-forward while its context-parallel peers go on into the next block's all-to-all. The
key is taken off the request before the diffusers pipeline sees it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from dlo_fx.apps.engine import diffusers_pipeline

_HANG_RANK: list[Optional[int]] = [None]


@torch.library.custom_op("dlo_tests::fault_point", mutates_args=())
def fault_point(x: torch.Tensor) -> torch.Tensor:
    if _HANG_RANK[0] is not None and _HANG_RANK[0] == dist.get_rank():
        while True:  # the front end kills this worker when the wave fails closed
            time.sleep(0.5)
    return x.clone()


@fault_point.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class HangingPipeline:
    """The diffusers pipeline, reading ``extra_args["hang_rank"]`` itself."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        limits = inner.limits
        if limits.extra_args is not None:
            limits = dataclasses.replace(limits,
                                         extra_args=(*limits.extra_args, "hang_rank"))
        self.limits = limits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @staticmethod
    def _split(request: Any) -> tuple[Any, Optional[int]]:
        extra = dict(request.extra_args)
        rank = extra.pop("hang_rank", None)
        return dataclasses.replace(request, extra_args=extra), rank

    def check(self, request: Any) -> None:
        self.inner.check(self._split(request)[0])

    def __call__(self, request: Any) -> Any:
        request, _HANG_RANK[0] = self._split(request)
        try:
            return self.inner(request)
        finally:
            _HANG_RANK[0] = None


def build(options: Any = None, **kwargs: Any) -> HangingPipeline:
    pipeline = diffusers_pipeline.build(options, **kwargs)
    block = pipeline.pipe.transformer.transformer_blocks[0]
    block.register_forward_hook(lambda module, args, out: (out[0], fault_point(out[1])))
    return HangingPipeline(pipeline)
