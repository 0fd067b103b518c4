#!/usr/bin/env python3
"""Run a command, and record how much CPU the rest of the machine used meanwhile.

usage: run_measured.py STDOUT_FILE STATS_FILE -- CMD [ARGS...]

CMD's stdout goes to STDOUT_FILE (stderr is passed through). STATS_FILE gets one JSON object:
wall_s, own_cpu_s (CMD and its children, from wait4), other_cpu_s (busy CPU time of the whole
machine from /proc/stat minus own_cpu_s) and other_cpus (other_cpu_s / wall_s: how many CPUs
other processes kept busy on average). On a shared machine this says whether a timing is clean.
Exits with CMD's status.
"""

import json
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / HZ  # all but idle and iowait


def main() -> int:
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, stats, cmd = sys.argv[1], sys.argv[2], sys.argv[4:]
    b0, t0 = machine_busy_s(), time.monotonic()
    with open(out, "wb") as f:
        pid = os.fork()
        if pid == 0:
            os.dup2(f.fileno(), 1)
            try:
                os.execvp(cmd[0], cmd)
            except OSError as e:
                print(f"run_measured: cannot run {cmd[0]}: {e}", file=sys.stderr)
                os._exit(127)
        _, status, ru = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    own = ru.ru_utime + ru.ru_stime
    other = max(0.0, machine_busy_s() - b0 - own)
    with open(stats, "w") as f:
        json.dump({"wall_s": round(wall, 2), "own_cpu_s": round(own, 2), "other_cpu_s": round(other, 2),
                   "other_cpus": round(other / wall, 3) if wall > 0 else 0.0}, f)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
