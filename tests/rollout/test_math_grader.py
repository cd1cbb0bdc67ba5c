"""The `"math"` reward on math-verify: a table of answers graded right and wrong, and a grade
that would hang scoring 0 within its limit while the grader keeps working."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.rollout.scoring import RewardScorer
from moe_rl.sample import Sample
from moe_rl.tasks import get_reward
from moe_rl.tasks import math as math_task
from moe_rl.tasks.math import MathGrader, gold_text, grade, last_boxed, prediction_text

pytestmark = pytest.mark.world  # the grader spawns its child processes (tests/conftest.py)

SAMPLE = Sample(prompt_ids=[1])
SLOW = r"\boxed{9^{9^{9^{9}}}}"  # sympy would compute the power: math-verify's own limit ends it (~3 s)

ROWS = [
    (r"\boxed{12 \text{ cm}}", "12", 1),
    (r"\boxed{12}", r"12 \text{ cm}", 1),
    (r"The area is \boxed{12\text{ cm}^2}.", "12", 1),
    (r"\boxed{\$18.90}", "18.90", 1),
    (r"\boxed{18.9}", r"\$18.90", 1),
    (r"It costs \$18.90 in total.", "18.90", 1),
    (r"\boxed{50\%}", "50", 1),
    (r"\boxed{50}", r"50\%", 1),
    (r"\boxed{x = 5}", "5", 1),
    (r"\boxed{5}", "x = 5", 1),
    (r"\boxed{\{3,1,2\}}", r"\{1,2,3\}", 1),
    (r"\boxed{10^{3}}", "1000", 1),
    (r"\boxed{1+2x}", "2x+1", 1),
    (r"\boxed{\sqrt{3}/2}", r"\frac{\sqrt{3}}{2}", 1),
    (r"\boxed{0.5}", r"\frac12", 1),
    (r"\boxed{\dfrac{1}{2}}", 0.5, 1),
    ("so the answer is 42.", "42", 1),
    ("so the answer is 42.", 42, 1),
    ("x = 3, then 1,234.", "1234", 1),
    (r"\boxed{1,234,567}", "1234567", 1),
    (r"\boxed{1000}", "1,000", 1),
    (r"\boxed{-4}", "-4", 1),
    ("answer: -4", -4, 1),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1),
    (r"\boxed{0.125}", r"\frac{1}{8}", 1),
    (r"\boxed{(1, 2]}", "(1,2]", 1),
    (r"\boxed{[0, \infty)}", r"[0,\infty)", 1),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1),
    (r"\boxed{(3, -1)}", "(3,-1)", 1),
    (r"\boxed{90^\circ}", "90", 1),
    (r"The final answer is $\frac{1}{2}$.", "0.5", 1),
    (r"First \boxed{7}, then on reflection \boxed{8}", "8", 1),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1),
    (r"\boxed{x^{2}}", "x^{2}", 1),
    (r"\boxed{\pi}", r"\pi", 1),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1),
    (r"\boxed{3}", "4", 0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0),
    (r"\boxed{\{1,2,4\}}", r"\{1,2,3\}", 0),
    (r"\boxed{2x-1}", "2x+1", 0),
    ("", "5", 0),
    ("I do not know.", "5", 0),
    (r"\boxed{[1, 2)}", "(1,2]", 0),
    (r"\boxed{3.14}", r"\pi", 0),
    (r"\boxed{-4}", "4", 0),
    (r"First \boxed{8}, then \boxed{7}", "8", 0),
    (r"\boxed{\begin{pmatrix}2\\1\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 0),
    (r"\boxed{1,234}", "1243", 0),
    (r"\boxed{}", "5", 0),
    (r"\boxed{\$18.91}", "18.90", 0),
    (r"\boxed{5\%}", "50", 0),
    (r"\boxed{(1,2)}", "(2,1)", 0),
    (r"\boxed{\frac{1}{2}}", "-0.5", 0),
    (r"The answer is 7 apples.", "8", 0),
]


@pytest.mark.parametrize("response, gold, expected", ROWS)
def test_math_reward_grades_like_a_person(response, gold, expected):
    assert get_reward("math")(response, gold, SAMPLE) == float(expected)


def test_the_prediction_is_the_last_box_with_nested_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{b^{2}}} end") == r"\frac{a}{b^{2}}"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{open") is None
    assert prediction_text(r"so \boxed{\$5}.") == r"$\boxed{5}$"
    assert prediction_text("it is 5") == "it is 5"


def test_a_grade_past_math_verify_limit_is_wrong_and_the_next_one_scores():
    # (no bound on the clock: sympy would compute the power for good, so a grade that comes back
    # at all was cut by a limit; the busy machine of a CI run sets how long that takes)
    assert get_reward("math")(SLOW, "1", SAMPLE) == 0.0
    assert get_reward("math")(r"\boxed{1}", "1", SAMPLE) == 1.0


def test_a_stuck_child_is_killed_at_the_limit_and_a_fresh_one_grades_next():
    grader = MathGrader(timeout_s=1.0, processes=1)
    try:
        assert grader.call(grade, "$5$", "$5$") is True  # the child is up
        child = next(iter(grader._pool._processes.values()))
        with pytest.raises(TimeoutError, match="sleep ran past 1.0 s"):
            grader.call(time.sleep, 600)
        # killed, not done sleeping (600 s); the pool's own thread may reap it (then `join` here
        # can return before that thread has recorded the exit code): wait for the code
        deadline = time.monotonic() + 60
        while child.exitcode is None:
            assert time.monotonic() < deadline, "the stuck child was not killed"
            child.join(0.1)
        assert child.exitcode == -signal.SIGKILL
        assert grader.call(grade, "$\\frac12$", "$0.5$") is True
    finally:
        grader.close()


def test_the_reward_scorer_turns_the_grader_timeout_into_zero(monkeypatch):
    grader = MathGrader(timeout_s=1.0, processes=1)
    monkeypatch.setattr(math_task, "GRADER", grader)
    scorer = RewardScorer(get_reward("math"), timeout_s=30, workers=2)

    async def main():
        await scorer.score(r"\boxed{2}", "2", SAMPLE)  # the child starts
        hung = await scorer.score(SLOW, "1", SAMPLE)
        return hung, await asyncio.gather(*[scorer.score(rf"\boxed{{{k}}}", k, SAMPLE) for k in range(4)])

    try:
        hung, later = asyncio.run(main())
    finally:
        grader.close()
    assert hung == 0.0 and later == [1.0] * 4  # the timeout (counted below), not the scorer's 30 s
    assert scorer.metrics() == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 1}


def test_a_plain_script_without_a_main_guard_grades_and_runs_once(tmp_path):
    """A "spawn" child imports its parent's script: an unguarded one would run again in each child
    and every grade fail. The children start without it: the script runs once, and its grades
    equal math-verify's own, run here in the test's main thread."""
    cases = [(r"so \boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "2"), (r"\boxed{\{3,1,2\}}", r"\{1,2,3\}")]
    runs = tmp_path / "runs.txt"
    script = tmp_path / "grade_unguarded.py"
    script.write_text(
        "from moe_rl.tasks.math import math_reward\n"
        f"with open({str(runs)!r}, 'a') as f: f.write('ran\\n')\n"
        f"print(*[math_reward(response, gold, None) for response, gold in {cases!r}])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = [float(grade(prediction_text(response), gold_text(gold))) for response, gold in cases]
    assert [float(x) for x in done.stdout.split()] == expected == [1.0, 0.0, 1.0]
    assert runs.read_text() == "ran\n"


def test_the_children_end_when_their_parent_is_killed():
    script = (
        "from moe_rl.tasks.math import GRADER, math_reward\n"
        "math_reward('\\\\boxed{1}', '1', None)\n"
        "print(*[p.pid for p in GRADER._pool._processes.values()], flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
    finally:
        parent.kill()
        parent.wait()
    assert len(children) == 2
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)


def alive(pid: int) -> bool:
    """Running (a zombie left for a PID 1 that does not reap is dead too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
