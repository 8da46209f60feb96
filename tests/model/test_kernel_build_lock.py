"""Starting while the exact kernels build: processes wait for one builder, with a deadline,
and a build killed half-way (torch's `lock` file left behind) does not block later starts."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.model import kernels

HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")
    with kernels._build_lock(tmp_path, deadline_s=5):
        assert not (tmp_path / "lock").exists()


def test_a_start_waits_for_a_live_builder_then_goes_on(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "splitserve.lock"),
                               "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # the live builder's own lock: not touched yet
        start = time.monotonic()
        with kernels._build_lock(tmp_path, deadline_s=60):
            waited = time.monotonic() - start
        assert waited > 0.5  # it waited for the holder to end ...
        assert holder.wait(timeout=10) == 0  # ... which released the lock by exiting
    finally:
        holder.kill()
        holder.wait()


def test_a_builder_that_never_finishes_is_a_timeout_not_a_hang(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "splitserve.lock"),
                               "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="building the exact kernels"):
            with kernels._build_lock(tmp_path, deadline_s=0.5):
                pass
        assert time.monotonic() - start < 10
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not kernels.is_supported(kernels.torch.device("cpu"),
                                             kernels.torch.bfloat16),
                    reason="no exact kernels for this CPU")
def test_the_kernels_load_past_a_killed_builds_lock_file() -> None:
    """The real build directory, a fresh process: before the fix this waited forever."""
    kernels.load()  # built (or loaded) here first, so the child only loads
    stale = kernels.build_directory() / "lock"
    stale.write_text("")
    child = subprocess.run(
        [sys.executable, "-c", "from splitserve.model import kernels; kernels.load(); "
         "print(kernels.isa_name())"], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() in kernels.ISAS
    assert not stale.exists()


def test_each_checkout_builds_in_its_own_directory(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the build records its sources' paths: two checkouts sharing a directory rebuilt it in
    # turn (minutes each, under the lock), so their workers timed out starting
    here = kernels.build_directory()
    assert kernels.build_directory() == here  # the same checkout: the same directory
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in [*kernels._SRC.glob("*.cpp"), *kernels._SRC.glob("*.h")]:
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(kernels, "_SRC", copy)
    other = kernels.build_directory()
    assert other != here and other.name.startswith("splitserve_exact_")
    (copy / "exact.cpp").write_bytes((copy / "exact.cpp").read_bytes() + b"\n// edited\n")
    assert kernels.build_directory() not in (here, other)  # a change rebuilds, as before
