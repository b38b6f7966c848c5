"""The base of distlab's dispatch modes (the comm, memory and transfer meters): a TorchDispatchMode that
leaves torch._dynamo alone.

PyTorch wraps every TorchDispatchMode subclass's `__torch_dispatch__` in
`torch._disable_dynamo`, which imports `torch._dynamo` the first time the mode
sees an op: 2.5-3 s of CPU in a process that had not imported it (measured on
a 2-core laptop-class CPU), paid by every rank of a chapter-1 launch under a
fork server that did not preload it. distlab's modes never run inside
`torch.compile`, so there is nothing for that wrapper to disable.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class EagerMode(TorchDispatchMode):
    """A TorchDispatchMode whose `__torch_dispatch__` is used as written (no torch._dynamo import)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
