"""The SIMT runtime itself (csrc/emu): warp width, votes, shuffle variants, async copies, and the GPU rules it
enforces, on small self-test kernels (csrc/emu/selftest_kernels.cuh) in each vendor spelling."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import aligned_ops

pytestmark = pytest.mark.emulated
selftest = torch.ops.aligned._emulate_selftest


def expected_warp_row(t: int, warp: int) -> list[int]:
    """What CUDA / HIP document for thread t (block of 128, width-16 shuffles, v = 1000 + t)."""
    lane = t % warp
    seg = lane & ~15
    base = t - lane  # first thread of the warp
    val = lambda src_lane: 1000 + base + src_lane  # noqa: E731
    odd = sum(1 << i for i in range(1, warp, 2))
    ballot = odd if warp == 32 else odd - (1 << 64)  # int64 view of the 64-bit mask
    up = lane - 2 if lane - 2 >= seg else lane
    down = lane + 5 if lane + 5 < seg + 16 else lane
    xor = lane ^ 9 if (lane ^ 9) < seg + 16 else lane
    return [warp, ballot, val(seg + 3), val(up), val(down), val(xor)]


@pytest.mark.parametrize("arch", aligned_ops.emulation.ARCHS)
def test_warp_width_votes_and_shuffles(arch):
    warp = 64 if arch.startswith("gfx") else 32
    with aligned_ops.emulate(arch) as emu:
        out = selftest("warp")
    rows = [out[6 * t: 6 * t + 6] for t in range(128)]
    assert rows == [expected_warp_row(t, warp) for t in range(128)]
    assert emu.launches[0].kernel == "selftest_warp" and emu.launches[0].block == (128, 1, 1)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_async_copy_lands_at_the_wait(arch):
    with aligned_ops.emulate(arch):
        before, after = selftest("async_copy")[:2]
    assert (before, after) == (-1, 42)  # reading before __pipeline_wait_prior sees the old value


@pytest.mark.parametrize("arch,case,msg", [
    ("sm_90", "exited_lane", r"lanes 0x20 named in the _sync mask 0xffffffff of warp 0 did not arrive"),
    ("gfx942", "exited_lane", r"lane 4 of warp 0 reads lane 5, which is not at this collective"),
    ("sm_100", "barrier_vs_shuffle", r"mask 0xffffffff of warp 2 did not arrive"),
    ("gfx950", "barrier_vs_shuffle", r"lane 1 of warp 1 reads lane 0, which is not at this collective"),
    ("sm_90", "too_many_threads", r"invalid block \(2048,1,1\)"),
])
def test_broken_gpu_rules_fail_the_launch(arch, case, msg):
    with aligned_ops.emulate(arch):
        with pytest.raises(RuntimeError, match=msg):
            selftest(case)
        # the runtime recovers: the next launch on the same fibers is fine
        assert selftest("warp")[0] == (64 if arch.startswith("gfx") else 32)


def test_selftest_needs_an_active_arch():
    with pytest.raises(RuntimeError, match="needs aligned_ops.emulate"):
        selftest("warp")


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_launches_from_many_host_threads(arch):
    """Every host thread that launches runs its blocks on fibers of its own: a chunk of fiber stacks, registered
    process-wide (at most 256 live at once) and given back when the thread ends. Launches from four threads at once
    give the documented values; so do 300 short-lived threads one after another, more than the registry holds, which
    only works if each ended thread's chunk came back. (A leaked chunk fails it by name either way: at about the
    254th thread the guard pages' mprotect calls reach vm.max_map_count (65,530 mappings by default), and the runtime
    refuses a 257th live chunk.)"""
    want = [v for t in range(128) for v in expected_warp_row(t, 64 if arch.startswith("gfx") else 32)]
    results, errors = [], []

    def launch():
        try:
            results.append(selftest("warp"))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    def run_threads(n):
        threads = [threading.Thread(target=launch) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with aligned_ops.emulate(arch):  # (the arch is process-wide: one scope, launches from every thread)
        run_threads(4)
        for _ in range(300):
            run_threads(1)
    assert not errors, errors[:3]
    assert len(results) == 304 and all(out == want for out in results)


FORK = """
import os, torch, aligned_ops
selftest = torch.ops.aligned._emulate_selftest
x, w = torch.randn(256, 64), torch.ones(64)
with aligned_ops.emulate("sm_90"):
    for _ in range(20):  # 128 blocks a launch: the pool's three helpers run blocks and take chunks
        torch.ops.aligned.rms_norm(x, w, 1e-6)
    parent = selftest("live_fiber_chunks")[0]
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(wr, str(selftest("live_fiber_chunks")[0]).encode())
        torch.ops.aligned.rms_norm(x, w, 1e-6)  # the child's own pool launches
        os._exit(0)
    os.close(wr)
    child = int(os.read(r, 64))
    status = os.waitpid(pid, 0)[1]
