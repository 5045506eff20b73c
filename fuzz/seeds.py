#!/usr/bin/env python3
"""Writes the committed seed corpus, fuzz/corpus/<target>/: valid frames per decoder.

Sources: the AMQP wire vectors (adapters/amqp/tests/wire/amqp/*.hex), the STOMP wire
vectors (adapters/stomp/tests/wire/*.vec), and frames built here for what a client
session sends (AMQP handshake, publish, consume; every MQTT packet type; commitlog
message, ack and padding records). Every fuzz target reads two leading config bytes
(limits / dialect, split point; store_record: one mode byte) before the stream, so each
seed is written with a few config prefixes. Rerun after changing a codec's wire format:

    python3 fuzz/seeds.py
"""
import glob
import hashlib
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fuzz", "corpus")


def write(target, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    name = hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- AMQP 0-9-1

def shortstr(s):
    b = s.encode()
    return bytes([len(b)]) + b


def longstr(b):
    return struct.pack(">I", len(b)) + b


def table(pairs):
    body = b""
    for k, (t, v) in pairs.items():
        body += shortstr(k) + t + v
    return longstr(body)


def frame(kind, ch, payload):
    return struct.pack(">BHI", kind, ch, len(payload)) + payload + b"\xce"


def method(ch, cls, m, args=b""):
    return frame(1, ch, struct.pack(">HH", cls, m) + args)


def amqp_seeds():
    seeds = []
    for path in sorted(glob.glob(os.path.join(ROOT, "adapters/amqp/tests/wire/amqp/*.hex"))):
        hexes = []
        for line in open(path):
            line = line.strip()
            if not line or line.startswith("#") or ":" in line:
                continue
            hexes.append(line.replace(" ", ""))
        seeds.append(bytes.fromhex("".join(hexes)))
    props = table({"product": (b"S", longstr(b"fuzz")),
                   "capabilities": (b"F", table({"publisher_confirms": (b"t", b"\x01")})),
                   "n": (b"I", struct.pack(">i", 7)),
                   "list": (b"A", longstr(b"S" + longstr(b"x") + b"l" + struct.pack(">q", 1)))})
    start_ok = method(0, 10, 11, props + shortstr("PLAIN") + longstr(b"\0guest\0guest") + shortstr("en_US"))
    tune_ok = method(0, 10, 31, struct.pack(">HIH", 2047, 131072, 60))
    open_ = method(0, 10, 40, shortstr("/") + shortstr("") + b"\x00")
    ch_open = method(1, 20, 10, shortstr(""))
    declare = method(1, 50, 10, b"\x00\x00" + shortstr("q") + b"\x02"
                     + table({"x-max-length": (b"l", struct.pack(">q", 10)),
                              "x-dead-letter-exchange": (b"S", longstr(b"dlx"))}))
    bind = method(1, 50, 20, b"\x00\x00" + shortstr("q") + shortstr("amq.topic") + shortstr("a.*.#") + b"\x00" + table({}))
    qos = method(1, 60, 10, struct.pack(">IHB", 0, 10, 0))
    consume = method(1, 60, 20, b"\x00\x00" + shortstr("q") + shortstr("tag") + b"\x00" + table({}))
    confirm = method(1, 85, 10, b"\x00")
    publish = method(1, 60, 40, b"\x00\x00" + shortstr("") + shortstr("q") + b"\x00")
    # content header: class 60, weight 0, body size 5, flags: content-type, headers, delivery-mode
    header = frame(2, 1, struct.pack(">HHQH", 60, 0, 5, 0x8000 | 0x2000 | 0x1000)
                   + shortstr("text/plain") + table({"k": (b"S", longstr(b"v"))}) + b"\x02")
    body = frame(3, 1, b"hello")
    ack = method(1, 60, 80, struct.pack(">QB", 1, 0))
    close = method(0, 10, 50, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0))
    heartbeat = frame(8, 0, b"")
    seeds += [start_ok, tune_ok, open_, ch_open, declare, bind, qos, consume, confirm,
              publish + header + body, ack, close, heartbeat,
              start_ok + tune_ok + open_ + ch_open + confirm + publish + header + body + ack]
    for s in seeds:
        for cfg in (b"\x00\x80", b"\x01\x40"):
            write("amqp_decode", cfg + s)


# ---------------------------------------------------------------- STOMP

