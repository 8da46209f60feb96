"""Frozen configuration dataclasses: one place for every engine knob."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks in the pool; None sizes it from `kv_cache_memory_bytes`.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 2")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Token budget of one engine step (prefill chunks + decodes).
    max_num_batched_tokens: int = 512
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive")


@dataclass(frozen=True)
class EngineConfig:
    # A HF checkpoint directory, a .gguf file, or None for the default model.
    model: str | None = None
    # "auto" = bfloat16 on CPU and CUDA; "float32" for reference-exact math.
    dtype: str = "auto"
    # "auto" = CUDA when present, else CPU.
    device: str = "auto"
    # torch intra-op threads on CPU; None keeps torch's default.
    num_threads: int | None = None
    # None = weights in `dtype`; "int8" = weight-only int8 (faster batch-1 decode on CPU).
    quantization: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Check the block pool's invariants after every step (tests turn this on).
    debug_invariants: bool = False

    @staticmethod
    def from_kwargs(model: str | None = None, **kwargs: object) -> "EngineConfig":
        """Build from flat keyword arguments (`block_size=8, max_num_seqs=4, ...`)."""
        cache_keys = CacheConfig.__dataclass_fields__.keys()
        sched_keys = SchedulerConfig.__dataclass_fields__.keys()
        engine_keys = EngineConfig.__dataclass_fields__.keys() - {"cache", "scheduler", "model"}
        unknown = kwargs.keys() - cache_keys - sched_keys - engine_keys
        if unknown:
            known = sorted([*cache_keys, *sched_keys, *engine_keys])
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: {known}")
        pick = lambda keys: {k: v for k, v in kwargs.items() if k in keys}  # noqa: E731
        return EngineConfig(model=model, cache=CacheConfig(**pick(cache_keys)),  # type: ignore[arg-type]
                            scheduler=SchedulerConfig(**pick(sched_keys)),  # type: ignore[arg-type]
                            **pick(engine_keys))  # type: ignore[arg-type]
