"""Batch-invariant ("exact") CPU kernels: linear, paged attention, residual + RMSNorm,
SiLU * up, rotary + KV write.

A token's bits must not depend on what else shares its engine step (DESIGN 3: any worker
continues any sequence exactly). oneDNN chooses kernels and blocking by row count and ISA
(AMX tiles, AVX-512 BF16 dot products, a GEMV path), so a bf16 token gets other bits in a
batch of 1 than in a batch of 300. These kernels fix the reduction order of every output
element in the code (see csrc/exact.cpp), so the same token gives the same bits in any
batch, chunk, thread count, and on AVX2 and AVX-512 BF16 machines alike. On AMX-BF16
machines (Sapphire Rapids and later) the linears and attention run on AMX tiles,
batch-invariant too but with bits of their own (csrc/linear_amx.h, attention_amx.h): their
fingerprint says so (`kernels_version()`).

The C++ is compiled once per checkout on first use (torch.utils.cpp_extension: g++ and
ninja; ~40 s on 2 cores: only the binding files include pybind11, none the
whole C++ frontend) and cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions).
`SPLITSERVE_CPU_ISA=avx2|avx512_bf16|amx_bf16` caps the ISA the kernels use (tests run
each level the CPU has; `avx512_bf16` on an AMX machine gives the bits of every other
x86 machine, for a cluster that mixes the two).
Processes that start together build once: the others wait for the builder (at most
`BUILD_DEADLINE_S`), and a build killed half-way never blocks the next start (`_build_lock`).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.memory import huge_page_copies
from splitserve.model.quant import QUANTIZATIONS, int8_weights

logger = logging.getLogger(__name__)

ISAS = {"avx2": 1, "avx512_bf16": 2, "amx_bf16": 3}
# Part of the model fingerprint (kernels_version()): bump when any kernel's arithmetic changes.
EXACT_KERNELS = "exact/v2"
_LANES = 16  # columns per packed weight block (one 16-lane fp32 accumulator)
_SRC = Path(__file__).parent / "csrc"
BUILD_DEADLINE_S = 900.0  # longest wait for another process's build (~1-3 min)
_lock = threading.Lock()
_module: ModuleType | None = None


def is_supported(device: torch.device, dtype: torch.dtype, head_dim: int = 64,
                 hidden: int = 576, intermediate: int = 1536) -> bool:
    """Whether exact kernels exist here: bf16 on an x86 CPU with AVX2, head_dim a multiple
    of 16 up to 128, hidden and intermediate sizes multiples of 16."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and head_dim % 16 == 0
            and head_dim <= 128 and hidden % 16 == 0 and intermediate % 16 == 0
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def load() -> ModuleType:
    """The compiled kernels (built on first use, then loaded from the cache)."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils import cpp_extension
            build_dir = build_directory()
            logger.info("loading splitserve's exact CPU kernels (compiled once per checkout)")
            with _build_lock(build_dir, BUILD_DEADLINE_S):
                _module = cpp_extension.load(
                    name=build_dir.name, build_directory=str(build_dir),
                    sources=[str(_SRC / f) for f in ("exact.cpp", "attention.cpp",
                                                     "layers.cpp", "rope.cpp", "decoder.cpp",
                                                     "operands.cpp", "helpers.cpp")],
                    # no implicit FMA contraction: every rounding is the one written
                    extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                    extra_ldflags=["-fopenmp"], verbose=False)
            cap = os.environ.get("SPLITSERVE_CPU_ISA")
            if cap:
                if cap not in ISAS:
                    raise ValueError(f"SPLITSERVE_CPU_ISA={cap!r}; use one of {sorted(ISAS)}")
                _module.set_isa(ISAS[cap])
        return _module


def build_directory() -> Path:
    """Where the kernels are built and cached: torch's extension directory, under a name
    that carries a digest of every source and header (a change rebuilds) and of where
    they are. The build records the sources' paths, so two checkouts sharing one directory
    (a git worktree, a CI clone beside a working copy) rebuilt it in turn, each for minutes
    under the build lock, while the other's workers waited past their start-up timeout."""
    from torch.utils import cpp_extension
    files = sorted([*_SRC.glob("*.cpp"), *_SRC.glob("*.h")])
    digest = hashlib.blake2b(str(_SRC.resolve()).encode() + b"\0"
                             + b"".join(f.read_bytes() for f in files),
                             digest_size=6).hexdigest()
    return Path(cpp_extension._get_build_directory(f"splitserve_exact_{digest}", False))


