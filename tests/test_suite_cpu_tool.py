"""bench/suite_cpu.py (CI-time work, issue 20): every Python process of the command records its CPU at exit, a
SIGTERMed one included, and the table sums them by kind."""

import json
import os
import re
import subprocess
import sys
import textwrap

TOOL = os.path.join(os.path.dirname(__file__), "..", "bench", "suite_cpu.py")

# a parent that burns CPU, a child that burns CPU and exits, and a child that is sent SIGTERM while it sleeps
COMMAND = textwrap.dedent(
    """
    import subprocess, sys, time
    def burn(s):
        t = time.process_time()
        while time.process_time() - t < s:
            pass
    burn(0.3)
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"], check=True)
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdout.write('up\\\\n'); sys.stdout.flush(); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "up\\n"
    p.terminate()
    assert p.wait(timeout=30) == -15
    """
)


def test_every_process_records_its_cpu_and_the_table_sums_them(tmp_path):
    out = tmp_path / "records.jsonl"
    proc = subprocess.run([sys.executable, TOOL, "--out", str(out), "--", sys.executable, "-c", COMMAND],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 3, recs  # the parent, the child that exited, the SIGTERMed child
    pids = {r["pid"] for r in recs}
    parent = [r for r in recs if r["ppid"] not in pids]  # `python -c` keeps no code in argv: found by pid
    assert len(parent) == 1 and parent[0]["cpu"] >= 0.3
    children = [r for r in recs if r["ppid"] == parent[0]["pid"]]
    assert len(children) == 2 and max(r["cpu"] for r in children) >= 0.3
    assert not any(r["vllm"] for r in recs)
    # the table: one row (three `python -c` processes) whose CPU is the records' sum; the command's total covers it
    total = sum(r["cpu"] for r in recs)
    rows = [line for line in proc.stdout.splitlines() if line.endswith("| other `python -c` |")]
    assert len(rows) == 1, proc.stdout
    cpu, share, n, n_vllm = (c.strip() for c in rows[0].strip("|").split("|")[:4])
    tol = 0.5 if total >= 1 else 0.005  # the table rounds a row to whole seconds from 1 s up (slow start-ups: ASan)
    assert (n, n_vllm, share) == ("3", "0", "100.0 %") and abs(float(cpu) - total) <= tol, (rows[0], total)
    m = re.search(r"3 Python processes recorded, (\S+) CPU s of the command's (\S+) CPU s", proc.stdout)
    assert m and float(m.group(2)) >= float(m.group(1)) - 0.5, proc.stdout


def test_without_the_tool_nothing_is_recorded(tmp_path):
    """Negative control: the records come from the tool's sitecustomize, not from the command."""
    out = tmp_path / "records.jsonl"
    env = dict(os.environ, ALIGNED_SUITE_CPU_RECORDS=str(out))
    # (when this suite itself runs under the tool, its sitecustomize is on PYTHONPATH: leave it out here)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not os.path.exists(os.path.join(p, "sitecustomize.py")))
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=60)
    assert not out.exists()
