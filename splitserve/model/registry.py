"""Model architectures by registry key (ModelSpec.architecture)."""
from __future__ import annotations

from torch import nn

from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.spec import ModelSpec

# Qwen2 is a Llama with q/k/v biases (ModelSpec.attention_bias), so it shares the class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def build_model(spec: ModelSpec) -> nn.Module:
    try:
        cls = ARCHITECTURES[spec.architecture]
    except KeyError:
        raise KeyError(f"unsupported architecture {spec.architecture!r}; supported: "
                       f"{sorted(ARCHITECTURES)}") from None
    return cls(spec)
