#!/usr/bin/env python3
"""A flood of oversized prompts against `moeflux serve`: what it costs the
server (issue 19's "work before admission").

Several rounds of N concurrent chat requests whose message is M bytes of
text, far beyond the context. Prints, per round, the status codes, the
wall time until all were answered, the server's CPU time spent, its
resident memory before and after, and `moeflux_prompts_tokenized_total`
(prompts that reached the tokenizer). Linux only (/proc); standard library
only.

  python3 bench/serve-flood.py [--bin target/release/moeflux] [--model DIR]
                               [--clients 8] [--mbytes 3.8] [--rounds 3]
"""

import argparse
import concurrent.futures
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(base, name):
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def post(base, body):
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target/release/moeflux"))
    ap.add_argument("--model", help="model directory (default: the demo model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--mbytes", type=float, default=3.8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [a.bin, "serve", "--port", str(port), "--threads", "2"]
    if a.model:
        cmd += ["--model", a.model]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            if "listening on" in line:
                break
        else:
            raise SystemExit("the server did not start")
        text = ("lorem ipsum dolor sit amet " * int(a.mbytes * 1e6 / 27 + 1))[: int(a.mbytes * 1e6)]
        body = json.dumps({"messages": [{"role": "user", "content": text}],
                           "max_tokens": 16}).encode()
        print(f"{a.clients} clients x {len(body) / 1e6:.1f} MB bodies, {a.rounds} rounds")
        print("| round | statuses | wall s | server CPU s | RSS before MB | RSS after MB | prompts tokenized |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for r in range(a.rounds):
            before, cpu0 = rss_mb(server.pid), cpu_s(server.pid)
            t0 = time.time()
            with concurrent.futures.ThreadPoolExecutor(a.clients) as ex:
                codes = list(ex.map(lambda _: post(base, body), range(a.clients)))
            wall = time.time() - t0
            time.sleep(1)
            counts = {c: codes.count(c) for c in sorted(set(codes))}
            print(f"| {r + 1} | {counts} | {wall:.2f} | {cpu_s(server.pid) - cpu0:.2f} | "
                  f"{before:.0f} | {rss_mb(server.pid):.0f} | "
                  f"{metric(base, 'moeflux_prompts_tokenized_total'):.0f} |")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
