"""A tiny verifiers taskset (verifiers 0.4.0's layout, as `vf init` writes it): each task asks
for one digit; its reward reads the trace's last reply. `rollout.environment: {kind: verifiers,
name: tests.signals.vf_digit}` loads it as the hub's loader does (by module, `__all__`)."""

import verifiers.v1 as vf


class DigitData(vf.TaskData):
    digit: str


class DigitTask(vf.Task[DigitData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.digit)

    @vf.reward(weight=0.5)
    async def contains(self, trace: vf.Trace) -> float:
        return float(self.data.digit in trace.last_reply)


class DigitConfig(vf.TasksetConfig):
    num_tasks: int = 4
    first: int = 0


class DigitTaskset(vf.Taskset[DigitTask, DigitConfig]):
    def load(self) -> list[DigitTask]:
        digits = [str((self.config.first + i) % 10) for i in range(self.config.num_tasks)]
        return [
            DigitTask(DigitData(prompt=f"digit {d}", system_prompt="Write the digit.", digit=d), self.config.task)
            for d in digits
        ]


__all__ = ["DigitTaskset"]
