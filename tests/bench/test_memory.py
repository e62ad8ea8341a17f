"""The comparison's memory readings: a real process tree read from /proc, and its table."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from benchmarks import compare_report
from benchmarks.memory import process_tree, tree_memory

# a parent holding ~64 MiB that starts a child holding ~32 MiB, both then sleep
PARENT = ("import subprocess, sys, time; block = bytearray(64 << 20); "
          "child = subprocess.Popen([sys.executable, '-c', "
          "'import time; block = bytearray(32 << 20); print(1, flush=True); time.sleep(60)'], "
          "stdout=sys.stdout); time.sleep(60)")


def test_a_process_tree_is_read_with_each_process_peak():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    pids = [parent.pid]
    try:
        assert parent.stdout.readline().strip() == b"1"  # the child has its memory
        pids = process_tree(parent.pid)
        assert pids[0] == parent.pid and len(pids) == 2
        memory = {item["pid"]: item for item in tree_memory(parent.pid)}
        assert memory[parent.pid]["name"].startswith("python")
        assert memory[parent.pid]["peak_mib"] >= 64 and memory[pids[1]]["peak_mib"] >= 32
        assert all(item["peak_mib"] >= item["rss_mib"] > 0 for item in memory.values())
    finally:
        for pid in reversed(pids):
            os.kill(pid, signal.SIGKILL)
        parent.wait()
    time.sleep(0.1)
    assert process_tree(parent.pid) == [] and tree_memory(parent.pid) == []


def test_memory_table_lists_processes_by_peak_and_skips_systems_without_readings():
    systems = [{"name": "kvrelay pd", "kv_capacity_tokens": 32768, "memory": [
                   {"pid": 1, "name": "up", "rss_mib": 90, "peak_mib": 100},
                   {"pid": 2, "name": "worker decode", "rss_mib": 700, "peak_mib": 800.4}]},
               {"name": "unread", "memory": [
                   {"pid": 3, "name": "server", "rss_mib": 5, "peak_mib": 6}]},
               {"name": "failed to start", "error": "boom"}]
    table = compare_report.memory_table(systems)
    assert "| kvrelay pd | 900 | 32,768 | worker decode 800, up 100 |" in table
    assert "| unread | 6 | - | server 6 |" in table
    assert "failed to start" not in table
    assert compare_report.memory_table([{"name": "x"}]) == ""