def unescape_vec(s):
    out = bytearray()
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            n = s[i + 1]
            if n == "n":
                out += b"\n"
            elif n == "r":
                out += b"\r"
            elif n == "0":
                out += b"\0"
            elif n == "\\":
                out += b"\\"
            elif n == "x":
                out.append(int(s[i + 2:i + 4], 16))
                i += 2
            else:
                out += ("\\" + n).encode()
            i += 2
            continue
        out += c.encode()
        i += 1
    return bytes(out)


def stomp_seeds():
    seeds = []
    for path in sorted(glob.glob(os.path.join(ROOT, "adapters/stomp/tests/wire/*.vec"))):
        cur = b""
        for line in open(path):
            line = line.rstrip("\n")
            if line.startswith("input: "):
                cur += unescape_vec(line[len("input: "):])
            elif not line.strip() and cur:
                seeds.append(cur)
                cur = b""
        if cur:
            seeds.append(cur)
    seeds += [
        b"CONNECT\naccept-version:1.0,1.1,1.2\nhost:/\nlogin:guest\npasscode:guest\nheart-beat:1000,1000\n\n\0",
        b"STOMP\naccept-version:1.2\nhost:localhost\n\n\0",
        b"SEND\ndestination:/queue/a\npersistent:true\nreceipt:1\ncontent-type:text/plain\ncontent-length:5\n\nhello\0",
        b"SEND\ndestination:/topic/a.b\nx-custom:a\\cb\\nc\\\\d\n\nbody\0\n\n",
        b"SUBSCRIBE\ndestination:/exchange/amq.topic/a.*\nid:0\nack:client-individual\nprefetch-count:10\n\n\0",
        b"ACK\nid:abc\ntransaction:tx1\n\n\0NACK\nid:abd\n\n\0",
        b"BEGIN\ntransaction:tx1\n\n\0COMMIT\ntransaction:tx1\n\n\0ABORT\ntransaction:tx2\n\n\0",
        b"UNSUBSCRIBE\nid:0\n\n\0DISCONNECT\nreceipt:77\n\n\0",
        b"\r\n\n\nSEND\r\ndestination:/amq/queue/q\r\n\r\nx\0",
    ]
    for s in seeds:
        for cfg in (b"\x02\x80", b"\x82\x40", b"\x01\x20", b"\x00\xff"):
            write("stomp_decode", cfg + s)


# ---------------------------------------------------------------- MQTT 3.1.1

def remaining(n):
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        if n:
            b |= 0x80
        out.append(b)
        if not n:
            return bytes(out)


def mstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(b)) + b


def packet(first, body):
    return bytes([first]) + remaining(len(body)) + body


def mqtt_seeds():
    connect_min = packet(0x10, mstr("MQTT") + b"\x04\x02" + struct.pack(">H", 60) + mstr("c1"))
    # will (QoS 1, retained), user name and password
    flags = 0x80 | 0x40 | 0x20 | 0x08 | 0x04 | 0x02
    connect_full = packet(0x10, mstr("MQTT") + b"\x04" + bytes([flags]) + struct.pack(">H", 30)
                          + mstr("client-2") + mstr("will/t") + mstr(b"bye") + mstr("guest") + mstr(b"guest"))
    connect_31 = packet(0x10, mstr("MQIsdp") + b"\x03\x02" + struct.pack(">H", 10) + mstr("old"))
    seeds = [
        connect_min, connect_full, connect_31,
        packet(0x20, b"\x00\x00"),                                   # CONNACK
        packet(0x30, mstr("a/b") + b"qos0"),                         # PUBLISH QoS 0
        packet(0x32, mstr("a/b") + struct.pack(">H", 1) + b"qos1"),  # QoS 1
        packet(0x3D, mstr("a/b/c") + struct.pack(">H", 2) + b"q2"),  # QoS 2, dup, retain
        packet(0x40, struct.pack(">H", 1)),                          # PUBACK
        packet(0x50, struct.pack(">H", 2)),                          # PUBREC
        packet(0x62, struct.pack(">H", 2)),                          # PUBREL
        packet(0x70, struct.pack(">H", 2)),                          # PUBCOMP
        packet(0x82, struct.pack(">H", 3) + mstr("a/+/#") + b"\x01" + mstr("x") + b"\x00"),
        packet(0x90, struct.pack(">H", 3) + b"\x01\x80"),            # SUBACK
        packet(0xA2, struct.pack(">H", 4) + mstr("a/+/#")),          # UNSUBSCRIBE
        packet(0xB0, struct.pack(">H", 4)),                          # UNSUBACK
        b"\xc0\x00", b"\xd0\x00", b"\xe0\x00",                       # PINGREQ PINGRESP DISCONNECT
        packet(0x30, mstr("big") + b"x" * 300),                      # two-byte remaining length
    ]
    seeds.append(connect_min + b"".join(seeds[4:12]) + b"\xc0\x00\xe0\x00")
    for s in seeds:
        for cfg in (b"\x00\x80", b"\x01\x10"):
            write("mqtt_decode", cfg + s)