@contextmanager
def _build_lock(build_dir: Path, deadline_s: float) -> Iterator[None]:
    """Held while the kernels build or load: an flock on `splitserve.lock`, which the OS
    releases when its holder dies. torch's own `lock` file is not (a build killed half-way
    leaves it, and torch then waits for it forever), so under this lock a `lock` file can
    only be such a leftover, and is removed. TimeoutError after `deadline_s` of waiting."""
    with open(build_dir / "splitserve.lock", "a") as f:
        end = time.monotonic() + deadline_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    raise TimeoutError(
                        f"another process has been building the exact kernels in {build_dir} "
                        f"for over {deadline_s:g} s (the one holding splitserve.lock there); "
                        "let it finish or stop it, then start again") from None
                time.sleep(0.1)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def isa_name() -> str:
    """The instruction set the exact kernels run with on this machine."""
    level = load().get_isa()
    return next((name for name, v in ISAS.items() if v == level), "none")


def kernels_version() -> str:
    """The exact kernels' arithmetic on this machine, for the model fingerprint: AVX2 and
    AVX-512 BF16 compute the same bits (EXACT_KERNELS); AMX tiles their own ("+amx")."""
    return EXACT_KERNELS + ("+amx" if isa_name() == "amx_bf16" else "")


_GROUP = 4  # 16-column blocks per micro-kernel (64 columns)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 (int8 stays int8) -> ceil(N/16) blocks of 16 output columns, each k pair
    of a column side by side (the operand layout of a pairwise bf16 dot product), stored by
    groups of up to 4 blocks as [KP][blocks][16][2] so a micro-kernel streams one contiguous
    region. The groups: each half of the blocks by 4 from its start (csrc/linear_micro.h's
    BlockGroups, which says why). Shape [ceil(N/16), ceil(K/2), 16, 2]; padding is zero."""
    n, k = weight.shape
    nb, kp = -(-n // _LANES), -(-k // 2)
    w = weight.detach()
    w = F.pad(w if w.dtype == torch.int8 else w.to(torch.bfloat16),
              (0, 2 * kp - k, 0, nb * _LANES - n))
    blocks = w.view(nb, _LANES, kp, 2).permute(0, 2, 1, 3)  # [nb, kp, 16, 2]
    halves = ((0, nb // 2), (nb // 2, nb))
    groups = [blocks[g:min(g + _GROUP, end)].transpose(0, 1).reshape(-1)  # [kp, blocks, 16, 2]
              for begin, end in halves for g in range(begin, end, _GROUP)]
    return torch.cat(groups).view(nb, kp, _LANES, 2)


class ExactLinear(nn.Module):
    """y = x @ W^T (+ b) where each output element is one fixed fold over k (exact.cpp);
    with `quantization="int8"` W is int8 and the fold is multiplied by its row's scale."""

    def __init__(self, linear: nn.Linear, quantization: str | None = None,
                 packed: dict[str, torch.Tensor] | None = None) -> None:
        """`packed`: the tensors state() gave for this layer (nothing is packed again)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.scale: torch.Tensor | None = None
        if packed is not None:
            self.packed, self.scale = packed["packed"], packed.get("scale")
        elif quantization is None:
            self.packed = pack_weight(linear.weight)
        elif quantization == "int8":
            q, self.scale = int8_weights(linear.weight)
            self.packed = pack_weight(q)
        else:
            raise ValueError(f"quantization {quantization!r}: the exact kernels run "
                             f"{QUANTIZATIONS} or none")
        if packed is not None:
            self.bias = packed.get("bias")
        else:
            self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._ops = load()

    def state(self) -> dict[str, torch.Tensor]:
        """Its tensors by name, as `packed` takes them back."""
        found = {"packed": self.packed, "scale": self.scale, "bias": self.bias}
        return {name: t for name, t in found.items() if t is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._ops.linear(x.reshape(-1, self.in_features).contiguous(), self.packed,
                             self.out_features, self.bias, self.scale)
        return y if x.dim() == 2 else y.reshape(*shape[:-1], self.out_features)

    def operands(self) -> list[torch.Tensor]:
        """(packed weight, scale, bias) for the one-call decoder, absent ones empty."""
        empty = torch.empty(0)
        return [self.packed, empty if self.scale is None else self.scale,
                empty if self.bias is None else self.bias]


def use_exact_kernels_(model: nn.Module, quantization: str | None = None,
                       packed: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Replaces every nn.Linear (projections and LM head) by an ExactLinear (int8 weights
    with `quantization="int8"`), in place (a tied LM head gets its own packed copy; the
    embedding keeps the plain weight), the packed weights on 2 MB pages (memory.py),
    then switches every module that has an exact path
    to it: `uses_exact_kernels = True`, and `use_exact_kernels()` called where a module
    defines it (it may build on the packed projections: the decoder stack's one-call
    ExactDecoder). `packed`: exact_state() of a model built so before (weight_cache.py):
    its layers and parameters are taken as they are, nothing is packed."""
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                prefix = f"{module_name}.{child_name}." if module_name else f"{child_name}."
                mine = None if packed is None else {
                    k.removeprefix(prefix): t for k, t in packed.items() if k.startswith(prefix)}
                setattr(module, child_name, ExactLinear(child, quantization, mine))
    if packed is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(packed[name])
    # every packed weight in one mapping of 2 MB pages, in the order a step reads them
    linears = [m for m in model.modules() if isinstance(m, ExactLinear)]
    for linear, copy in zip(linears, huge_page_copies([m.packed for m in linears])):
        linear.packed = copy
    for module in model.modules():
        if hasattr(module, "uses_exact_kernels"):
            setattr(module, "uses_exact_kernels", True)
        switch = getattr(module, "use_exact_kernels", None)
        if callable(switch):
            switch()
    return model


