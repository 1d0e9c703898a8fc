"""An engine pipeline factory whose build outlasts any start timeout a test gives: the
engine's start timeout is then checked however fast the fork server starts a worker."""

from __future__ import annotations

import time


def build(*_: object, **__: object) -> None:
    time.sleep(600)  # the engine kills the worker at its timeout
