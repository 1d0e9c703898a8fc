"""`Pending`: the prediction of a deferred guidance call, filled when its pair computes it.

[Note: a pending prediction]
Two-call CFG parallel (see [Note: two-call CFG parallel] in cfg_pairs.py) returns from the
first call of a guidance pair before anything is computed: the prediction exists only after
the pair's second call. What the first call returns is a `Pending` of the prediction's
shape, dtype and device, in the module's own output structure, so the pipeline's
``noise_pred = transformer(...)[0]`` runs as before. Until it is filled:

- a view of it (``[0]``, ``chunk``, ``view``, ``unsqueeze``, ...) is another `Pending`,
  of the shape torch's meta kernel gives, filled with it (the view of the value);
- anything else (arithmetic, a copy, ``.item()``, printing its values) raises
  ``RuntimeError`` naming ``dlo_fx.cfg_parallel``: a pipeline that reads the first
  prediction before its second call, or that calls the denoiser once per step (guidance
  off) so that the second call never comes, stops there, never computing with bytes that
  are not the prediction.

Once filled, every operation runs on the value and returns plain tensors: the guidance
arithmetic (``uncond + s * (cond - uncond)``) gives a plain tensor, ``torch.equal`` and
in-place updates act on the value.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..torch_private import DISABLED_TORCH_FUNCTION

__all__ = ["Pending", "is_pending"]


class Pending(torch.Tensor):
    """A tensor whose value a later call provides (see [Note: a pending prediction])."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, what: str, source: Optional[tuple] = None,
                device: Optional[torch.device] = None) -> "Pending":
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype,
            device=like.device if device is None else device, requires_grad=False)
        t._value = None
        t._what = what
        t._source = source  # (parent Pending, view function) of a view taken before filling
        return t

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @property
    def filled(self) -> bool:
        return self.value is not None

    @property
    def value(self) -> Optional[torch.Tensor]:
        """The tensor this stands for, or None before its pair computed it."""
        if self._value is None and self._source is not None:
            parent, view = self._source
            if parent.value is not None:
                self._value = view(parent.value)
        return self._value

    def fill(self, value: torch.Tensor) -> None:
        if (value.shape, value.dtype) != (self.shape, self.dtype):
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: {self._what} was promised as {tuple(self.shape)} "
                f"{self.dtype} and computed as {tuple(value.shape)} {value.dtype}; the pair's "
                "two calls made predictions of different shapes")
        self._value = value

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        value = self.value
        if value is None:
            return f"Pending({self._what}, shape={tuple(self.shape)}, dtype={self.dtype})"
        return repr(value)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        waiting = [t for t in leaves if isinstance(t, Pending) and t.value is None]
        if not waiting:
            unwrap = lambda t: t.value if isinstance(t, Pending) else t  # noqa: E731
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        first = waiting[0]
        if func.is_view and args and args[0] is first and len(waiting) == 1:
            return _view(first, func, args[1:], kwargs)
        raise RuntimeError(
            f"dlo_fx.cfg_parallel: {func} read {first._what} before its guidance pair's "
            "second call computed it. A CFG-parallel denoiser called once per guidance "
            "branch defers the first call of each pair (cache_context 'cond') to the second "
            "('uncond'), which computes both on the two ranks; this pipeline used the first "
            "prediction before the second call, or called the denoiser once this step "
            "(guidance off). Run such calls without cfg_parallel (cfg_size=1, or "
            "dlo_fx.cfg_parallel(module, None)), or with guidance on")


def _view(parent: Pending, func: Any, rest: tuple, kwargs: dict) -> Any:
    """``func(parent, *rest)``: `Pending`s of the shapes torch's meta kernels give."""
    meta = torch.empty_strided(parent.shape, parent.stride(), dtype=parent.dtype,
                               device="meta")
    out = func(meta, *rest, **kwargs)

    def one(index: Optional[int], like: torch.Tensor) -> Pending:
        def view(value: torch.Tensor, index: Optional[int] = index) -> torch.Tensor:
            got = func(value, *rest, **kwargs)
            return got if index is None else got[index]
        return Pending(like, parent._what, (parent, view), parent.device)

    if isinstance(out, torch.Tensor):
        return one(None, out)
    return type(out)(one(i, t) for i, t in enumerate(out))


def is_pending(value: Any) -> bool:
    """Whether ``value`` is a `Pending` not filled yet."""
    return isinstance(value, Pending) and value.value is None

