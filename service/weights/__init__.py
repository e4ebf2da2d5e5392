"""Weights: the table of the model's tensors and the checks on them (`specs`), checkpoints in and
out of the model (`checkpoint`), the trainer-to-ranks broadcast (`sync`), the transports behind
`POST /update_weights` (`transports`) and what a restart brings back (`restore`).

The checkpoint API is re-exported here (`from service.weights import load_checkpoint`); the
other modules are imported by name (they pull in Ray or the coordinator).
"""

from .checkpoint import (
    checkpoint_tensors,
    export_state,
    init_dummy_weights,
    load_checkpoint,
    load_weights,
    materialize_plain,
    save_checkpoint,
    write_dummy_checkpoint,
)
from .specs import CheckpointError, WeightSpec, canonical_name, check_weights, expected_weights, weight_specs

__all__ = ["CheckpointError", "WeightSpec", "canonical_name", "check_weights", "checkpoint_tensors",
           "expected_weights", "export_state", "init_dummy_weights", "load_checkpoint", "load_weights",
           "materialize_plain", "save_checkpoint", "weight_specs", "write_dummy_checkpoint"]
