"""The MoE tail: call site (base), the fused collective's protocol, and its backends.

Backends import lazily (`from service.tail.shm import ShmTailCollective`,
`from service.tail.triton_tail import TritonTailCollective`) so that neither numpy nor
Triton is needed to import the call site.
"""

from .base import FusedTailCollective, TailRunner, TailTimeout, unfused_tail
from .protocol import TailStateError

__all__ = ["FusedTailCollective", "TailRunner", "TailTimeout", "TailStateError", "unfused_tail"]
