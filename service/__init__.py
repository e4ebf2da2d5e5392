"""latentserve: serve Kimi-K3-style latent-MoE models with TP ranks in Ray actors.

`LLM` is imported lazily so that pieces that need neither Ray nor the engine (the memory
pool, the tail kernels) import on machines that only have torch (e.g. the GPU box).
"""

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import InvalidRequest, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequest"]


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
