"""`Syncer`: one trainer rank's part in a weight update, whatever shape the update takes.

Every trainer rank holds one Syncer, picked by `sync.shapes.make_syncer`; the shapes are

- the plain sender (`sync.sender.WeightSender`): one weight-update group fed by the sync source;
- the funnel (`sync.pipeline.Funnel`): pipeline stages funnel their tensors to the sync source,
  which sends them all over one group (`stage_groups: false`);
- per-stage groups (`sync.stages.StagedSync`): each stage's source sends its own layers over its
  own group, relays behind it (the default with PP > 1, or with relays);
- adapters (`sync.lora.AdapterSync`): with LoRA only adapters move, without a pause;
- `Bystander`: a rank with no part in the update beyond its export's collectives.

The ranks of one update play one shape together. Its coordinator (the first pipeline stage's
source, `sync.pipeline.sync_source`) decides: `version` and `pending` answer there and the stats
of `update` come back there; elsewhere they are None, False and None.

Collective contract: `update(export, version)` is called by every trainer rank with its own
export (an iterable of `(name, tensor)`, on the ranks that yield nothing an empty one) and
iterates it to the end, whether or not the update succeeds, so the export's collectives stay in
lockstep. A caller that repeats an update until the engines hold a version (the RL trainer's
`moe_rl.trainer.weight_sync`) broadcasts the coordinator's `pending` to every rank, so all of
them call `update` the same number of times. `add`, `remove` and `close` are called on every
rank too; a shape ignores them where it holds no engines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import torch

from sync.config import SyncStats
from sync.engine_api import EngineEndpoint
from sync.owner import DiffOwner
from sync.transports.base import exhaust

Export = Iterable[tuple[str, torch.Tensor]]


class Syncer(ABC):
    version: int | None
    """The version every engine committed (the coordinator's; None elsewhere, and before an
    adapter sync's first)."""
    owner: DiffOwner | None = None
    """This rank's owner-side diffs (`sync.owner`: its experts and TP diff-owned dense tensors,
    with `sync.delta` on the shapes that take them): pass it to the export
    (`parallel.export.export_hf_weights(owner=...)`)."""

    @abstractmethod
    def pending(self, version: int) -> bool:
        """Coordinator: whether `update(export, version)` has engines to send to (a newer version,
        or the committed one again for engines behind it); False elsewhere."""

    @abstractmethod
    def update(self, export: Export, version: int) -> SyncStats | None:
        """Move `version` to the engines (collective, see above). Returns the coordinator's stats,
        None elsewhere; raises `sync.engine_set.SyncError` when an engine failed (its `dropped`
        names the engines found dead: the caller retries with a fresh export)."""

    @abstractmethod
    def add(self, engine: EngineEndpoint, served_version: int | None) -> None:
        """A restarted engine serving `served_version` joins, replacing the member of its name
        (None: weights of no version this syncer sent, see `WeightSender.add`). Raises SyncError
        where it cannot join (it stays out)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Forget a member the orchestrator knows is dead."""

    @abstractmethod
    def close(self) -> None:
        """Leave the groups and let the engines go; the syncer cannot be used afterwards."""


class Bystander(Syncer):
    """A rank with no part in the update: it runs its export out (its share of the collectives)."""

    version = None

    def pending(self, version: int) -> bool:
        return False

    def update(self, export: Export, version: int) -> None:
        exhaust(export)

    def add(self, engine: EngineEndpoint, served_version: int | None) -> None:
        pass

    def remove(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


class ViaCoordinator(Syncer):
    """A shape whose coordinator sends through its `sender` (a `WeightSender`; None on the other
    ranks): the coordinator's answers are the sender's. Subclasses say what the others do."""

    sender: Syncer | None = None

    @property
    def version(self) -> int | None:
        return self.sender.version if self.sender is not None else None

    def pending(self, version: int) -> bool:
        return self.sender is not None and self.sender.pending(version)

    def add(self, engine: EngineEndpoint, served_version: int | None) -> None:
        if self.sender is not None:
            self.sender.add(engine, served_version)

    def remove(self, name: str) -> None:
        if self.sender is not None:
            self.sender.remove(name)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
