"""Shared microbenchmark helpers: time an aligned op and torch's native op on the same inputs, in the same
run, and print one table row each (times in microseconds, ratio = torch time / aligned time, so > 1 means
aligned_ops is faster). torch.utils.benchmark.Timer synchronises CUDA, so the same code serves the GPU."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.utils.benchmark as tbench


def proc_status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (``VmRSS``, ``VmHWM``: the process's resident memory as the kernel counts
    it, what the memory benchmarks report), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def cpu_time_us(fn, min_run_time: float = 0.3, blocks: int = 5) -> float:
    """Median CPU time of the calling thread per fn() call, in microseconds (blocks of calls, each block at least
    min_run_time / blocks of CPU time). With torch.set_num_threads(1) this is the op's whole cost, and unlike
    wall time it does not grow when other processes share the cores (cache and memory contention still count)."""
    import statistics
    import time

    fn()
    per = []
    for _ in range(blocks):
        n, t0 = 0, time.thread_time()
        while True:
            fn()
            n += 1
            el = time.thread_time() - t0
            if el >= min_run_time / blocks:
                break
        per.append(el / n)
    return statistics.median(per) * 1e6


def device_median_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``reps`` calls of fn() on a GPU: each call between two CUDA events (the events
    time the device's work, not the host's launch), after ``warmup`` calls and a synchronize. The GPU benches'
    one timer (bench_gpu.py, bench_gpu_mma.py)."""
    import statistics

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_us(fn, min_run_time: float = 0.3, cpu_time: bool = False) -> float:
    """Median wall time of fn() in microseconds (blocked_autorange: repeats until min_run_time is spent);
    cpu_time=True: cpu_time_us instead."""
    if cpu_time:
        return cpu_time_us(fn, min_run_time)
    fn()  # warm-up (allocations, lazy init)
    m = tbench.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
    return m.median * 1e6


class Table:
    """Collects rows (op, shape, aligned us, torch us, ratio) and prints them as a Markdown table."""

    def __init__(self, title: str, cpu_time: bool = False):
        self.title = title
        self.cpu_time = cpu_time
        self.rows: list[tuple[str, str, str, float, float]] = []

    def add(self, op: str, shape: str, dtype: torch.dtype, aligned_fn, torch_fn, min_run_time: float = 0.3,
            repeat: int = 1):
        """repeat > 1: time both sides `repeat` times, interleaved, and keep the median of each."""
        import statistics

        ts, As = [], []
        for _ in range(repeat):
            As.append(time_us(aligned_fn, min_run_time, self.cpu_time))
            ts.append(time_us(torch_fn, min_run_time, self.cpu_time))
        a, t = statistics.median(As), statistics.median(ts)
        row = (op, shape, str(dtype).replace("torch.", ""), a, t)
        self.rows.append(row)
        print(f"  {op:<22} {shape:<28} {row[2]:<9} aligned {a:10.1f} us  torch {t:10.1f} us  ratio {t / a:5.2f}",
              file=sys.stderr, flush=True)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| op | shape | dtype | aligned (us) | torch (us) | speed ratio (torch/aligned) |",
                 "|---|---|---|---:|---:|---:|"]
        for op, shape, dt, a, t in self.rows:
            lines.append(f"| {op} | {shape} | {dt} | {a:.1f} | {t:.1f} | {t / a:.2f} |")
        return "\n".join(lines) + "\n"


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing (smoke run)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def emit(table: Table, args: argparse.Namespace) -> None:
    md = table.markdown()
    print(md)
    if args.out:
        with open(args.out, "a") as f:
            f.write(md + "\n")
