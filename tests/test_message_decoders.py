"""``pdserve.messages.decode`` from many threads at once, each message type's first decode included.

msgspec 0.22 (with the GIL) caches a Struct's type info on the class before it fills in its
fields' types, and filling them runs Python code: a second thread making a decoder of the same
Struct meanwhile got the half-built info and segfaulted in ``mpack_decode``. That took down a
prefill node's engine core in CI (its KV peer threads decode their first replies together). The
script below, with ``msgspec.msgpack.Decoder`` in place of ``decode``, segfaulted 4 runs in 4 here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

RACE = textwrap.dedent(
    """
    import sys, threading
    import msgspec
    from pdserve.messages import decode

    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible
    for i in range(150):
        # Types no decoder has seen: each round's first decodes build their type info.
        ns = {"msgspec": msgspec}
        exec(
            "class Inner(msgspec.Struct, tag=True):\\n"
            "    a: int\\n    b: str\\n    c: list[int]\\n    d: dict[str, float]\\n"
            "class Mid(msgspec.Struct, tag=True):\\n"
            "    x: Inner\\n    y: list[Inner]\\n    z: Inner | None = None\\n"
            "class Outer(msgspec.Struct, tag=True):\\n"
            "    m: Mid\\n    n: list[Mid]\\n    o: Inner\\n",
            ns,
        )
        inner = ns["Inner"](1, "s", [1, 2], {"k": 1.0})
        mid = ns["Mid"](inner, [inner, inner], inner)
        outer = ns["Outer"](mid, [mid], inner)
        data = msgspec.msgpack.encode(outer)
        barrier = threading.Barrier(8)
        results = []

        def work():
            barrier.wait()
            results.append(decode(data, ns["Outer"]) == outer)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 8, results
    print("ok")
    """
)


def test_first_decodes_of_a_type_in_many_threads_at_once():
    proc = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])
