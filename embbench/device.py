"""Which torch device a cell runs on: the one place both the launcher (the parent process)
and the runner (a cell's rank) ask, so that neither imports the other."""

from __future__ import annotations

import torch

from embbench.strategy import Unsupported

__all__ = ["resolve_device"]


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """The device of a scenario's ``run.device`` (``auto``, ``cpu``, ``cuda``) on rank ``local_rank``.

    Raises:
        Unsupported: ``cuda`` is asked for and CUDA is not available.
    """
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unsupported("the scenario asks for device cuda, and CUDA is not available")
    return torch.device("cuda", local_rank)
