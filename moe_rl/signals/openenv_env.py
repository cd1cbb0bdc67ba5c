"""`rollout.environment: {kind: openenv, name: <url | app module>, options}`: an OpenEnv
environment through its client API, its step rewards as the episode's reward.

- The server: `name` is its URL (`http://host:port`, running already), or the module of its
  FastAPI app (`package.server.app`, the `app` that OpenEnv's `create_app` makes: imported
  first, so that a failing import is reported as such), which the adapter starts with uvicorn
  on a free local port (`moe_rl.engine.process.EngineProcess`: wait for `/health`, stopped when
  the process exits) in each process that uses it.
- Prompts: for the k-th group (k counts from the seed), the observation of a stateless
  `POST /reset {seed: k, **options.reset}`, its `options.observation_key` field (default
  "prompt") as one user message. The prompt's answer is k.
- Episodes (the adapter's agent, `Task.agent`): each opens its own session
  (`GenericEnvClient`, a WebSocket), resets with seed k, and plays turns: the model's reply
  (`Episode.generate`, token-in-token-out) goes in the action's `options.action_key` field
  (default "message"), the observation after a step is the next user message, until the
  environment says done. The reward is the sum of the step rewards (a step without one counts
  0). A limit (`rollout.episode.max_turns`, `max_context_tokens`) ends it with the rewards so far.
- The environment scores inside its server, so its errors (a failed step, a lost connection)
  fail the episode: its group is dropped, counted `agents/dropped_agent_error`.
"""

from __future__ import annotations

import atexit
import itertools
import json
import sys
import urllib.request
from typing import Any, Iterator

from openenv.core.generic_client import GenericEnvClient

from moe_rl.agents import Episode, EpisodeLimit
from moe_rl.engine.process import EngineProcess, free_port
from moe_rl.sample import Sample
from moe_rl.tasks import Prompt, Task
from moe_rl.tasks.registry import import_object

OPTIONS = {"observation_key": "prompt", "action_key": "message", "reset": {}, "start_timeout_s": 120.0}


class OpenEnvTask(Task):
    name = "openenv"

    def __init__(self, name: str, options: dict[str, Any]):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"options has {unknown[0]!r}; openenv takes {sorted(OPTIONS)}")
        options = {**OPTIONS, **options}
        self.observation_key, self.action_key = options["observation_key"], options["action_key"]
        self.reset_options = dict(options["reset"])
        if name.startswith(("http://", "https://")):
            self.url = name.rstrip("/")
        else:
            import_object(f"{name}:app", "name", "the FastAPI app of an OpenEnv server (create_app)")
            port = free_port()
            command = [sys.executable, "-m", "uvicorn", f"{name}:app", "--host", "127.0.0.1", "--port", str(port)]
            try:
                server = EngineProcess(command, "127.0.0.1", port).wait_healthy(options["start_timeout_s"])
            except RuntimeError as error:
                log = " | ".join(line.strip() for line in str(error).splitlines()[-3:] if line.strip())
                raise ValueError(f"name={name!r}: the OpenEnv server did not start ({log})") from None
            atexit.register(server.stop)
            self.url = server.url
        self.agent = self.play

    def prompts(self, seed: int) -> Iterator[Prompt]:
        for k in itertools.count(seed):
            request = urllib.request.Request(
                f"{self.url}/reset",
                data=json.dumps({"seed": k, **self.reset_options}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                observation = json.load(response)["observation"]
            yield Prompt(messages=[self.user_message(observation)], answer=k)

    def user_message(self, observation: dict) -> dict:
        if self.observation_key not in observation:
            raise ValueError(
                f"the OpenEnv observation has no {self.observation_key!r} (its keys: {sorted(observation)}): "
                "set rollout.environment.options.observation_key"
            )
        return {"role": "user", "content": str(observation[self.observation_key])}

    async def play(self, episode: Episode) -> float:
        total = 0.0
        async with GenericEnvClient(base_url=self.url) as client:
            result = await client.reset(seed=episode.answer, **self.reset_options)
            conversation = [self.user_message(result.observation)]
            while True:
                try:
                    turn = await episode.generate(conversation)
                except EpisodeLimit:
                    return total
                result = await client.step({self.action_key: turn.content})
                total += float(result.reward or 0.0)
                if result.done:
                    return total
                conversation += [turn.message(), self.user_message(result.observation)]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError("OpenEnv environments run episodes")

    def reward(self, response: str, answer: Any, sample: Sample) -> float:
        raise NotImplementedError("an OpenEnv environment's reward comes from its steps (OpenEnvTask.play)")


def make_task(name: str, options: dict[str, Any], tokenizer_dir: str | None) -> OpenEnvTask:
    return OpenEnvTask(name, options)
