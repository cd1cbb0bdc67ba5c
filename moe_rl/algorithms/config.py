"""`AlgorithmConfig`: every knob of the RL objective (advantages, PPO clip, KL, off-policy fixes).

It is the `algorithm:` section of a run config. Validation happens at construction: every
error is a ValueError naming the field (`algorithm.<name>`) and the fix. The formulas each
option selects are written out in `advantages.py` and `policy_loss.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ESTIMATORS = ("grpo", "dr_grpo", "gspo")
KL_ESTIMATORS = ("k1", "k2", "mse", "k3", "low_var_kl")
OFF_POLICY = ("tis", "icepop", "mis", "none")
DISTILL_MODES = ("pure", "add")


@dataclass(kw_only=True)
class ServedConfig:
    """A model served beside the policy (a distillation teacher here; the judge, `rollout.judge`, is
    one too; `moe_rl.signals.served` starts or reaches it): give exactly one of `path` and `url`."""

    path: str | None = None
    """HF model directory (config.json + safetensors): the run starts an engine on it."""
    url: str | None = None
    """http://host:port of a running engine server (SGLang or `moe-rl serve`); the run only calls it."""

    def check(self, name: str) -> None:
        """Raise ValueError naming the config field `name` (e.g. "algorithm.distill.teacher") when
        the two are not given exactly once, or `path` is no HF directory; its section calls this."""
        if (self.path is None) == (self.url is None):
            raise ValueError(f"{name}: give exactly one of {name}.path (an HF directory) and {name}.url")
        if self.path is not None and not (Path(self.path) / "config.json").is_file():
            raise ValueError(f"{name}.path={self.path!r}: no config.json there; point it at an HF model directory")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"{name}.url={self.url!r}: give http://host:port")


@dataclass(kw_only=True)
class DistillConfig:
    """On-policy distillation: a served teacher scores the student's sampled tokens and the
    per-token reverse KL enters the advantage (`moe_rl.signals.teacher`, `advantages.py`)."""

    teacher: ServedConfig | None = None
    """The teacher, `{path: HF dir}` (started on the run's engine kind) or `{url: ...}`; it must
    share the student's vocabulary (checked before start)."""
    teachers: dict[str, ServedConfig] = field(default_factory=dict)
    """Teachers by task name (a sample's `metadata["task"]`, set by task mixtures); a sample whose
    task is not listed goes to `teacher`."""
    coef: float = 1.0
    """Weight of the reverse-KL term: A_t += coef * (teacher_logprob_t - rollout_logprob_t)."""
    mode: str = "pure"
    """"pure": the reverse-KL term is the whole advantage (the task reward is still computed and
    logged, not trained on); "add": it is added to the task reward's group advantage."""

    def __post_init__(self):
        if self.mode not in DISTILL_MODES:
            raise ValueError(f"algorithm.distill.mode={self.mode!r}: use one of {DISTILL_MODES}")
        if self.teacher is None and not self.teachers:
            raise ValueError("algorithm.distill: set teacher: {path: ...} or {url: ...} (or teachers by task name)")
        if not self.coef > 0:
            raise ValueError(f"algorithm.distill.coef={self.coef}: must be > 0 (e.g. 1.0)")
        for task, served in self.served().items():
            served.check("algorithm.distill.teacher" if task is None else f"algorithm.distill.teachers.{task}")

    def served(self) -> dict[str | None, ServedConfig]:
        """Every teacher by its task name; None keys the default `teacher`."""
        return {**({None: self.teacher} if self.teacher is not None else {}), **self.teachers}


