"""The ikcode eviction policy: LRU, tail-first, with shared roots protected and sessions held.

Three segments of evictable blocks, each in LRU order (tail of a sequence first):
  probation  blocks of a session's first step not shared by anyone else yet: the first to go.
             Most of a brand-new conversation's blocks are never asked for again; they should
             not push out blocks that have already proven useful.
  protected  blocks hit by >= protect_after distinct sharers (sessions, else sequences): the
             system prompt and tool definitions every session shares; and every block of a
             session's step from its second step on (a returning session). Capped at
             protected_fraction of the device; past the cap its LRU blocks fall back to
             probation (a segmented LRU), so new sessions always keep a window.
  held       blocks of a session whose last step ended in a tool call, released with hold_s:
             kept until their deadline (the next step usually comes within seconds), capped at
             held_fraction of the device; near the cap a sequence's head is held before its
             tail (a hit starts at the first block). An expired hold goes back to the segment
             it would have had (a shared root to protected), at that segment's LRU end.
Victims: probation first, then protected, then held (earliest deadline first).

Why returning sessions as a whole: a conversation's next step reads its whole previous prompt
and reply, so the newest tail of a session that keeps coming back is worth as much as its head;
protecting only blocks already hit (per block) splits a conversation into a protected head and
an evicted tail. And a session that came back once is far more likely to come back again than a
brand-new one: most first requests are one-offs (on the Mooncake synthetic trace 18% of
conversations get a second request, 80% of those that did get a third, and so on), while an
agent in its tool loop comes back nearly always. Sessions are known by id (Claude Code sends one);
without ids each sequence is its own sharer and this reduces to the per-block rule.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator


class IkcodePolicy:
    name = "ikcode"

    def __init__(
        self,
        protect_after: int = 2,
        protected_fraction: float = 0.8,
        held_fraction: float = 0.5,
        returning_after: int = 2,
    ):
        self.protect_after = protect_after
        self.returning_after = returning_after  # the step from which a session's blocks are protected
        self.protected_fraction = protected_fraction
        self.held_fraction = held_fraction
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._held: dict[int, float] = {}  # block -> deadline
        self._protected_after_hold: set[int] = set()  # held blocks that return to protected
        # heap of (deadline, push order, block); entries may be stale. The push order breaks ties
        # so that blocks held together still leave tail first.
        self._deadlines: list[tuple[float, int, int]] = []
        self._pushes = 0
        self._sharers: dict[int, int] = {}  # block -> distinct sharers seen (consecutive-distinct)
        self._last_sharer: dict[int, str] = {}
        self._steps: OrderedDict[str, int] = OrderedDict()  # sharer -> steps released (bounded)
        self._steps_cap = 1024
        self._protected_cap = 0
        self._held_cap = 0

    def bind(self, num_device_blocks: int) -> None:
        self._protected_cap = int(num_device_blocks * self.protected_fraction)
        self._held_cap = int(num_device_blocks * self.held_fraction)
        self._steps_cap = max(1024, 4 * num_device_blocks)

    def on_commit(self, block: int, sharer: str) -> None:
        self._sharers[block] = 1
        self._last_sharer[block] = sharer

    def on_hit(self, block: int, sharer: str) -> None:
        if self._last_sharer.get(block) != sharer:
            self._sharers[block] = self._sharers.get(block, 0) + 1
            self._last_sharer[block] = sharer

    def push(
        self, blocks: list[int], now: float, hold_until: float | None, sharer: str = "", step: bool = True
    ) -> None:
        self._expire_holds(now)  # holds that ran out leave the quota before a new one is counted
        # A preempted or aborted sequence gave no reply: it is not one of the session's steps.
        steps = self._count_step(sharer) if step else self._steps.get(sharer, 0)
        returning = steps >= self.returning_after
        room = self._held_cap - len(self._held) if hold_until is not None and hold_until > now else 0
        first_held = len(blocks) - max(0, room)  # blocks come tail first: hold the head-most ones
        for i, b in enumerate(blocks):
            protect = returning or self._sharers.get(b, 0) >= self.protect_after
            if i >= first_held:
                assert hold_until is not None
                self._held[b] = hold_until
                if protect:
                    self._protected_after_hold.add(b)
                self._pushes += 1
                heapq.heappush(self._deadlines, (hold_until, self._pushes, b))
            elif protect:
                self._protected[b] = None
            else:
                self._probation[b] = None
        self._cap_protected()
        if len(self._deadlines) > 2 * len(self._held) + 1024:
            # A block held again, or taken by a hit, leaves its old deadline behind, and only an
            # eviction pops them: on a device with room to spare the heap grew every turn.
            self._deadlines = [(d, n, b) for d, n, b in self._deadlines if self._held.get(b) == d]
            heapq.heapify(self._deadlines)

    def _cap_protected(self) -> None:
        while len(self._protected) > self._protected_cap:
            b, _ = self._protected.popitem(last=False)
            self._probation[b] = None

    def _count_step(self, sharer: str) -> int:
        """This release is the sharer's n-th step; returns n (0 when the sharer is unknown)."""
        if not sharer:
            return 0
        n = self._steps.pop(sharer, 0) + 1
        self._steps[sharer] = n  # most recent last: the least recent session is forgotten first
        if len(self._steps) > self._steps_cap:
            self._steps.popitem(last=False)
        return n

    def remove(self, block: int) -> None:
        if self._probation.pop(block, 0) is None:
            return
        if self._protected.pop(block, 0) is None:
            return
        del self._held[block]  # its heap entry goes stale
        self._protected_after_hold.discard(block)

    def pop_victim(self, now: float) -> int | None:
        self._expire_holds(now)
        if self._probation:
            return self._probation.popitem(last=False)[0]
        if self._protected:
            return self._protected.popitem(last=False)[0]
        while self._deadlines:
            deadline, _, b = heapq.heappop(self._deadlines)
            if self._held.get(b) == deadline:
                del self._held[b]
                self._protected_after_hold.discard(b)
                return b
        return None

    def forget(self, block: int) -> None:
        self._sharers.pop(block, None)
        self._last_sharer.pop(block, None)

    def num_held(self) -> int:
        """Blocks currently held for sessions (expired holds leave at the next push or eviction)."""
        return len(self._held)

    def _expire_holds(self, now: float) -> None:
        expired: list[int] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, b = heapq.heappop(self._deadlines)
            if self._held.get(b) == deadline:
                del self._held[b]
                expired.append(b)
        for b in reversed(expired):  # to their segment's LRU end, earliest deadline first
            segment = self._protected if b in self._protected_after_hold else self._probation
            self._protected_after_hold.discard(b)
            segment[b] = None
            segment.move_to_end(b, last=False)
        if expired:
            self._cap_protected()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected) + len(self._held)

    def __contains__(self, block: object) -> bool:
        return block in self._probation or block in self._protected or block in self._held

    def __iter__(self) -> Iterator[int]:
        yield from self._probation
        yield from self._protected
        yield from self._held
