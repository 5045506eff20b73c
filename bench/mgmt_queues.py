#!/usr/bin/env python3
"""Policies, /metrics and /metrics/per-object at N queues (BENCHMARKS.md, issue 15).

Usage: mgmt_queues.py TRIAD_BINARY N   (N transient queues in / via POST /api/definitions)
"""
import json, sys, subprocess, time, urllib.request, base64, os, re, tempfile
binary = sys.argv[1]; n = int(sys.argv[2])
d = tempfile.mkdtemp(prefix="ops3-100k-")
cfg = os.path.join(d, "triad.toml")
open(cfg, "w").write('[http]\nmax_body_size = "64 MiB"\n')
log = open(os.path.join(d, "log"), "w")
p = subprocess.Popen([binary, "--config", cfg, "--data-dir", os.path.join(d, "data"), "--amqp-listen", "127.0.0.1:0", "--stomp-listen", "127.0.0.1:0", "--mqtt-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"], stderr=log, stdout=log)
http = None
for _ in range(200):
    time.sleep(0.1)
    m = re.search(r"proto=http addr=(\S+)", open(os.path.join(d, "log")).read())
    if m: http = m.group(1); break
auth = {"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode(), "Content-Type": "application/json"}
def req(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(f"http://{http}{path}", data=data, method=method, headers=auth)
    t = time.monotonic()
    with urllib.request.urlopen(r, timeout=600) as resp:
        out = resp.read()
    return time.monotonic() - t, out
def cpu():
    f = open(f"/proc/{p.pid}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
try:
    qs = [{"name": f"q{i:06}", "vhost": "/", "durable": False, "auto_delete": False, "arguments": {}} for i in range(n)]
    t, _ = req("POST", "/api/definitions", {"queues": qs})
    print(f"import {n} queues: {t:.2f} s")
    res = {}
    for path in ["/api/overview", "/metrics", "/metrics/per-object"]:
        times = []
        for _ in range(3):
            c0 = cpu(); t, out = req("GET", path); c1 = cpu()
            times.append((t, c1 - c0, len(out)))
        res[path] = times
        print(f"GET {path}: " + ", ".join(f"{t*1000:.0f} ms wall / {c*1000:.0f} ms broker CPU" for t, c, _ in times) + f"; {times[0][2]} bytes")
    for k, body in [("set", {"pattern": ".*", "definition": {"max-length": 1000}}), ("change", {"pattern": ".*", "definition": {"max-length": 2000, "message-ttl": 60000}})]:
        c0 = cpu(); t, _ = req("PUT", "/api/policies/%2F/all", body); c1 = cpu()
        print(f"policy {k} matching all {n}: {t*1000:.0f} ms wall / {(c1-c0)*1000:.0f} ms broker CPU")
    c0 = cpu(); t, _ = req("DELETE", "/api/policies/%2F/all"); c1 = cpu()
    print(f"policy delete: {t*1000:.0f} ms wall / {(c1-c0)*1000:.0f} ms broker CPU")
    _, out = req("GET", "/api/queues/%2F/q099999" if n >= 100000 else f"/api/queues/%2F/q{n-1:06}")
    print("a queue after:", json.loads(out).get("policy"))
    print("broker RSS KiB:", [l for l in open(f"/proc/{p.pid}/status") if l.startswith("VmRSS")][0].split()[1])
finally:
    p.terminate(); p.wait()
    subprocess.run(["rm", "-rf", d])
