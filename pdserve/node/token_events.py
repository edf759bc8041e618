"""A request's cumulative engine outputs as the ``TokenEvent`` deltas a node streams.

The engine hands out cumulative outputs (all tokens and text so far); the engine core turns each
into what changed since the last one it sent to the node process (``CoreState._emit``), so only
deltas cross the process boundary.
A parallel-sampling request's output holds every sequence (``CompletionOutput.index``): each
sequence that moved gets an event of its own. Text that could still turn out to be part of a stop
string is held back (``hold`` characters) until the sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.logprobs import TokenLogprobs
from pdserve.messages import LogprobsMsg, TokenEvent


def logprobs_msgs(entries: Sequence[TokenLogprobs | None]) -> list[LogprobsMsg | None]:
    return [None if lp is None else LogprobsMsg.from_logprobs(lp) for lp in entries]


class TokenEvents:
    """What was sent of one request, per sequence; ``events(out)`` gives the next deltas."""

    def __init__(self, hold: int = 0) -> None:
        self.hold = hold
        self.sent_tokens: dict[int, int] = {}
        self.sent_text: dict[int, int] = {}
        self.finished: set[int] = set()
        self.prompt_logprobs_sent = False

    def events(self, out: RequestOutput) -> list[TokenEvent]:
        """The events for ``out``: one per sequence with new tokens or text, or that finished (a
        final output ends every sequence that had not ended yet)."""
        events = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            event = self._event(out, c)
            if event.token_ids or event.text or event.finish_reason is not None:
                events.append(event)
        if out.prompt_logprobs is not None and events and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            events[0] = msgspec.structs.replace(events[0], prompt_logprobs=logprobs_msgs(out.prompt_logprobs))
        return events

    def _event(self, out: RequestOutput, c: CompletionOutput) -> TokenEvent:
        j = c.index
        sent_tokens = self.sent_tokens.get(j, 0)
        sent_text = self.sent_text.get(j, 0)
        finished = c.finish_reason is not None
        visible = len(c.text) if finished else max(sent_text, len(c.text) - self.hold)
        logprobs = None
        if c.logprobs is not None:
            logprobs = [LogprobsMsg.from_logprobs(lp) for lp in c.logprobs[sent_tokens:] if lp is not None]
        error = c.stop_reason if c.finish_reason == "error" and isinstance(c.stop_reason, str) else ""
        self.sent_tokens[j] = len(c.token_ids)
        self.sent_text[j] = visible
        if finished:
            self.finished.add(j)
        return TokenEvent(
            request_id=out.request_id,
            token_ids=c.token_ids[sent_tokens:],
            text=c.text[sent_text:visible],
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=None if error else c.stop_reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            error=error,
            index=j,
        )