print(parent, child, os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_frees_the_dead_threads_fiber_stacks():
    """A forked child runs only the forking thread: every other worker's chunk (the pool's helpers') is a dead copy,
    which the child unmaps and unregisters at once (pthread_atfork), or each generation of a chain of forks would
    keep its parent's and fill the 256-entry registry. Parent: the launching thread and the helpers that ran blocks
    hold chunks; child: only its own thread's, and its launches work."""
    env = dict(os.environ, ALIGNED_EMU_THREADS="4")
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", FORK], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parent, child, child_status = map(int, proc.stdout.split())
    assert parent >= 2 and child == 1 and child_status == 0, (parent, child, child_status)


FORK_DURING_LAUNCHES = """
import os, signal, threading, torch, aligned_ops
x, w = torch.randn(512, 256), torch.ones(256)
stop, statuses = threading.Event(), []
with aligned_ops.emulate("sm_90"):
    def launches():  # another thread inside launches nearly all the time (the op call releases the GIL)
        while not stop.is_set():
            torch.ops.aligned.rms_norm(x, w, 1e-6)
    t = threading.Thread(target=launches)
    t.start()
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a child that hangs ends by SIGALRM (20 x 10 s < the subprocess timeout)
            torch.ops.aligned.rms_norm(x[:4], w, 1e-6)
            os._exit(0)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    stop.set()
    t.join()
print(statuses)
"""


def test_a_fork_while_another_thread_launches_gives_a_child_that_launches():
    """The runtime's mutexes are held across fork (pthread_atfork), so a child never inherits the launch lock held by
    a thread it does not have: 20 forks while another thread launches back to back, every child launches and exits
    0 (one that hung would end by its SIGALRM: status -14). Not run under ASan: GCC 12's libasan is not fork-safe
    against another thread's malloc (scripts/asan_tests.sh says how that was shown)."""
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", FORK_DURING_LAUNCHES],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == str([0] * 20), proc.stdout[-500:]


def test_device_call_from_host_code_is_refused_by_name():
    """A device call (here __syncthreads) outside a kernel: the runtime finds no fiber under the caller and aborts
    with a message naming the call (a subprocess: the abort ends the process)."""
    code = ("import aligned_ops, torch\n"
            "with aligned_ops.emulate('sm_90'):\n"
            "    torch.ops.aligned._emulate_selftest('device_call_from_host')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "aligned emulation: __syncthreads called outside an emulated kernel" in proc.stderr


# ---- schedules: the planted races (csrc/emu/selftest_kernels.cuh) -------------------------------------------

RACE_ARCHS = ["sm_90", "gfx942"]  # the CUDA spelling (warp 32, __syncwarp) and the HIP one (wave64, wave barrier)


def stale_reads(case: str, arch: str, schedule: str) -> int:
    """Threads that read a slot before its writer wrote it (the kernel reads thread t - 32, or lane l - 1)."""
    with aligned_ops.emulate(arch, schedule=schedule):
        out = selftest(case)
    stale = 0
    for t in range(128):
        src = (t - 32 if t >= 32 else t) if case.startswith("race_syncthreads") else (t - 1 if t % 32 else t)
        assert out[t] in (0, src + 1), (t, out[t])
        stale += out[t] == 0
    return stale


@pytest.mark.parametrize("arch", RACE_ARCHS)
@pytest.mark.parametrize("race", ["race_syncthreads", "race_syncwarp"])
@pytest.mark.parametrize("schedule", ["reverse", "random:1", "random:2"])
def test_planted_race_is_caught(arch, race, schedule):
    # the missing barrier gives stale reads ...
    assert stale_reads(race, arch, schedule) > 0, f"{race} under {schedule} read no stale value"
    # ... and the same kernel with the barrier none (the negative control: the comparison can pass)
    assert stale_reads(race + "_fixed", arch, schedule) == 0


@pytest.mark.parametrize("arch", RACE_ARCHS)
@pytest.mark.parametrize("race", ["race_syncthreads", "race_syncwarp"])
def test_index_order_hides_the_planted_race(arch, race):
    """Why the schedules exist: in index order every writer runs before its reader, so forward sees nothing."""
    assert stale_reads(race, arch, "forward") == 0


def test_random_schedule_is_reproducible_and_seeded():
    runs = {}
    for seed in (1, 2, 1):
        with aligned_ops.emulate("sm_90", schedule=f"random:{seed}"):
            runs.setdefault(seed, []).append(selftest("race_syncthreads")[:128] + selftest("race_syncwarp")[:128])
    assert runs[1][0] == runs[1][1]  # the same seed gives the same interleaving
    assert runs[1][0] != runs[2][0]  # another seed another one


def test_bad_schedule_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="schedule must be forward, reverse or random:SEED"):
        aligned_ops.emulate("sm_90", schedule="sideways")
    monkeypatch.setenv("ALIGNED_EMU_SCHEDULE", "random:x")
    with aligned_ops.emulate("sm_90"):
        with pytest.raises(RuntimeError, match=r"ALIGNED_EMU_SCHEDULE must be forward, reverse or random:SEED .*'random:x'"):
            selftest("warp")


def test_emulate_scope_restores_the_schedule(monkeypatch):
    monkeypatch.setenv("ALIGNED_EMU_SCHEDULE", "random:7")
    with aligned_ops.emulate("sm_90", schedule="reverse"):
        import os

        assert os.environ["ALIGNED_EMU_SCHEDULE"] == "reverse"
    assert os.environ["ALIGNED_EMU_SCHEDULE"] == "random:7"


# ---- dynamic shared memory limits -------------------------------------------------------------------------


def test_dynamic_shared_memory_contents_and_limit_on_cuda():
    with aligned_ops.emulate("sm_90"):
        selftest("dynamic_shared_optin:49152")  # back to the default limit (attributes live for the process)
        out = selftest("dynamic_shared:49152")  # 48 KB: no opt-in needed
        assert out[:128] == [1] * 128  # fresh contents read as 0xff bytes (undefined on a GPU)
        assert out[128:256] == [49152 // 4 - 1 - t for t in range(128)]
        with pytest.raises(RuntimeError, match=r"49156 bytes of dynamic shared memory exceed the kernel's limit of 49152 "
                                               r"on sm_90 \(raise it first: cudaFuncSetAttribute"):
            selftest("dynamic_shared:49156")
        out = selftest("dynamic_shared_optin:200000")  # with the opt-in, up to the arch's 227 KB
        assert out[128:256] == [200000 // 4 - 1 - t for t in range(128)] and out[-1] == 227 * 1024
        assert selftest("dynamic_shared:200000")[128] == 200000 // 4 - 1  # the raised limit stays with the kernel
        with pytest.raises(RuntimeError, match=r"invalid argument"):
            selftest("dynamic_shared_optin:240000")
        selftest("dynamic_shared_optin:49152")
    with aligned_ops.emulate("sm_120"):  # RTX 50xx: 99 KB after the opt-in
        with pytest.raises(RuntimeError, match="invalid argument"):
            selftest("dynamic_shared_optin:110000")
        assert selftest("dynamic_shared_optin:100000")[-1] == 99 * 1024


@pytest.mark.parametrize("arch,lds", [("gfx942", 64 * 1024), ("gfx950", 160 * 1024)])
def test_dynamic_shared_memory_limit_on_hip(arch, lds):
    with aligned_ops.emulate(arch):
        assert selftest(f"dynamic_shared:{lds}")[128] == lds // 4 - 1  # the whole LDS without an opt-in
        with pytest.raises(RuntimeError, match=rf"the arch gives a block at most {lds}"):
            selftest(f"dynamic_shared:{lds + 4}")


# ---- FP environment -----------------------------------------------------------------------------------------


def test_kernels_run_in_the_ieee_environment_whatever_the_host_thread_set():
    import struct

    with aligned_ops.emulate("sm_90"):
        csr, product, host_csr, host_product = selftest("fp_environment")[:4]
    assert csr == 0x1F80  # round to nearest, no FTZ, no DAZ, exceptions masked
    expected = struct.unpack("<I", struct.pack("<f", 2.0**-130 * 1.5))[0]
    assert product == expected and 0 < expected < 0x00800000  # a subnormal, kept
    assert host_csr & 0xE040 == 0xE040  # the caller's hostile environment was given back ...
    assert host_product == 0  # ... and it does flush (the negative control)


def test_torch_flush_denormal_does_not_reach_emulated_kernels():
    # a = 1 and b subnormal: silu(1) * b is subnormal; rms_norm's inputs are subnormal
    x = torch.cat([torch.ones(3, 20), torch.full((3, 20), 3e-39)], 1)
    w = torch.ones(40)
    with aligned_ops.emulate("sm_90"):
        ref = torch.ops.aligned.rms_norm(x, w, 1e-30)
        sm = torch.ops.aligned.silu_and_mul(x)
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    try:
        assert torch.equal(torch.tensor([3e-39]) * 1.0, torch.zeros(1))  # control: the host thread now flushes
        with aligned_ops.emulate("sm_90"):
            got = torch.ops.aligned.rms_norm(x, w, 1e-30)
            got_sm = torch.ops.aligned.silu_and_mul(x)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(got_sm.view(torch.int32), sm.view(torch.int32))
    assert (sm != 0).all() and (sm.abs() < 1.2e-38).all()  # subnormal results, kept
