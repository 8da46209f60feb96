"""The packed weights and the CPU KV cache live on 2 MB pages (splitserve/model/memory.py):
buffers are zeroed, aligned and kept alive by their views, copies keep their values, the
kernel backs them with huge pages where transparent huge pages are enabled, and the exact
model's packed weights are such copies, laid out in the order a step reads them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from splitserve.model import kernels
from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.memory import HUGE_PAGE, huge_page_buffer, huge_page_copies, huge_page_zeros
from splitserve.model.spec import ModelSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (always, madvise, never), if Linux."""
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _smaps_kb(address: int, field: str = "AnonHugePages") -> int:
    """A field (kB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_buffer_is_zeroed_aligned_and_outlives_its_first_tensor() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 100
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    view = buf[HUGE_PAGE:].view(torch.int32)[:10]
    del buf
    view.fill_(7)
    assert view.tolist() == [7] * 10
    assert huge_page_buffer(0).numel() == 0


def test_zeros_has_the_shape_dtype_and_values_of_torch_zeros() -> None:
    kv = huge_page_zeros((3, 2, 5, 16, 2, 8), torch.bfloat16)
    assert torch.equal(kv, torch.zeros(3, 2, 5, 16, 2, 8, dtype=torch.bfloat16))
    assert kv.is_contiguous() and kv.dtype == torch.bfloat16


def test_zeros_are_resident_before_any_step_touches_them() -> None:
    """A KV cache's pages are committed when it is made: no step pays a first-touch fault."""
    kv = huge_page_zeros((4, 2, 64, 16, 4, 64), torch.bfloat16)  # 8 MiB
    assert _smaps_kb(kv.data_ptr(), "Rss") >= kv.numel() * 2 // 1024


def test_copies_keep_values_and_lie_in_one_buffer_in_order() -> None:
    tensors = [torch.randn(37, 5).bfloat16(), torch.randint(-127, 127, (3, 41), dtype=torch.int8),
               torch.randn(13)]
    copies = huge_page_copies(tensors)
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.shape == t.shape
        assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
    starts = [c.data_ptr() for c in copies]
    assert starts == sorted(starts) and starts[-1] - starts[0] < HUGE_PAGE


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off on this machine (or it is not Linux)")
def test_the_kernel_backs_a_buffer_with_huge_pages() -> None:
    buf = huge_page_buffer(8 * HUGE_PAGE)
    buf.fill_(1)  # first touch: the page faults hand out 2 MB pages
    assert _smaps_kb(buf.data_ptr()) >= HUGE_PAGE // 1024


@pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                    reason="exact kernels need an x86 CPU with AVX2")
def test_exact_model_packed_weights_are_huge_page_copies_in_reading_order() -> None:
    spec = ModelSpec("llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True)
    model = LlamaForCausalLM(spec).to(torch.bfloat16)
    plain = {name: kernels.pack_weight(m.weight) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    kernels.use_exact_kernels_(model)
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, kernels.ExactLinear)]
    assert [name for name, _ in linears] == list(plain)
    starts = [m.packed.data_ptr() for _, m in linears]
    assert starts == sorted(starts)  # one buffer, layer by layer, the LM head last
    assert starts[0] % HUGE_PAGE == 0
    for name, m in linears:
        assert torch.equal(m.packed, plain[name]), name
