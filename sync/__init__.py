"""Weight sync: trainer -> inference engines, bucketed and versioned, by SGLang 0.5.23's protocol.

No engine serves a version it did not fully receive: the version is committed last, and an engine
left with a partly loaded version (SGLang loads in place) stays paused until a full resend.

- `sync.config`: `SyncConfig`, `AdapterSyncConfig` (their options and checks) and `SyncStats`.
- `sync.bucket`: flat uint8 buckets (SGLang's flattened-bucket layout) + CRC-32 checksums.
- `sync.group`: the weight-update process group (own TCPStore; gloo on CPU, NCCL on GPU).
- `sync.engine_api`: `EngineEndpoint`, the protocol an engine client implements.
- `sync.receiver`: `WeightReceiver`, what an engine server drives.
- `sync.syncer`: `Syncer`, one trainer rank's part in an update, whatever its shape;
  `sync.shapes.make_syncer` picks the shape (plain sender, funnel, per-stage groups, adapters).
- `sync.sender`: `WeightSender`, the trainer side (pause, stream buckets, commit, resume).
- `sync.stages`: `StagedSync`, one weight-update group per pipeline stage, each stage's source
  sending its own layers in turn (the default with PP > 1).
- `sync.relay`: relay ranks, the root's node-mates behind it in a group (every NIC of its node).
- `sync.pipeline`: `stage_stream` and `Funnel`, every pipeline stage's export funnelled to the
  sender's rank over one group (`stage_groups: false`; with one stage, the plain sender).
- `sync.traffic`: bytes moved per link, counted where each transfer starts.
- `sync.delta`: delta sync's codec and kept copies; `sync.owner`: expert owners diffing their own
  experts before the EP gather, and the per-update decision every trainer rank takes.
- `sync.flattened_payload`: SGLang's flattened-bucket payload written and read without SGLang
  (CUDA-IPC handles for `cuda_ipc`, by-value tensors for LoRA adapters).
- `sync.transports`: how bytes move (broadcast, disk, cuda_ipc), chosen by name, imported lazily.

`sync` imports neither `parallel` nor `moe_rl`: it moves any iterable of `(hf_name, tensor)`.
"""
