"""A verifiers taskset with a tool server (verifiers 0.4.0's layout): each task asks for the value
of one key of a table that only the taskset's `lookup` tool knows (an MCP toolset, shared by the
taskset's tasks); its rewards read the trace: the value in the last reply, and a `lookup` call."""

import verifiers.v1 as vf
from vf_lookup_tools import TABLE, LookupToolset


class LookupData(vf.TaskData):
    key: str


class LookupTask(vf.Task[LookupData]):
    @vf.reward(weight=1.0)
    async def value(self, trace: vf.Trace) -> float:
        return float(TABLE[self.data.key] in trace.last_reply)

    @vf.reward(weight=0.5)
    async def looked_up(self, trace: vf.Trace) -> float:
        return float(any(call.name == "lookup" for m in trace.assistant_messages for call in m.tool_calls or []))


class LookupConfig(vf.TasksetConfig):
    num_tasks: int = 4
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self) -> list[LookupTask]:
        keys = sorted(TABLE)[: self.config.num_tasks]
        return [
            LookupTask(
                LookupData(prompt=f"value of {k}?", system_prompt="Use the lookup tool.", key=k), self.config.task
            )
            for k in keys
        ]

    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]


__all__ = ["LookupTaskset"]
