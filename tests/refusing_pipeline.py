"""An engine pipeline factory without a forward clock whose ``check`` refuses some
requests before any forward (as a diffusers pipeline's ``check_inputs`` does): the
reference pipeline, its clock hidden, refusing every prompt that contains "refuse"."""

from __future__ import annotations

from typing import Any

from dlo_fx.apps.engine.reference_pipeline import build as reference_build


class RefusingPipeline:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.limits = inner.limits

    def check(self, request: Any) -> None:
        if "refuse" in request.prompt:
            raise ValueError(f"prompt {request.prompt!r} is refused by this pipeline")

    def __call__(self, request: Any) -> Any:
        return self.inner(request)

    def describe(self) -> dict:
        return self.inner.describe()


def build(options: Any = None, **kwargs: Any) -> RefusingPipeline:
    return RefusingPipeline(reference_build(options, **kwargs))
