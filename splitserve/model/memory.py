"""CPU memory for what a step streams: the packed weights and the KV cache, on 2 MB pages.

A batch-1 decode step reads every weight once from DRAM (269 MB for SmolLM2-135M). On
4 KB pages the reads cross a page every 64 cache lines: a TLB miss each, and the
hardware prefetchers stop at every page boundary. On a 2-core Zen 4 VM the same step over
the same weights took 7.9-9.4 ms on 4 KB pages and 6.0-6.9 ms on 2 MB pages (same run,
docs/benchmarks.md). PyTorch's allocator asks for huge pages only past 2 MB and only
with THP_MEM_ALLOC_ENABLE=1; each projection's weight is smaller. So the weights are
copied into one mapping advised MADV_HUGEPAGE, and the KV cache is allocated in one.
Linux backs such memory with 2 MB pages where transparent huge pages are `madvise` or
`always`; elsewhere (`never`, other systems) it is plain memory, the same bits.
"""
from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # bytes: each tensor placed in a buffer starts on a cache line


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of `nbytes`, starting on a 2 MB boundary of an
    anonymous mapping advised MADV_HUGEPAGE (where the platform has it). The mapping lives
    as long as any view of the tensor."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    # private, as malloc's memory is (Python's default anonymous mapping is shared: shmem,
    # which takes huge pages only under another setting, usually off)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on 2 MB pages (a CPU KV cache), every page committed
    now: a page first touched later costs its step a fault that zeroes 2 MB (~0.1-0.2 ms),
    and a decode step whose new slots open fresh pages in every layer's K and V took up to
    ~60 of them (docs/benchmarks.md, 2026-11-30). The memory is resident from the start, as
    a torch.zeros cache is."""
    numel = 1
    for n in shape:
        numel *= n
    buffer = huge_page_buffer(numel * dtype.itemsize)
    buffer.zero_()  # the first write faults each page in (a 2 MB one where THP allows)
    return buffer.view(dtype).view(shape)


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU tensors, one after another in one huge-page buffer, in the
    order given (the order a step reads them)."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = huge_page_buffer(end)
    copies = []
    for t, offset in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        copy = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
