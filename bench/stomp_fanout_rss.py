#!/usr/bin/env python3
"""Broker memory while one large STOMP SEND fans out to N /topic subscribers.

    bench/stomp_fanout_rss.py TRIAD_BINARY [N] [MiB]      starts Triad on free ports
                                                          with a temporary data dir
    bench/stomp_fanout_rss.py --port P --pid PID [N] [MiB]
                                                          a running broker (RabbitMQ:
                                                          the beam.smp pid)

N subscribers (default 10) SUBSCRIBE to /topic/rss and read as fast as they can; one
publisher SENDs one message of MiB (default 64) with a receipt. Prints the broker's RSS
before the SEND, its peak (VmHWM, and RssAnon sampled every 5 ms) and after every
subscriber has the whole message. Plain sockets only (no client library)."""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

args = sys.argv[1:]
proc = None
if args and args[0] == "--port":
    port, pid = int(args[1]), int(args[3])
    args = args[4:]
    name = f"pid {pid}"
else:
    binary = args.pop(0)
    d = tempfile.mkdtemp(prefix="triad-rss-")
    cfg = os.path.join(d, "triad.toml")
    with open(cfg, "w") as f:
        f.write('[store]\nsegment_size = "256 MiB"\n'
                '[limits]\nmax_message_size = "100 MiB"\nstomp_frame_max = "101 MiB"\n')
    proc = subprocess.Popen(
        [binary, "--config", cfg, "--data-dir", os.path.join(d, "data"),
         "--stomp-listen", "127.0.0.1:0", "--amqp-listen", "127.0.0.1:0",
         "--mqtt-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, RUST_LOG="info"))
    port = None
    for line in proc.stderr:
        m = re.search(r"listening proto=stomp addr=\S+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    pid, name = proc.pid, os.path.basename(binary)
n = int(args[0]) if args else 10
size = (int(args[1]) if len(args) > 1 else 64) << 20


def status():
    s = open(f"/proc/{pid}/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", s).group(1)) // 1024
            for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def connect():
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(120)
    s.sendall(b"CONNECT\naccept-version:1.2\nhost:/\nlogin:guest\npasscode:guest\n\n\0")
    buf = b""
    while b"\0" not in buf:
        buf += s.recv(4096)
    assert buf.startswith(b"CONNECTED"), buf
    return s


def expect_receipt(s):
    buf = b""
    while not re.search(b"RECEIPT\n[^\0]*\0", buf):
        chunk = s.recv(4096)
        assert chunk, buf
        buf += chunk


subs = []
for i in range(n):
    s = connect()
    s.sendall(f"SUBSCRIBE\nid:{i}\ndestination:/topic/rss\nreceipt:r\n\n\0".encode())
    expect_receipt(s)
    subs.append(s)
pub = connect()
time.sleep(0.5)
base = status()
peak_anon, stop = [0], [False]


def sample():
    while not stop[0]:
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
        time.sleep(0.005)


sampler = threading.Thread(target=sample)
sampler.start()
got = [0] * n


def drain(i, s):
    total = 0
    while total < size:
        b = s.recv(1 << 20)
        if not b:
            break
        total += len(b)
    got[i] = total


readers = [threading.Thread(target=drain, args=(i, s)) for i, s in enumerate(subs)]
start = time.monotonic()
for r in readers:
    r.start()
head = f"SEND\ndestination:/topic/rss\nreceipt:p\ncontent-length:{size}\n\n".encode()
pub.sendall(head + b"\x01" * size + b"\0")
expect_receipt(pub)
for r in readers:
    r.join(300)
elapsed = time.monotonic() - start
time.sleep(0.3)
stop[0] = True
sampler.join()
end = status()
print(f"broker={name} subscribers={n} message={size >> 20} MiB "
      f"delivered={sum(1 for g in got if g >= size)}/{n} in {elapsed:.2f}s")
print(f"  RSS before the SEND: {base['VmRSS']} MiB (anon {base['RssAnon']} MiB)")
print(f"  peak: VmHWM {end['VmHWM']} MiB, RssAnon {peak_anon[0]} MiB")
print(f"  after: RSS {end['VmRSS']} MiB (anon {end['RssAnon']} MiB, file {end['RssFile']} MiB)")
for s in subs + [pub]:
    s.close()
if proc:
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(d, ignore_errors=True)