@dataclass(kw_only=True)
class AlgorithmConfig:
    """GRPO-family policy optimisation with an off-policy correction for async rollouts."""

    advantage_estimator: str = "grpo"
    """How advantages and the loss normaliser are formed:
    "grpo": A = (r - mean_group) / (std_group + adv_eps), token-level PPO-clip, loss averaged
    over all loss tokens of the global batch;
    "dr_grpo": A = r - mean_group (no std), token-level PPO-clip, loss summed over tokens and
    divided by the constant `dr_grpo_norm_len` x number of sequences (Dr.GRPO, Liu et al. 2025);
    "gspo": GRPO advantages, sequence-level ratio s = exp(mean_t(logp - old_logp)) clipped per
    sequence, each sequence's token-mean averaged over sequences (GSPO, Zheng et al. 2025)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing (grpo, gspo)."""
    dr_grpo_norm_len: int | None = None
    """Dr.GRPO only: the constant per-sequence normaliser, normally the rollout's max_new_tokens."""
    clip_low: float = 0.2
    """PPO clip below: the ratio is clipped at 1 - clip_low. GSPO needs ~3e-4 (sequence ratios)."""
    clip_high: float = 0.2
    """PPO clip above: the ratio is clipped at 1 + clip_high ("clip-higher", DAPO uses 0.28).
    GSPO needs ~4e-4."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO (Ye et al. 2020; verl's default is 3): for negative advantages the token
    loss is at most -A * clip_ratio_c, so a token whose ratio exploded (a stale or off-policy
    sample) cannot dominate the step. Must be > 1; None: plain PPO-clip."""
    num_mini_batches: int = 1
    """PPO mini-batches: the rollout batch (trainer.global_batch_size rows) is split into this
    many row blocks, one optimizer step each, all against the old logprobs computed once before
    the first (verl's ppo_mini_batch_size, slime's steps per rollout). 1: one step per batch: the
    old policy is then the policy being trained, so the step takes its old logprobs from its own
    forward (detached; the ratio is exactly 1) and the separate recompute pass is skipped. The
    weight version still advances once per rollout batch: engines get the weights after the last
    mini-batch."""
    kl_coef: float = 0.0
    """Weight of the per-token KL to the frozen reference policy, added to each token's loss;
    0 means no reference model. A reference costs one more forward per step and one more copy
    of the parameters on every trainer rank (moe_rl.trainer.reference)."""
    kl_estimator: str = "low_var_kl"
    """Per-token estimate of KL(pi || pi_ref) from the sampled token (Schulman's k1/k2/k3, the
    names verl and slime use): "k1": logp - ref; "k2" (alias "mse"): (logp - ref)^2 / 2;
    "k3": exp(ref - logp) - (ref - logp) - 1; "low_var_kl": k3 with the log-ratio clamped to
    [-20, 20] and the result to [-10, 10] (verl's form)."""
    ref_model_path: str | None = None
    """HF directory of the reference policy (loaded through the bridge importer). None: the
    initial policy (`model.path`, or the random init from trainer.seed)."""
    off_policy: str = "tis"
    """Correction for the gap between the rollout engine's policy and the trainer's old policy,
    from the per-token ratio w = exp(old_logprob - rollout_logprob):
    "tis": weight each token's loss by min(w, tis_cap) (truncated importance sampling);
    "icepop": weight by w inside [icepop_low, icepop_high], 0 outside (IcePop);
    "mis": drop whole sequences whose geometric-mean ratio exp(mean_t log w) lies outside
    [mis_low, mis_high] (sequence-level masked importance sampling, geometric form);
    "none": no correction; allowed only with max_staleness 0 (see `check_staleness`)."""
    tis_cap: float = 2.0
    """TIS: upper truncation of the token ratio w."""
    icepop_low: float = 0.5
    """IcePop: tokens with w below this are masked out."""
    icepop_high: float = 5.0
    """IcePop: tokens with w above this are masked out."""
    mis_low: float = 0.5
    """MIS: sequences whose geometric-mean ratio is below this are masked out."""
    mis_high: float = 2.0
    """MIS: sequences whose geometric-mean ratio is above this are masked out."""
    distill: DistillConfig | None = None
    """On-policy distillation from a served teacher (docs/signals.md); None: off."""

    def __post_init__(self):
        _choice("advantage_estimator", self.advantage_estimator, ESTIMATORS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("off_policy", self.off_policy, OFF_POLICY)
        if self.adv_eps <= 0:
            raise ValueError(f"algorithm.adv_eps={self.adv_eps}: must be > 0 (e.g. 1e-6)")
        if self.advantage_estimator == "dr_grpo":
            if self.dr_grpo_norm_len is None or self.dr_grpo_norm_len < 1:
                raise ValueError(
                    f"algorithm.dr_grpo_norm_len={self.dr_grpo_norm_len}: dr_grpo needs a positive "
                    "constant normaliser; set it to the rollout's max_new_tokens"
                )
        elif self.dr_grpo_norm_len is not None:
            raise ValueError(
                f"algorithm.dr_grpo_norm_len={self.dr_grpo_norm_len} is only used by "
                f"advantage_estimator='dr_grpo' (got {self.advantage_estimator!r}): remove it"
            )
        if not 0 < self.clip_low < 1:
            raise ValueError(f"algorithm.clip_low={self.clip_low}: must be in (0, 1), e.g. 0.2")
        if self.clip_high <= 0:
            raise ValueError(f"algorithm.clip_high={self.clip_high}: must be > 0, e.g. 0.28")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"algorithm.clip_ratio_c={self.clip_ratio_c}: must be > 1 (verl uses 3), or null")
        if not isinstance(self.num_mini_batches, int) or self.num_mini_batches < 1:
            raise ValueError(f"algorithm.num_mini_batches={self.num_mini_batches!r}: must be an integer >= 1")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef={self.kl_coef}: must be >= 0 (0 disables KL)")
        if self.ref_model_path is not None:
            if self.kl_coef == 0:
                raise ValueError(
                    f"algorithm.ref_model_path={self.ref_model_path!r} is only used with "
                    "kl_coef > 0: set algorithm.kl_coef or remove ref_model_path"
                )
            if not (Path(self.ref_model_path) / "config.json").is_file():
                raise ValueError(
                    f"algorithm.ref_model_path={self.ref_model_path!r}: no config.json there; "
                    "point it at an HF model directory"
                )
        if self.tis_cap < 1:
            raise ValueError(f"algorithm.tis_cap={self.tis_cap}: must be >= 1, e.g. 2.0")
        _band("icepop", self.icepop_low, self.icepop_high)
        _band("mis", self.mis_low, self.mis_high)

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute `ref_logprobs` with a frozen reference model."""
        return self.kl_coef > 0

    def check_staleness(self, max_staleness: int) -> None:
        """Rollouts up to `max_staleness` versions old are off-policy: require a correction."""
        if max_staleness > 0 and self.off_policy == "none":
            raise ValueError(
                f"algorithm.off_policy='none' with max_staleness={max_staleness}: stale rollouts "
                "need an off-policy correction; set algorithm.off_policy to tis, icepop or mis"
            )


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"algorithm.{name}={value!r}: use one of {options}")


def _band(prefix: str, low: float, high: float) -> None:
    if not 0 < low < 1 < high:
        raise ValueError(
            f"algorithm.{prefix}_low={low}, algorithm.{prefix}_high={high}: need "
            f"0 < {prefix}_low < 1 < {prefix}_high, e.g. 0.5 and 2.0"
        )
