"""Helper threads on a lent core (csrc/helpers.h, cluster/worker/lending.py): a prefill
step computes the same bits with helpers taking part, kept out by their lease, and with the
lease raised and lowered under it many times a step; the helpers do take tasks while it
is down and none while it is up, and a held lease is granted; a helper outlives Python's
mapping of its lease (the interpreter's exit). Helpers start once a process and stay: each
case runs in a fresh interpreter (this file as a script)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from splitserve.model import kernels
from splitserve.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")

PROMPT = 400  # tokens of the prefill step: a few hundred tasks an op


def _prefill(model: LlamaForCausalLM, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's PROMPT-token prefill through the one-call stack: (hidden, KV)."""
    from splitserve.model.attention import AttentionMetadata, ExactBatch, forward_context
    spec = model.spec
    torch.manual_seed(seed)
    blocks = -(-PROMPT // 16)
    kv = (torch.randn(spec.num_layers, 2, blocks, 16, spec.num_kv_heads, spec.head_dim)
          * 0.5).to(torch.bfloat16)
    exact = ExactBatch(list(range(PROMPT)), list(range(blocks)), blocks, [0] * PROMPT,
                       list(range(1, PROMPT + 1)))
    meta = AttentionMetadata(kv, None, 0, None, None, [], [], exact=exact)
    ids = torch.randint(0, spec.vocab_size, (PROMPT,))
    with forward_context(meta), torch.inference_mode():
        return model(ids, torch.arange(PROMPT)), kv


def _child(threads: int) -> dict[str, object]:
    """In a fresh process: reference steps on every ISA level and both weight types, then
    helpers started and the same steps again, lease down, up, and toggled."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_exact_decoder import _model  # a small random model on the exact kernels

    from splitserve.cluster.worker.lending import LeaseFile
    torch.set_num_threads(threads)
    ops = kernels.load()
    native = ops.get_isa()
    models = {q: _model(True, q) for q in (None, "int8")}
    cases = [(isa, q) for isa in range(1, native + 1) for q in models]

    def run_all() -> list[bool]:
        same = []
        for (isa, q), (hidden, kv) in zip(cases, want):
            ops.set_isa(isa)
            got = _prefill(models[q], seed=isa)
            same.append(torch.equal(got[0], hidden) and torch.equal(got[1], kv))
        return same

    want = []
    for isa, q in cases:
        ops.set_isa(isa)
        want.append(_prefill(models[q], seed=isa))
    cores = sorted(os.sched_getaffinity(0))
    lease = LeaseFile(os.path.join(tempfile.mkdtemp(), "core.lease"))
    ops.start_helpers([cores[-1]], [lease.path], 19)
    report: dict[str, object] = {"helpers": ops.helper_count()}
    before, free = ops.helper_tasks(), []
    # A helper is niced 19 on a core a team thread may share (threads=2 on two cores): it
    # may find no task free in one round; it must in a few.
    for _ in range(8):
        free += run_all()
        if ops.helper_tasks() > before:
            break
    report["free"] = free
    report["tasks_free"] = ops.helper_tasks() - before
    report["granted"] = ops.lease_hold(lease.address, 1.0)
    before = ops.helper_tasks()
    report["held"] = run_all()
    report["tasks_held"] = ops.helper_tasks() - before
    ops.lease_free(lease.address)
    stop, flips = threading.Event(), [0]

    def toggle() -> None:  # a decode worker stepping now and then
        while not stop.is_set():
            ops.lease_hold(lease.address, 0.005)
            time.sleep(0.0005)
            ops.lease_free(lease.address)
            time.sleep(0.001)
            flips[0] += 1
    flipper = threading.Thread(target=toggle)
    flipper.start()
    report["toggled"] = run_all() + run_all()
    stop.set()
    flipper.join()
    report["flips"] = flips[0]
    return report


def _child_outliving(threads: int) -> dict[str, object]:
    """In a fresh process: a helper waits out a held lease while Python unmaps its own view
    of the lease file (as the interpreter does at exit); the helper must not fault."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_exact_decoder import _model

    from splitserve.cluster.worker.lending import LeaseFile
    torch.set_num_threads(threads)
    ops = kernels.load()
    lease = LeaseFile(os.path.join(tempfile.mkdtemp(), "core.lease"))
    ops.start_helpers([sorted(os.sched_getaffinity(0))[-1]], [lease.path], 19)
    granted = ops.lease_hold(lease.address, 1.0)
    _prefill(_model(True, None), seed=0)  # the helper sees the lease up and waits on it
    lease.close()
    time.sleep(0.2)  # it re-reads its lease every 20 ms
    return {"granted": granted}


def test_a_helper_outlives_pythons_mapping_of_its_lease() -> None:
    out = subprocess.run([sys.executable, __file__, "1", "outliving"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"granted": True}


@pytest.mark.parametrize("threads", [1, 2])
def test_helpers_take_tasks_and_leave_the_bits_alone(threads: int) -> None:
    """threads=1: the master alone with a helper (a prefill worker on one own core);
    2: a team of two with a helper (the team's ops, tasks.h)."""
    out = subprocess.run([sys.executable, __file__, str(threads)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["helpers"] == 1
    cases = len(report["held"])
    assert cases >= 2 and report["free"] == [True] * len(report["free"]), report
    assert report["tasks_free"] > 0, report  # the helper did compute
    assert report["granted"] is True, report
    assert report["held"] == [True] * cases and report["tasks_held"] == 0, report
    assert report["toggled"] == [True] * 2 * cases and report["flips"] > 10, report


if __name__ == "__main__":
    child = _child_outliving if sys.argv[2:] == ["outliving"] else _child
    print(json.dumps(child(int(sys.argv[1]))))
