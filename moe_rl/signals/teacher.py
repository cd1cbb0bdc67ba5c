"""`Teacher`: a served teacher's logprobs of the student's own tokens (on-policy distillation).

For each sample of a finished group, the teacher of the sample's task (`metadata["task"]`, set by
task mixtures; the default teacher otherwise) scores prompt + response as they are: a prefill-only
`/generate` of the exact ids (`EngineClient.score`), the route the consistency probe uses. The
response's entries become `Sample.teacher_logprobs`; the advantage is formed from them at batch
time (`moe_rl.algorithms.advantages.token_advantages`). A group's samples are scored at once, and
each group waits only for its own calls, beside the generation of the others (the rollout manager
runs `score_group` next to the group's rewards). A teacher that does not answer raises (after the
client's retries): a run without its signal would train on something else.

The teacher must share the student's vocabulary (`check_vocabulary`, run by the preflight before
anything starts).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

from moe_rl.algorithms.config import ServedConfig
from moe_rl.engine.client import EngineClient
from moe_rl.sample import Sample

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_vocabulary(student, served: ServedConfig, field: str) -> None:
    """Refuse (ValueError naming `field`) a teacher whose vocabulary is not the student's
    (`student`: the run's `ModelConfig`): where both have tokenizer files, the token -> id maps must
    be equal; otherwise (models without them, like the demo's) the vocabulary sizes. A `url` teacher
    is asked its /model_info; one that does not say its vocab_size (SGLang) is not checked."""
    vocab = student.load_hf_config().get_text_config().vocab_size
    if served.url is not None:
        try:
            with urllib.request.urlopen(served.url.rstrip("/") + "/model_info", timeout=10) as response:
                theirs = json.loads(response.read()).get("vocab_size")
        except (OSError, ValueError) as error:
            raise ValueError(
                f"{field}.url={served.url!r}: /model_info does not answer ({error}); start it first"
            ) from None
        if theirs is not None and int(theirs) != vocab:
            raise ValueError(f"{field}.url={served.url!r} serves vocab_size {theirs}, the student {vocab}: {SAME}")
        return
    from transformers import AutoConfig, AutoTokenizer  # heavy: only where a teacher is configured

    teacher_dir, student_dir = Path(served.path), student.tokenizer_dir
    if student_dir and any((Path(student_dir) / f).is_file() for f in TOKENIZER_FILES):
        if any((teacher_dir / f).is_file() for f in TOKENIZER_FILES):
            ours, theirs = (AutoTokenizer.from_pretrained(str(d)).get_vocab() for d in (student_dir, teacher_dir))
            if ours != theirs:
                differ = len(set(ours.items()) ^ set(theirs.items()))
                raise ValueError(
                    f"{field}.path={served.path!r}: its tokenizer maps {differ} token/id pairs differently "
                    f"from the student's ({student_dir}): {SAME}"
                )
            return
    theirs = AutoConfig.from_pretrained(served.path).get_text_config().vocab_size
    if theirs != vocab:
        raise ValueError(f"{field}.path={served.path!r} has vocab_size {theirs}, the student {vocab}: {SAME}")


SAME = "a teacher scores the student's token ids, so it must share the student's vocabulary"


class Teacher:
    def __init__(self, urls: dict[str | None, str], kind: str = "embedded"):
        """`urls`: each teacher's server by task name, None for the default one; `kind`: the
        servers' engine kind (both answer the scoring route alike)."""
        self.clients = {
            task: EngineClient(url, kind=kind, name=f"teacher {task or ''}".strip()) for task, url in urls.items()
        }

    def client_for(self, sample: Sample) -> EngineClient:
        task = sample.metadata.get("task")
        client = self.clients.get(task) or self.clients.get(None)
        if client is None:
            raise ValueError(
                f"algorithm.distill: no teacher for task {task!r} (teachers: {sorted(map(str, self.clients))}): "
                "add it to algorithm.distill.teachers or set algorithm.distill.teacher"
            )
        return client

    async def score_group(self, samples: list[Sample]) -> None:
        """Set every sample's `teacher_logprobs`, and `metadata["teacher_s"]`: the seconds the group
        waited for them (`time/teacher_s` sums a batch's groups)."""
        start = time.perf_counter()
        await asyncio.gather(*(self._score(sample) for sample in samples))
        for sample in samples:
            sample.metadata["teacher_s"] = time.perf_counter() - start

    async def _score(self, sample: Sample) -> None:
        if not sample.response_ids:
            sample.teacher_logprobs = []
            return
        ids = sample.prompt_ids + sample.response_ids
        scored = await self.client_for(sample).score(ids, return_routed_experts=False)
        # logprobs[t - 1] = log p(ids[t] | ids[:t]): the response starts at t = len(prompt)
        sample.teacher_logprobs = scored.logprobs[len(sample.prompt_ids) - 1 :]

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients.values()))
