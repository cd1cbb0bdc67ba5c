"""A tiny OpenEnv environment (openenv-core 0.3.0's server API): the observation asks for the
seed's digit twice; each step scores the reply, 0.25 then 1.0 for the digit, and the second
ends the episode. `app` is what `uvicorn openenv_digit:app` serves."""

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class DigitAction(Action):
    message: str


class DigitObservation(Observation):
    prompt: str = ""


class DigitEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

    def reset(self, seed=None, episode_id=None, **kwargs) -> DigitObservation:
        self.digit, self.turn = str((seed or 0) % 10), 0
        return DigitObservation(prompt=f"digit {self.digit}")

    def step(self, action: DigitAction, timeout_s=None, **kwargs) -> DigitObservation:
        self.turn += 1
        right = action.message.strip() == self.digit
        if self.turn == 1:
            return DigitObservation(prompt="again", reward=0.25 * right, done=False)
        return DigitObservation(prompt="", reward=1.0 * right, done=True)

    @property
    def state(self) -> State:
        return State(step_count=self.turn)


app = create_app(DigitEnv, DigitAction, DigitObservation, max_concurrent_envs=16)