def exact_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's weights after use_exact_kernels_ packed them, by name (every
    ExactLinear's state() and every parameter), for `use_exact_kernels_(packed=...)`."""
    state = {f"{name}.{key}": t for name, m in model.named_modules()
             if isinstance(m, ExactLinear) for key, t in m.state().items()}
    state.update((name, p.detach()) for name, p in model.named_parameters())
    return state


def exact_decoder(tensors: list[torch.Tensor], ends: list[torch.Tensor], hidden: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                  eps: float) -> object:
    """A stack of Llama decoder layers run by one C++ call (csrc/decoder.cpp): `tensors` are
    14 per layer: the input and post-attention norm weights, then ExactLinear.operands() of
    QKV, O, gate/up and down (packed weight, int8 scales, bias; absent ones empty). Its
    `forward(x, residual, cos, sin, kv_cache, slots, block_tables, width, token_seq,
    context_lens, begin, end)` runs layers [begin, end) and returns (x, residual); the
    step's index is attention.ExactBatch's lists. `ends`: the embedding, the rotary cos and
    signed sin tables (bf16), the final norm's weight and the LM head's operands, for
    `logits(input_ids, positions, kv_cache, slots, block_tables, width, token_seq,
    context_lens, rows)` (lists but the cache): a whole step's fp32 logits of `rows` (all
    when None) and each one's first maximum (a list) in one call; or empty (no logits())."""
    return load().ExactDecoder([t.contiguous() for t in tensors],
                               [t.contiguous() for t in ends], hidden, num_heads,
                               num_kv_heads, head_dim, intermediate, eps, head_dim ** -0.5)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual (x when None), y = RMSNorm(h) (csrc/layers.cpp)."""
    return load().rms_norm(x.contiguous(), weight, eps, residual)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    """Rotary q and k (layers.apply_rotary's arithmetic), k and v written at their cache
    slots; returns q [T, num_heads, head_dim] (csrc/rope.cpp).

    qkv: [T, (num_heads + 2 kv_heads) * head_dim]; cos, signed_sin: [T, head_dim] bf16."""
    return load().rope_write_kv(qkv.contiguous(), cos, signed_sin, kv_layer, slot_mapping,
                                num_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim (csrc/layers.cpp)."""
    return load().silu_mul(gate_up.contiguous())


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                    token_seq: torch.Tensor, context_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """[T, H, D] bf16: each token over keys 0..context_len-1 of its sequence (attention.cpp).

    kv_layer: [2, num_blocks, block_size, kv_heads, head_dim]; block_tables: [S, max_blocks]
    int32; token_seq, context_lens: [T] int32."""
    return load().paged_attention(q, kv_layer, block_tables, token_seq, context_lens, scale)

