"""KV transfer throughput between two processes: pdserve's zmq backend against a raw TCP socket.

The receiver process holds a real KV cache (the default model's shape unless told
otherwise) and a reservation for the blocks; the sender process pushes the same number
of bytes as real blocks through ``ZmqSender`` and, as the anchor measured in the same
run, through one plain TCP connection into a preallocated buffer (``recv_into``).

``python -m pdserve.benchmarks.kv_transfer --sizes-mib 64,256``
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import platform
import socket
import sys
import time

import torch

from pdserve.config import cpu_count

# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64, float32, blocks of 16 tokens.
LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _bytes_per_block(dtype: torch.dtype) -> int:
    return LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * dtype.itemsize


def _info(node_id: str, dtype: torch.dtype):
    from pdserve.messages import NodeInfo

    return NodeInfo(
        node_id,
        "decode",
        "bench",
        str(dtype),
        BLOCK,
        LAYERS,
        HEADS,
        HEAD_DIM,
        "L,NB,2,BS,Hkv,D",
        "zmq",
        "",
        4096,
        1,
    )


def _receiver(conn, num_blocks: int, dtype: torch.dtype) -> None:
    from kv_transfer import ReservationTable
    from kv_transfer.zmq_backend import ZmqReceiver

    torch.set_num_threads(1)
    kv = torch.zeros(LAYERS, num_blocks, 2, BLOCK, HEADS, HEAD_DIM, dtype=dtype)
    table = ReservationTable(LAYERS)
    receiver = ZmqReceiver()
    receiver.register_kv_cache(kv)
    address = receiver.start(_info("bench-decode", dtype), table, lambda commit: None)
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(1)
    conn.send((address, raw.getsockname()[1]))
    buf = bytearray(num_blocks * _bytes_per_block(dtype))
    view = memoryview(buf)
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        kind, rid, n = cmd
        if kind == "reserve":
            table.add(rid, list(range(n)), time.time() + 60)
            conn.send("ok")
        elif kind == "raw":
            c, _ = raw.accept()
            got = 0
            while got < n:
                k = c.recv_into(view[got:n])
                if k == 0:
                    break
                got += k
            c.sendall(b"k")
            c.close()
            conn.send(got)
    receiver.close()


def run(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    block_bytes = _bytes_per_block(dtype)
    max_blocks = max(-(-s * (1 << 20) // block_bytes) for s in sizes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, max_blocks, dtype), daemon=True)
    proc.start()
    address, raw_port = parent.recv()

    from kv_transfer.zmq_backend import ZmqSender
    from pdserve.messages import KVCommit

    torch.set_num_threads(1)
    src = torch.randn(LAYERS, max_blocks, 2, BLOCK, HEADS, HEAD_DIM).to(dtype)
    sender = ZmqSender()
    sender.register_kv_cache(src)
    sender.handshake(address, _info("bench-prefill", dtype), 10)
    rows = []
    for size in sizes:
        n = -(-size * (1 << 20) // block_bytes)
        nbytes = n * block_bytes
        zmq_times, raw_times = [], []
        for i in range(args.repeats + 1):
            rid = f"r{size}-{i}"
            parent.send(("reserve", rid, n))
            parent.recv()
            t = time.perf_counter()
            ack = sender.send(
                address,
                _info("bench-prefill", dtype),
                rid,
                list(range(n)),
                list(range(n)),
                KVCommit(rid, 0),
                60,
            ).result()
            zmq_times.append(time.perf_counter() - t)
            assert ack.ok, ack.error
            payload = memoryview(src.view(torch.uint8).numpy().reshape(-1))[:nbytes]
            parent.send(("raw", rid, nbytes))
            t = time.perf_counter()
            with socket.create_connection(("127.0.0.1", raw_port)) as s:
                s.sendall(payload)
                s.recv(1)
            raw_times.append(time.perf_counter() - t)
            assert parent.recv() == nbytes
        zmq_s = sorted(zmq_times[1:])[len(zmq_times[1:]) // 2]
        raw_s = sorted(raw_times[1:])[len(raw_times[1:]) // 2]
        row = {
            "mib": size,
            "blocks": n,
            "bytes": nbytes,
            "zmq_gb_s": nbytes / zmq_s / 1e9,
            "raw_tcp_gb_s": nbytes / raw_s / 1e9,
            "ratio_zmq_to_raw": raw_s / zmq_s,
        }
        rows.append(row)
        print(
            f"{size:5d} MiB ({n} blocks): zmq {row['zmq_gb_s']:.2f} GB/s, "
            f"raw TCP {row['raw_tcp_gb_s']:.2f} GB/s, ratio {row['ratio_zmq_to_raw']:.2f}",
            flush=True,
        )
    parent.send(None)
    proc.join(timeout=10)
    sender.close()
    result = {
        "benchmark": "kv_transfer_zmq",
        "device": f"cpu: {platform.processor() or platform.machine()}, {cpu_count()} cores, loopback TCP",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "pdserve.benchmarks.kv_transfer", *sys.argv[1:]]),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyzmq": __import__("zmq").__version__,
        },
        "kv_shape": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK,
            "dtype": args.dtype,
            "bytes_per_block": block_bytes,
        },
        "what": "time from ZmqSender.send (includes staging the blocks out of the cache) to the decode "
        "side's ack after writing every block into its cache; raw TCP = one socket, sendall into recv_into",
        "repeats": args.repeats,
        "results": rows,
    }
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.output}")
    return result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="64,256")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default="docs/benchmarks/kv_transfer_zmq_cpu.json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
