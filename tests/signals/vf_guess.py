"""A verifiers game (verifiers 0.4.0's layout: an `Env` of its own with one agent seat, as its
TextArena taskset has): the player guesses a digit, the env answers a wrong guess with "no" until
the guess is right or three are spent, and its `run()` records the reward."""

import verifiers.v1 as vf

GUESSES = 3


class GuessData(vf.TaskData):
    secret: str


class GuessTask(vf.Task[GuessData]):
    pass


class GuessConfig(vf.TasksetConfig):
    secrets: str = "789"


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        return [GuessTask(GuessData(prompt="guess a digit", secret=s), self.config.task) for s in self.config.secrets]


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment, guesses = await interaction.turn(), 1
            while not segment.terminated and segment.last_reply != task.data.secret and guesses < GUESSES:
                segment, guesses = await interaction.turn("no"), guesses + 1
        found = not segment.terminated and segment.last_reply == task.data.secret
        interaction.trace.record_reward("found", float(found), 1.0)


__all__ = ["GuessTaskset", "GuessEnv"]
