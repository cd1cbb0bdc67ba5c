"""`Judge`: a served model scores the responses (`rollout.reward: judge`, `rollout.judge: {...}`).

- generative (LLM-as-judge): `template` is filled with the sample's `{prompt}`, `{response}` and
  `{answer}` (the task's decoded texts), tokenized with the judge's tokenizer and answered greedily
  (temperature 0, at most `max_new_tokens`) through `/generate`; the first match of the `parse`
  regular expression in the decoded answer (its first group when it has one) is the score;
- discriminative (a reward model with a sequence-classification head): the filled template's ids
  go to SGLang's `/classify` route and its first output is the score (SGLang `--is-embedding`; the
  embedded engine serves a `*ForSequenceClassification` directory the same way,
  `moe_rl.engine.embedded.classifier`).
The judge is a served model (`moe_rl.signals.served`: started from `path`, or reached at `url`).
A group's calls go out together; at most `concurrency` are in flight over all groups. A call past
`timeout_s` is counted `rollout/judge_timeouts`, an answer the parser cannot read
`rollout/judge_unparsable`, an engine error `rollout/judge_errors`; each scores `failed_score`.
No judge failure stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.sampling import SamplingParams
from moe_rl.signals.config import JudgeConfig

log = logging.getLogger(__name__)


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
