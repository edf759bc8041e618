"""The prefill service's shipments, driven without servers: blocks shipped from launched steps,
the commit after the last one, the engine's pin until the sender released the blocks, a refused
handshake remembered as ``KVHandshakeRefused``."""

from __future__ import annotations

import time
import types
from concurrent.futures import Future

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer import KVHandshakeRefused, KVSendFuture, KVTransferError
from pdserve.messages import LandingDescriptor
from pdserve.prefill_node.server import PrefillService, Shipment, Stage
from pdserve.sampling_params import SamplingParams


class _Sender:
    def __init__(self) -> None:
        self.sends: list[tuple[str, list[int], list[int], object, KVSendFuture]] = []
        self.handshakes: list[str] = []
        self.handshake_error: Exception | None = None

    def send(
        self, address, info, request_id, src, dst, commit, timeout, layer_events=None, written=False
    ) -> KVSendFuture:
        # Chunks follow their forward's layer events; the last send, the first token read back.
        assert written == (commit is not None), (commit, written)
        fut = KVSendFuture()
        self.sends.append((request_id, list(src), list(dst), commit, fut))
        if commit is None:
            fut.set_result(None)
            fut.released.set_result(None)
        return fut

    def close(self) -> None:
        pass

    def handshake(self, address, info, timeout):
        self.handshakes.append(address)
        if self.handshake_error is not None:
            raise self.handshake_error


def _service(engine: LLMEngine | None) -> tuple[PrefillService, list]:
    commands: list = []
    state = types.SimpleNamespace(
        engine=engine,
        loop=types.SimpleNamespace(submit=commands.append),
        info=None,
        node=types.SimpleNamespace(kv_transfer_timeout_s=5.0),
        transfers=[],
    )
    service = PrefillService(state)
    service.sender = _Sender()
    return service, commands


def test_a_chunked_prompt_ships_each_chunk_then_commits_and_is_released_after_the_send():
    config = EngineConfig.from_kwargs(
        model="random:tiny",
        num_kv_blocks=32,
        block_size=16,
        max_model_len=256,
        max_num_batched_tokens=16,
        num_threads=1,
    )
    engine = LLMEngine(config)
    service, commands = _service(engine)
    engine.add_launch_listener(service._ship_launched)
    rid = "p"
    prompt = list(range(5, 45))  # 40 tokens: 3 blocks, prefilled in chunks of 16
    engine.add_request(rid, None, SamplingParams(max_tokens=1), prompt_token_ids=prompt, hold_blocks=True)
    landing = LandingDescriptor(rid, "decode", "tcp://decode", [7, 8, 9], 40, time.time() + 30)
    service.shipments[rid] = shipment = Shipment(rid, landing, stage=Stage.PREFILLING)
    while engine.held_block_ids(rid) is None:
        service.after_step(engine.step())
    src = engine.held_block_ids(rid)
    sends = [(s[1], s[2], s[3] is not None) for s in service.sender.sends]
    assert sends == [([src[0]], [7], False), ([src[1]], [8], False), ([src[2]], [9], False), ([], [], True)]
    assert shipment.stage is Stage.SENDING and shipment.num_blocks_sent == 3
    engine.abort_request([rid])  # the proxy gave up: the pin keeps the blocks for the transport
    assert engine.held_block_ids(rid) == src
    fut = service.sender.sends[-1][4]
    fut.set_result(None)
    (finish,) = commands
    finish(engine)
    assert shipment.stage is Stage.DONE and engine.held_block_ids(rid) == src  # not released yet
    assert [(t.request_id, t.error) for t in service.state.transfers] == [(rid, "")]  # for the node
    fut.released.set_result(None)
    (_, unpin) = commands
    unpin(engine)
    assert engine.held_block_ids(rid) is None
    assert engine.num_free_blocks == 32
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    "error, remembered",
    [
        (KVHandshakeRefused("KV peer tcp://d refused the handshake: dtype mismatch"), True),
        (KVTransferError("no reply from KV peer"), False),
        (KVTransferError("KV peer tcp://d: Connection refused"), False),  # not the peer's answer
    ],
)
def test_a_refused_handshake_is_remembered_other_failures_are_retried(error, remembered):
    service, _ = _service(None)
    service.sender.handshake_error = error
    try:
        for _ in range(2):
            with pytest.raises(KVTransferError) as info:
                service.handshake("tcp://d").result(timeout=5)
            assert isinstance(info.value, KVHandshakeRefused) == remembered and info.value is error
        assert len(service.sender.handshakes) == (1 if remembered else 2)
    finally:
        service.stop()


def test_a_prefill_handshakes_in_its_add_and_one_ended_meanwhile_is_not_added():
    """``AddPrefill`` is one call to the core: the first prompt for a decode node waits in the core
    for the handshake, the next ones are added at once; one closed meanwhile never runs."""
    from pdserve.messages import AddPrefill, PrefillRequest

    config = EngineConfig.from_kwargs(
        model="random:tiny", num_kv_blocks=32, block_size=16, max_model_len=256, num_threads=1
    )
    engine = LLMEngine(config)
    service, commands = _service(engine)
    service.state.check_room = lambda: None
    service.state.track_deadline = lambda rid, deadline: None
    gate = Future()
    service.sender.handshake = lambda address, info, timeout: gate.result(timeout=5)

    def add(rid: str):
        landing = LandingDescriptor(rid, "decode", "tcp://d", [1], 16, time.time() + 30)
        msg = PrefillRequest(rid, list(range(5, 21)), SamplingParams(max_tokens=1), landing)
        return service._add_call(AddPrefill(msg))

    try:
        first, second = add("a"), add("b")
        assert isinstance(first, Future) and not first.done() and not engine.has_request("a")
        service.close("b")  # its handler gave up before the handshake ended
        gate.set_result(None)
        deadline = time.monotonic() + 5
        while len(commands) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        for command in commands:  # the engine loop runs what the handshake's end queued
            command(engine)
        assert first.result(timeout=0) is None and engine.has_request("a") and "a" in service.shipments
        assert second.exception(timeout=0).status == 499
        assert not engine.has_request("b") and "b" not in service.shipments
        assert add("c") is None and engine.has_request("c")  # the handshake is done: added at once
    finally:
        service.stop()
