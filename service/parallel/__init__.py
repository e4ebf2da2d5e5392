"""The TP group: the collectives the model, the fused tail and the engine need (`group`), and
under them the shared-memory transport between the ranks of one node (`shm_group`). It sits
below the model: `service.model`, `service.tail` and `service.weights` use it, `service.cluster`
sets it up on every rank.
"""

from .group import TPGroup, set_cpu_threads

__all__ = ["TPGroup", "set_cpu_threads"]
