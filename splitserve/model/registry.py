"""Model architectures by registry key (ModelSpec.architecture)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.spec import ModelSpec

# Qwen2 is a Llama with q/k/v biases (ModelSpec.attention_bias), so it shares the class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


class _NoRandomInit(TorchFunctionMode):
    """torch.nn.init's fills skipped (the tensor is returned as allocated), in this thread
    only: nn.Linear's and nn.Embedding's random init of 135 M parameters took ~0.8 s of
    every engine's start, for values the checkpoint overwrites."""

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type],
                           args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build_model(spec: ModelSpec) -> nn.Module:
    """The model for `spec`, its parameters allocated but not initialized: the caller loads
    every one (LlamaForCausalLM.load_weights fails on any it was not given)."""
    try:
        cls = ARCHITECTURES[spec.architecture]
    except KeyError:
        raise KeyError(f"unsupported architecture {spec.architecture!r}; supported: "
                       f"{sorted(ARCHITECTURES)}") from None
    with _NoRandomInit():
        return cls(spec)
