"""A completion request with several prompts (OpenAI's ``prompt: [...]``): one ``Generation`` per
prompt, each routed on its own, read as one stream.

Events are renumbered on the way: sequence j of prompt i becomes index ``i * num_sequences + j``,
the order OpenAI gives the choices. The first failure ends the whole request (the other prompts
are aborted on their nodes), as a single prompt's failure would.
"""

from __future__ import annotations

import asyncio

import msgspec

from pdserve.messages import TokenEvent
from pdserve.proxy.dispatch import Generation
from pdserve.proxy.protocol import ProxyError

_DONE = object()


class GenerationBatch:
    """Several prompts' generations with ``Generation``'s reading interface (``next``, ``cancel``)."""

    def __init__(self, request_id: str, generations: list[Generation], num_sequences: int) -> None:
        self.request_id = request_id
        self.generations = generations
        self.num_sequences = num_sequences
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_running = len(generations)
        self._pumps = [asyncio.ensure_future(self._pump(i, g)) for i, g in enumerate(generations)]

    async def _pump(self, prompt: int, gen: Generation) -> None:
        offset = prompt * self.num_sequences
        try:
            while (event := await gen.next()) is not None:
                if offset:
                    event = msgspec.structs.replace(event, index=event.index + offset)
                self._queue.put_nowait(event)
        except ProxyError as exc:
            self._queue.put_nowait(exc)
            return
        self._queue.put_nowait(_DONE)

    async def next(self) -> TokenEvent | None:
        """The next event of any prompt; None after every prompt's last; raises the first failure."""
        while self._num_running:
            item = await self._queue.get()
            if item is _DONE:
                self._num_running -= 1
                continue
            if isinstance(item, ProxyError):
                self.cancel()
                raise item
            return item
        return None

    def cancel(self) -> None:
        """Stop every prompt's generation (those still running are aborted on their nodes)."""
        for gen in self.generations:
            gen.cancel()
        for pump in self._pumps:
            pump.cancel()
