"""`Judge`: a served model scores the responses (`rollout.reward: judge`, `rollout.judge: {...}`).

- generative (LLM-as-judge): `template` is filled with the sample's `{prompt}`, `{response}` and
  `{answer}` (the task's decoded texts), tokenized with the judge's tokenizer and answered greedily
  (temperature 0, at most `max_new_tokens`) through `/generate`; the first match of the `parse`
  regular expression in the decoded answer (its first group when it has one) is the score;
- discriminative (a reward model with a sequence-classification head): the filled template's ids
  go to SGLang's `/classify` route and its first output is the score. The embedded engine serves
  causal LMs only: a discriminative judge needs SGLang (a `url`, or `path` with engines.kind sglang).
The judge is a served model (`moe_rl.signals.served`: started from `path`, or reached at `url`).
A group's calls go out together; at most `concurrency` are in flight over all groups. A call past
`timeout_s` is counted `rollout/judge_timeouts`, an answer the parser cannot read
`rollout/judge_unparsable`, an engine error `rollout/judge_errors`; each scores `failed_score`.
No judge failure stops the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from pathlib import Path

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.sampling import SamplingParams
from moe_rl.signals.served import ServedConfig

log = logging.getLogger(__name__)
KINDS = ("generative", "discriminative")


@dataclasses.dataclass(kw_only=True)
class JudgeConfig:
    """A served judge (module docstring); `rollout.judge`, with `rollout.reward: judge`."""

    kind: str = "generative"
    """"generative" (a model answers `template`, `parse` reads its score) or "discriminative" (a
    sequence-classification reward model on SGLang's /classify)."""
    path: str | None = None
    """HF directory of the judge: the run starts an engine on it (engines.kind)."""
    url: str | None = None
    """http://host:port of a running judge server instead."""
    tokenizer: str | None = None
    """Directory of the judge's tokenizer; None: `path`'s."""
    template: str = "Question: {prompt}\nAnswer: {response}\nReference: {answer}\nScore (0-1):"
    """What the judge reads, with `{prompt}`, `{response}` and `{answer}` filled in."""
    parse: str = r"-?\d+(?:\.\d+)?"
    """Regular expression: its first match in a generative judge's answer (group 1 if it has groups)
    is the score."""
    max_new_tokens: int = 16
    """A generative judge's answer budget."""
    timeout_s: float = 60.0
    """A call still unanswered after this many seconds scores `failed_score`, counted."""
    concurrency: int = 16
    """Judge calls in flight at once, over all groups."""
    failed_score: float = 0.0
    """The score of a call that timed out, failed or could not be parsed."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rollout.judge.kind={self.kind!r}: use one of {KINDS}")
        self.served.check("rollout.judge")
        if "{response}" not in self.template:
            raise ValueError("rollout.judge.template: put {response} in it (and {prompt}, {answer} where wanted)")
        try:
            re.compile(self.parse)
        except re.error as error:
            raise ValueError(f"rollout.judge.parse={self.parse!r}: not a regular expression ({error})") from None
        if self.tokenizer_dir is None:
            raise ValueError("rollout.judge: a judge given by url needs rollout.judge.tokenizer (a directory)")
        for name in ("max_new_tokens", "concurrency"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"rollout.judge.{name}={getattr(self, name)!r}: must be an integer >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"rollout.judge.timeout_s={self.timeout_s}: must be > 0")

    @property
    def served(self) -> ServedConfig:
        return ServedConfig(path=self.path, url=self.url)

    @property
    def tokenizer_dir(self) -> str | None:
        return self.tokenizer or self.path


class Judge:
    def __init__(self, config: JudgeConfig, url: str, kind: str = "embedded"):
        """`url`: the judge's server (`ServedModel.url()`); `kind`: its engine kind."""
        from transformers import AutoTokenizer  # heavy: only where a judge runs

        self.config = config
        self.client = EngineClient(url, kind=kind, name="judge", timeout_s=config.timeout_s, retries=0)
        self.tokenizer = AutoTokenizer.from_pretrained(str(Path(config.tokenizer_dir)))
        self.pattern = re.compile(config.parse)
        self.timeouts = self.unparsable = self.errors = 0
        self._slots: asyncio.Semaphore | None = None  # made on the rollout's loop

    def prompt_ids(self, prompt: str, response: str, answer) -> list[int]:
        text = self.config.template.format(prompt=prompt, response=response, answer="" if answer is None else answer)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def parse_score(self, answer: str) -> float | None:
        """The score in a generative judge's answer, or None when the parser finds none."""
        match = self.pattern.search(answer)
        if match is None:
            return None
        try:
            return float(match.group(1) if match.groups() else match.group(0))
        except ValueError:
            return None

    async def score_group(self, items: list[tuple[str, str, object]]) -> list[float]:
        """The scores of (prompt, response, answer) texts, in order; never raises."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.concurrency)
        return list(await asyncio.gather(*(self._score(*item) for item in items)))

    async def _score(self, prompt: str, response: str, answer) -> float:
        ids = self.prompt_ids(prompt, response, answer)
        async with self._slots:
            try:
                score = await asyncio.wait_for(self._call(ids), self.config.timeout_s)
            except (TimeoutError, EngineError) as error:
                timed_out = isinstance(error, TimeoutError) or "TimeoutError" in str(error)
                return self._failed("timeouts" if timed_out else "errors", error)
        return self._failed("unparsable", None) if score is None else score

    async def _call(self, ids: list[int]) -> float | None:
        if self.config.kind == "discriminative":
            return await self.client.classify(ids)
        sampling = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=0.0)
        result = await self.client.generate(ids, sampling, return_logprob=False)
        return self.parse_score(self.tokenizer.decode(result.output_ids, skip_special_tokens=True))

    def _failed(self, what: str, error: BaseException | None) -> float:
        setattr(self, what, getattr(self, what) + 1)
        if getattr(self, what) == 1:
            log.warning(
                "judge: a call %s (%r): it scores %s; later ones are counted in rollout/judge_%s",
                {"timeouts": "timed out", "errors": "failed", "unparsable": "gave no score"}[what],
                error,
                self.config.failed_score,
                what,
            )
        return self.config.failed_score

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/judge_timeouts": self.timeouts,
            "rollout/judge_unparsable": self.unparsable,
            "rollout/judge_errors": self.errors,
        }

    async def close(self) -> None:
        await self.client.close()
