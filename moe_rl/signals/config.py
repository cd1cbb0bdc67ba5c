"""`JudgeConfig` (`rollout.judge`), apart from the code that serves and calls the judge
(`moe_rl.signals.judge`), so the run config imports no engine code. The judge is a served model
as a distillation teacher is (`moe_rl.algorithms.config.ServedConfig`)."""

from __future__ import annotations

import dataclasses
import re

from moe_rl.algorithms.config import ServedConfig

JUDGE_KINDS = ("generative", "discriminative")


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
        if self.kind not in JUDGE_KINDS:
            raise ValueError(f"rollout.judge.kind={self.kind!r}: use one of {JUDGE_KINDS}")
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
