"""`EnginePool`: routes generate calls over several engines.

All samples of a group (same prompt, GRPO) go to one engine, so its prefix cache (SGLang's radix
tree) computes the shared prompt once; a group's first request, and any request without a group,
goes to the engine with the fewest requests in flight (ties: the first). The mapping lives until
`release_group`. Control calls (pause, continue, weight updates) go to every engine through the
clients themselves (or `sync`'s sender); the pool only routes generation.
"""

from __future__ import annotations

from moe_rl.engine.client import EngineClient, GenerateResult


class EnginePool:
    def __init__(self, clients: list[EngineClient]):
        if not clients:
            raise ValueError("EnginePool needs at least one EngineClient")
        self.clients = list(clients)
        self.in_flight = [0] * len(clients)
        self._groups: dict[str, int] = {}

    def pick(self, group_id: str | None = None) -> int:
        """Index of the engine for the next request of `group_id` (recorded for the group)."""
        if group_id is not None and group_id in self._groups:
            return self._groups[group_id]
        index = min(range(len(self.clients)), key=lambda i: self.in_flight[i])
        if group_id is not None:
            self._groups[group_id] = index
        return index

    def release_group(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    async def generate(self, input_ids: list[int], *, group_id: str | None = None, **kwargs) -> GenerateResult:
        """`EngineClient.generate` on the engine `pick(group_id)` chose."""
        index = self.pick(group_id)
        self.in_flight[index] += 1
        try:
            return await self.clients[index].generate(input_ids, **kwargs)
        finally:
            self.in_flight[index] -= 1

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
