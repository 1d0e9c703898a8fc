"""`Result`: what the engine answers for one request, an output or an error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch

from .request import Request

Output = Union[torch.Tensor, Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Result:
    """The answer to one request. Exactly one of ``output`` and ``error`` is set."""

    request: Request
    """The request this answers."""
    wave: int
    """The wave it ran in (engine-wide counter, starting at 0)."""
    output: Optional[Output] = None
    """What the pipeline returned: a tensor or a dict of tensors, on the CPU."""
    error: Optional[str] = None
    """Why the request failed (it raised in its worker, or its wave failed closed), or
    ``None``."""
    dp_rank: Optional[int] = None
    """The DP rank (replica) that ran it; ``None`` when its wave failed before it replied."""
    seconds: float = 0.0
    """Wall time of the wave, as seen by the front end."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """What the replying rank's pipeline reported (``pipeline.describe()``), plus
    ``compute_s`` (that rank's seconds inside the pipeline call) and ``pid``."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Output:
        """The output, or ``RuntimeError`` with the error."""
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.output
