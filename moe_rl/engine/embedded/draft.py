"""The embedded engine's speculative draft: the checkpoint's first multi-token-prediction (MTP) layer.

transformers' MoE models load no MTP layer, so the draft is moe-rl's own module, after DeepSeek-V3's
MTP definition and megatron-core's `MultiTokenPredictionLayer` (the one `trainer.mtp_loss_weight`
trains; the bridges map it to HF layer `num_hidden_layers`, `parallel.bridges.base.Bridge.with_mtp`):

    x_i   = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))     h_i: the main model's final (normed) hidden state
    g_i   = shared_head.norm(decoder_layer(x_i))                 a full decoder layer: attention + MoE
    q_i+2 = softmax(shared_head.head(g_i))                       the draft of token i + 2

Drafting k tokens is a chain through this one layer (SGLang's NEXTN with `--speculative-eagle-topk 1`):
step 1 reads the target's h at the last position, step j > 1 reads the draft's own g of step j - 1.

The layer is built as a one-layer model of the checkpoint's own class (`first_k_dense_replace` 0:
the layer is MoE, as DeepSeek's MTP layer is), so transformers' converter loads its per-expert
checkpoint tensors as for the main model. Its attention writes KV slot `num_hidden_layers` of the
scheduler's cache: one cache, one mask, the same padding, merge and rollback for target and draft.
It is rebuilt from every committed checkpoint, so a version serves its own draft (`ModelRunner.swap`).
"""

from __future__ import annotations

import copy
import re

import torch


def mtp_prefix(num_layers: int) -> str:
    """Checkpoint-name prefix of the first MTP layer (HF layer `num_hidden_layers`)."""
    return f"model.layers.{num_layers}."


def is_mtp_name(name: str, num_layers: int) -> bool:
    """Whether `name` belongs to an MTP layer (HF layers from `num_hidden_layers` on)."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= num_layers


_OWN = {  # the MTP layer's own modules -> their place in a one-layer model of the checkpoint's class
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
    "shared_head.norm.weight": "model.norm.weight",
}
_PROJECTION = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
"""The MTP layer's input projection (no counterpart in the decoder: `MtpDraft` holds them itself)."""


class MtpDraft(torch.nn.Module):
    """The first MTP layer of a checkpoint as a draft model (see the module docstring)."""

    def __init__(self, model_class: type, config, checkpoint: dict[str, torch.Tensor], device: torch.device):
        super().__init__()
        text = config.get_text_config()
        self.num_layers = text.num_hidden_layers
        prefix = mtp_prefix(self.num_layers)
        missing = [prefix + name for name in _PROJECTION if prefix + name not in checkpoint]
        if missing:
            raise ValueError(
                f"speculative decoding needs an MTP layer: the checkpoint has no {missing[0]} (export the "
                "model with its MTP layers: num_nextn_predict_layers >= 1 and model.mtp not 'drop')"
            )
        draft_config = copy.deepcopy(config)
        draft_text = draft_config.get_text_config()
        draft_text.num_hidden_layers = 1
        if hasattr(draft_text, "first_k_dense_replace"):
            draft_text.first_k_dense_replace = 0
        state = {}
        for name, tensor in checkpoint.items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if rest in _OWN:
                state[_OWN[rest]] = tensor
            elif rest not in _PROJECTION:
                state["model.layers.0." + rest] = tensor
        # DeepSeek ships copies of the embedding and head in the MTP layer; megatron shares the model's
        state.setdefault("model.embed_tokens.weight", checkpoint["model.embed_tokens.weight"])
        state.setdefault("lm_head.weight", checkpoint.get("lm_head.weight", checkpoint["model.embed_tokens.weight"]))
        model, info = model_class.from_pretrained(
            None, config=draft_config, state_dict=state, dtype=torch.float32, output_loading_info=True
        )
        if info["missing_keys"] or info["mismatched_keys"]:
            raise ValueError(f"the MTP layer does not fill a one-layer {model_class.__name__}: {info}")
        self.embed = model.model.embed_tokens
        self.layer = model.model.layers[0]
        self.layer.self_attn.layer_idx = self.num_layers  # its KV slot in the scheduler's cache
        self.rotary = model.model.rotary_emb
        self.norm, self.head = model.model.norm, model.lm_head
        norm_class, eps = type(self.norm), getattr(draft_text, "rms_norm_eps", 1e-6)
        hidden = draft_text.hidden_size
        self.enorm, self.hnorm = norm_class(hidden, eps=eps), norm_class(hidden, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            for name in _PROJECTION:
                getattr(self, name.split(".")[0]).weight.copy_(checkpoint[prefix + name])
        self.to(device).eval()

    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor, cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions `hidden` [B, S, H] (the target's or the draft's own hidden states) followed by
        tokens `next_ids` [B, S]; `attention_mask` [B, past + S] as the target's (holes allowed).
        Returns the log-softmax of the next-next token [B, S, V] and g [B, S, H]; writes the
        positions' KV into slot `num_hidden_layers` of `cache`."""
        seq = next_ids.shape[1]
        device = self.eh_proj.weight.device
        hidden, next_ids, attention_mask = hidden.to(device), next_ids.to(device), attention_mask.to(device)
        x = self.eh_proj(torch.cat([self.enorm(self.embed(next_ids)), self.hnorm(hidden)], dim=-1))
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]
        out = self.layer(
            x,
            attention_mask=causal_mask(attention_mask, seq),
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            position_embeddings=self.rotary(x, position_ids),
        )
        g = self.norm(out)
        return torch.log_softmax(self.head(g).float(), dim=-1), g


def causal_mask(attention_mask: torch.Tensor, seq: int) -> torch.Tensor:
    """Bool [B, 1, S, T]: query column c (of the last `seq`) sees key columns <= c that the 2-D
    mask keeps, and always itself (a padding query then has one key: no NaN rows)."""
    total = attention_mask.shape[1]
    keys = torch.arange(total, device=attention_mask.device)
    queries = keys[-seq:, None]
    allowed = (keys[None, :] <= queries) & attention_mask.bool()[:, None, :]
    return (allowed | (keys[None, :] == queries))[:, None]