# ---------------------------------------------------------------- commitlog records

def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


MAGIC_MESSAGE = struct.unpack("<I", b"TRM1")[0]
MAGIC_ACK = struct.unpack("<I", b"TRA1")[0]
MAGIC_END = struct.unpack("<I", b"TRE0")[0]


def seal(magic, payload):
    return struct.pack("<III", 12 + len(payload), magic, crc32c(payload)) + payload


def message(queues, keys, props, body, flags=1):
    p = struct.pack("<HQQQ", flags, 1_700_000_000_000, 1_700_000_000_001, 0xABCDEF)
    p += struct.pack("<H", len(queues))
    for q, off in queues:
        p += struct.pack("<IQ", q, off)
    p += struct.pack("<H", len(keys))
    for k in keys:
        p += struct.pack("<H", len(k)) + k
    p += struct.pack("<I", len(props)) + props + struct.pack("<I", len(body)) + body
    return seal(MAGIC_MESSAGE, p)


def ack(queue, ranges):
    p = struct.pack("<HQII", 0, 1_700_000_000_002, queue, len(ranges))
    for s, e in ranges:
        p += struct.pack("<QQ", s, e)
    return seal(MAGIC_ACK, p)


def store_seeds():
    recs = [
        message([(1, 0)], [], b"", b"hello"),
        message([(1, 5), (2, 9), (7, 100)], [b"msg-id-1", b"key"], b"\x01\x02props", b"body" * 20),
        message([(3, 1)], [b"k" * 40], b"", b"", flags=0),
        ack(1, [(0, 5)]),
        ack(2, [(0, 1), (3, 9), (10, 11)]),
        struct.pack("<II", 64, MAGIC_END) + b"\x00" * 56,  # padding to the segment end
        b"\x00" * 32,                                       # never written
    ]
    torn = message([(1, 0)], [], b"", b"torn tail")
    recs.append(torn[:-4] + b"\x00" * 4)
    for r in recs:
        write("store_record", b"\x00" + r)
        write("store_record", b"\x03" + r)
        write("store_record", b"\x00" + r + recs[0])


# ---------------------------------------------------------------- replication
def repl(kind, payload):
    return struct.pack(">IB", len(payload) + 1, kind) + payload


def rstr(s):
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def replication_seeds():
    frames = [
        repl(1, b"TRPL" + struct.pack(">H", 1) + rstr("f1") + struct.pack(">QQQQ", 0, 4096, 77, 4 << 20)),
        repl(2, rstr("leader") + struct.pack(">Q", 3)),
        repl(3, rstr("segment size differs")),
        repl(4, struct.pack(">Q", 4096) + b"raw commitlog bytes"),
        repl(5, struct.pack(">Q", 9) + b"journal record bytes"),
        repl(6, struct.pack(">QQQ", 10, 0, 3) + b"xyz"),
        repl(7, struct.pack(">QQ", 1 << 20, 310)),
        repl(8, struct.pack(">QQ", 1 << 20, 310)),
    ]
    stream = b"".join(frames)
    for cfg in (b"\x00\x80", b"\x01\x40"):
        write("replication_decode", cfg + stream)
        for f in frames:
            write("replication_decode", cfg + f)
    # structured: kind byte, then fields
    for kind in range(8):
        write("replication_decode", bytes([0x80, 0x7F, kind]) + bytes(range(1, 60)))


if __name__ == "__main__":
    amqp_seeds()
    stomp_seeds()
    mqtt_seeds()
    store_seeds()
    replication_seeds()
    for t in sorted(os.listdir(OUT)):
        print(t, len(os.listdir(os.path.join(OUT, t))), "seeds")
