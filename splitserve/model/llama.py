"""Llama-family decoder (Llama 2/3, Mistral, SmolLM/SmolLM2; Qwen2 via attention_bias).

Module names follow the HF checkpoint so loading is a name mapping; q/k/v and gate/up
are fused into one projection each (fewer, larger GEMMs), filled by `load_weights`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from splitserve.errors import ModelLoadError
from splitserve.model import kernels
from splitserve.model.attention import (AttentionMetadata, forward_context, get_forward_context,
                                        paged_attention)
from splitserve.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary
from splitserve.model.spec import ModelSpec


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q and k heads side by side: one rotary pass over [num_tokens, heads + kv_heads, head_dim]
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(
            -1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(self.layer_idx, q, k, v)
        return self.o_proj(out.flatten(1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds
        them, so `x + attn(norm(x))` and `+ mlp(...)` each cost no separate op."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                      spec.rope_theta, spec.rope_scaling)
        self.spec = spec
        # kernels.exact_decoder, set by LlamaForCausalLM.use_exact_kernels
        self.exact_decoder: Any = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        x = self.embed_tokens.weight.index_select(0, input_ids)  # [num_tokens, hidden]
        rope = self.rotary.table(positions, x.dtype)
        if self.exact_decoder is not None:
            x, stream = self._exact_layers(x, rope, meta)
            return self.norm(x, stream)[0]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope)
            if meta.on_layer_end is not None:
                meta.on_layer_end(i)
        return self.norm(x, residual)[0]

    def _exact_layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One C++ call for the whole stack, or one per layer when a layer hook streams the
        KV out (the hook runs between layers, as on the module path)."""
        e = meta.exact
        assert e is not None, "the exact kernels need the runner's exact batch"
        args = (rope[0], rope[1], meta.kv_cache, e.slots, e.block_tables, e.width,
                e.token_seq, e.context_lens)
        decoder = self.exact_decoder
        if meta.on_layer_end is None:
            out: tuple[torch.Tensor, torch.Tensor] = decoder.forward(
                x, None, *args, 0, len(self.layers))
            return out
        residual: torch.Tensor | None = None
        for i in range(len(self.layers)):
            x, residual = decoder.forward(x, residual, *args, i, i + 1)
            meta.on_layer_end(i)
        assert residual is not None
        return x, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_exact_kernels(self) -> None:
        """The exact path: the decoder stack in one C++ call per step (kernels.exact_decoder),
        built on the packed projections kernels.use_exact_kernels_ put in place, and with
        the model's ends (embedding, rotary tables, final norm, LM head) for
        `sampled_logits`."""
        tensors: list[torch.Tensor] = []
        m: Any = self.model  # its projections are ExactLinears now
        for layer in m.layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors += [layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach()]
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                tensors += proj.operands()
        head: Any = self.lm_head
        bf16 = torch.bfloat16  # the tables as RotaryEmbedding.table gives them a step
        ends = [m.embed_tokens.weight.detach(), m.rotary.cos.to(bf16),
                m.rotary.signed_sin.to(bf16), m.norm.weight.detach(), *head.operands()]
        s = self.spec
        m.exact_decoder = kernels.exact_decoder(
            tensors, ends, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
            s.intermediate_size, s.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for a flat batch; needs a forward_context."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] for the n positions that will be sampled."""
        return self.lm_head(hidden).float()

    def sampled_logits(self, input_ids: list[int], positions: list[int],
                       rows: list[int] | None, meta: AttentionMetadata
                       ) -> tuple[torch.Tensor, list[int] | None]:
        """A step over `meta`'s batch: fp32 logits [n, vocab] of the flat batch's `rows`
        (every row when None), as compute_logits(forward(...)[rows]) in forward_context(meta),
        and each row's first maximum when the step found it on the way (else None: the
        sampler takes it). On the exact path without a layer hook, one C++ call from token
        ids to logits and their maxima, taking the lists as they are: no tensor, numpy
        array, forward context or inference mode made in Python (each costs ~3-30 us of
        the cold Python between two decode steps, after the layers have streamed every
        weight through the caches; the C++ records nothing for autograd). The module path
        runs in inference mode (the layers' KV a layer hook copies are inference tensors)."""
        decoder = self.model.exact_decoder
        if decoder is not None and meta.on_layer_end is None:
            e = meta.exact
            assert e is not None, "the exact kernels need the runner's exact batch"
            logits, first = decoder.logits(
                input_ids, positions, meta.kv_cache, e.slots, e.block_tables, e.width,
                e.token_seq, e.context_lens, rows)
            return logits, first
        device = self.model.embed_tokens.weight.device
        with torch.inference_mode(), forward_context(meta):
            hidden = self(index_tensor(input_ids, device), index_tensor(positions, device))
            if rows is not None:
                hidden = hidden[index_tensor(rows, device)]
            if not len(hidden):
                return hidden.new_empty((0, self.spec.vocab_size), dtype=torch.float32), None
            return self.compute_logits(hidden), None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be set."""
        spec = self.spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                 "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, spec.intermediate_size),
                 "up_proj": ("gate_up_proj", spec.intermediate_size, spec.intermediate_size)}
        params = dict(self.named_parameters(remove_duplicate=False))
        # Parameter name -> how many rows were filled; fused ones fill in parts.
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if spec.tie_word_embeddings and name == "lm_head.weight":
                continue
            parts = name.split(".")
            target_name, offset = name, 0
            if len(parts) >= 2 and parts[-2] in fused:
                target, offset, _ = fused[parts[-2]]
                target_name = ".".join(parts[:-2] + [target, parts[-1]])
            param = params.get(target_name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the "
                                     f"{spec.architecture} model; is the config right?")
            dest = param.data[offset:offset + tensor.shape[0]] if offset or target_name != name \
                else param.data
            if dest.shape != tensor.shape:
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape "
                                     f"{tuple(tensor.shape)}, the model expects "
                                     f"{tuple(dest.shape)}; config and weights disagree")
            dest.copy_(tensor)
            filled[target_name] = filled.get(target_name, 0) + tensor.shape[0]
        tied = {"lm_head.weight"} if spec.tie_word_embeddings else set()
        missing = [n for n, p in params.items()
                   if n not in tied and filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ModelLoadError(f"checkpoint lacks tensors for {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''}; the file is incomplete")


def index_tensor(values: list[int] | list[list[int]], device: torch.device,
                 dtype: type[np.integer[Any]] = np.int64) -> torch.Tensor:
    """An index operand on `device`, through numpy: torch.tensor on a Python list costs
    ~12 us on a Zen 1 core, numpy and from_numpy ~4 together."""
    t = torch.from_numpy(np.array(values, dtype=dtype))
    return t if device.type == "cpu" else t.to(device)
