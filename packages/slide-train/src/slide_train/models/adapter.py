"""Hugging Face decoder-only models as a `Stack`: edges (embedding, final norm, lm head) and decoder blocks.

Every supported family has the same outer shape (`model.embed_tokens`, `model.layers`, `model.norm`,
`model.rotary_emb`, `lm_head`); what differs inside a decoder layer (Qwen2 biases, q/k norms, Phi-3's fused
projections, post-norms, multipliers, soft-capping) is left to the HF layer class itself, and what differs around
the layers is one entry in `families.FAMILIES`, so one adapter serves them all.

Blocks are structurally identical, but a layer's attention may depend on its index (sliding window or global,
and for Gemma 3 its own rotary base): the head builds one context per layer type, and `HFStack.block_context`
hands each block the one of its layer.

A mixture-of-experts layer (Qwen3-MoE, Mixtral, OLMoE) is one block too: transformers' router and experts run
inside it (the experts through transformers' experts implementation, grouped matmuls), and the block holds all of
its layer's experts. Checkpoints that store one tensor per expert are fused while loading (`Family.checkpoint`).

Their load-balancing loss (`output_router_logits`) pools every layer's routing of a micro-batch, so it travels
beside the blocks: the head puts a `RouterStats` in each micro-batch's context, each block's forward records its
layer's expert counts and router-probability sums there, the tail (which the engine hands the context) computes
the loss and its gradient w.r.t. each layer's probability sums, and each block's backward recompute passes that
gradient to its router (`_RouterGradient`). Without the loss the counts are still recorded, for the step's
record of the experts' load; nothing reaches the gradients.

Each micro-batch's term enters the step whole, as in the loop `transformers.Trainer` runs (`num_items_in_batch`:
the language-model loss is a share of the step's, the load-balancing term is not divided); `aux_loss_mean_of`, the
step's micro-batch count, makes it their mean instead, as in a loop of `model(ids, labels=ids).loss / grad_accum`.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
import transformers
from torch import nn

import slide_kernels

from . import attention, backends
from .families import FAMILIES, Family, family_of, kernel_note, layer_types, supported_text
from .loss import causal_lm_loss
from .query_tiles import tile_layer_attention
from .tiling import tile_layer

__all__ = ["FAMILIES", "DecoderBlock", "Edges", "HFStack", "block_hf_name", "check_supported",
           "edge_hf_name", "supported_text"]

DEFAULT_FAMILY = FAMILIES["llama"]  # the usual checkpoint names


def check_supported(config: transformers.PretrainedConfig) -> Family:
    """The config's family; a ModelError naming the supported families when it has none."""
    return family_of(config)


ROUTER = "router"  # the head's context entry with the micro-batch's RouterStats
LAYER = "layer"  # a block's index, in its context where routing is recorded


class RouterStats:
    """One micro-batch's routing, as transformers' load-balancing loss pools it over all layers: per layer the
    number of top-k picks of each expert, the sum of each expert's router probability, and the rows counted
    (padding excluded, as transformers excludes it given an attention mask)."""

    def __init__(self, valid: torch.Tensor | None, loss: bool = True):
        self.valid = valid  # float [rows] (1: a token, 0: padding), or None: every row counts
        self.loss_on = loss  # the load-balancing loss is on (else the counts alone, for the metrics)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | float]] = {}
        self.grad: torch.Tensor | None = None  # d(coef * loss) / d(a layer's probability sums), the same for all

    def sums(self, logits: torch.Tensor, top_k: int, experts: int):
        """(top-k counts, probability sums, rows) of one layer's router logits, as transformers computes them (the
        probability sums only where the loss is on). The counts are made on the device (histc, or a weighted
        scatter with padding): no read back to the host, which bincount would make."""
        probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as there
        picked = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        if self.valid is None:
            counts = torch.histc(picked.float(), bins=experts, min=0, max=experts - 1)
            rows = float(probs.shape[0])
        else:
            counts = torch.zeros(experts, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(0, picked, self.valid.repeat_interleave(top_k))
            rows = self.valid.sum()
        if not self.loss_on:
            return counts, None, rows
        weighted = probs.float() if self.valid is None else probs.float() * self.valid.unsqueeze(-1)
        return counts, weighted.sum(dim=0), rows

    def counts(self) -> torch.Tensor:
        """Each expert's top-k picks over the micro-batch, all layers together."""
        return self._pooled()[0]

    def loss(self, coef: float, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's load-balancing loss and its expert counts; sets `grad` for the blocks' backward."""
        counts, probs, rows = self._pooled()
        tokens_per_expert, prob_per_expert = counts / rows, probs / rows
        # The loss is sum_e T_e * P_e * experts / rows^2 with the counts T constant (top-k has no gradient).
        self.grad = coef * experts * tokens_per_expert / rows
        return torch.sum(tokens_per_expert * prob_per_expert) * experts, counts

    def _pooled(self):
        counts = probs = rows = 0.0
        for index in sorted(self.layers):  # in layer order, as transformers adds them up
            c, p, r = self.layers[index]
            counts, probs, rows = counts + c, probs if p is None else probs + p, rows + r
        return counts, probs, rows


class _RouterGradient(torch.autograd.Function):
    """The identity on a block's output whose backward also gives the layer's router-probability sums the
    load-balancing loss's gradient, known only once the tail has seen every layer's routing."""

    @staticmethod
    def forward(ctx, hidden, prob_sums, stats):
        ctx.stats = stats
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.stats.grad.to(grad.device), None


class Edges(nn.Module):
    """Embedding + rotary tables (head) and final norm + lm head + loss (tail).

    `windows`: each layer type's attention window (None: full causal attention); left out, every layer is a
    full-attention layer. The head's context holds one entry per layer type.
    """

    def __init__(self, embed_tokens: nn.Embedding, rotary: nn.Module | None, norm: nn.Module, lm_head: nn.Linear,
                 windows: dict[str, int | None] | None = None, *, embed_scale: float | None = None,
                 embed_scale_rounded: bool = False, logits_divisor: float | None = None, softcap: float | None = None,
                 head_dim: int = 0, attn_softcap: float | None = None,
                 routing: tuple[float | None, int] | None = None, aux_loss_mean_of: int = 1,
                 sequence_tile: int = 0):
        super().__init__()
        # A mixture of experts' (router_aux_loss_coef where its load-balancing loss is on, else None; number of
        # experts): the routing is counted either way, for the metrics
        self.routing = routing
        self.aux_loss_mean_of = aux_loss_mean_of  # each micro-batch's load-balancing term is divided by this
        self._routing: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # this step's (loss, expert counts)
        self.embed_tokens, self.rotary, self.norm, self.lm_head = embed_tokens, rotary, norm, lm_head
        self.windows = dict(windows) if windows else {"full_attention": None}
        self.embed_scale, self.embed_scale_rounded = embed_scale, embed_scale_rounded
        self._scales: dict[torch.dtype, float] = {}
        self.logits_divisor, self.softcap = logits_divisor, softcap
        # What each layer type's attention needs, and the backend running it: the plan's choice where given
        # (`attention`), else the first that computes it exactly on the rows' device (`backends.candidates`)
        self.head_dim, self.attn_softcap = head_dim, attn_softcap
        self.sequence_tile = sequence_tile  # the blocks' query tiles: their backend must run them
        self.attention: dict[str, str] = {}
        self._chosen: dict[tuple, backends.Backend] = {}
        # Gemma 3 keeps a rotary table per layer type (local and global bases)
        self.rotary_per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        # Read by the tail only: the engine may update them while backward runs (a tied lm head is left out).
        self.tail_only = tuple(name for name, _ in self.named_parameters(remove_duplicate=False)
                               if name.startswith(("norm.", "lm_head.")))

    def head_activation(self, batch):
        """The head's output alone: what its backward recomputes (no masks or rotary tables)."""
        hidden = self.embed_tokens(batch["input_ids"])
        if self.embed_scale is not None:
            hidden = hidden * self._embed_scale(hidden.dtype)
        return hidden

    def head(self, batch):
        ids = batch["input_ids"]
        hidden = self.head_activation(batch)
        positions = batch["position_ids"]
        documents = batch.get("document_ids")
        shared = None if self.rotary_per_type else self.rotary(hidden, positions)
        masks = {}
        ctx = {}
        for kind, window in self.windows.items():
            backend = self.backend(kind, ids.shape[1], documents is not None, hidden.dtype, ids.device)
            if (window, backend) not in masks:
                masks[window, backend] = backends.prepare(backend, documents, window, ids.shape[1], hidden.dtype,
                                                          ids.device)
            ctx[kind] = {
                "position_embeddings": self.rotary(hidden, positions, kind) if self.rotary_per_type else shared,
                "position_ids": positions,
                "attention_mask": masks[window, backend],
            }
        if self.routing is not None and not torch.is_grad_enabled():  # the forward, not the head's backward
            valid = None if documents is None else (documents >= 0).reshape(-1).float()
            ctx[ROUTER] = RouterStats(valid, loss=self.routing[0] is not None)
        return hidden, ctx

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """Gemma rounds sqrt(hidden) to the activations' dtype first (55.43 is 55.5 in bf16), Granite does not."""
        if dtype not in self._scales:  # a Python number: no tensor made per micro-batch
            rounded = self.embed_scale_rounded
            self._scales[dtype] = float(torch.tensor(self.embed_scale).to(dtype)) if rounded else self.embed_scale
        return self._scales[dtype]

    def backend(self, kind: str, seq: int, documents: bool, dtype, device) -> backends.Backend:
        """Layer type `kind`'s attention backend for rows of `seq` tokens: the planned one, else the first exact
        one here (once per kind, length, device and documents; a planned backend that cannot compute the rows
        stops the step, naming why)."""
        key = (kind, seq, documents, dtype, device.type)
        chosen = self._chosen.get(key)
        if chosen is None:
            needs = backends.layer_needs(self.windows, self.head_dim, self.attn_softcap, seq, documents,
                                         self.sequence_tile)[kind]
            name = self.attention.get(kind) or backends.candidates(needs, device, dtype)[0]
            why = backends.get(name).why_not(needs, device, dtype)
            if why is not None:
                raise ValueError(f"attention backend {name} cannot run the {kind} layers here: {why}")
            chosen = self._chosen[key] = backends.get(name)
        return chosen

    def tail(self, hidden, batch, normalizer: float, ctx=None):
        targets = batch["targets"]
        if "loss_rows" in batch:  # only the tokens with a target go through the norm and the lm head
            rows = batch["loss_rows"]
            hidden, targets = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), targets.reshape(-1)[rows]
        hidden = self.norm(hidden)
        if self.logits_divisor is not None:  # (h @ W.T) / s as (h / s) @ W.T: the fused loss takes no logit scale
            hidden = hidden / self.logits_divisor
        loss = causal_lm_loss(hidden, self.lm_head.weight, targets, bias=self.lm_head.bias,
                              softcap=self.softcap) / normalizer
        stats = (ctx or {}).get(ROUTER)
        if stats is None or not stats.layers:
            return loss
        coef, experts = self.routing
        if coef is None:  # counted for the metrics alone
            if torch.is_grad_enabled():
                self._routing.append((None, stats.counts()))
            return loss
        # transformers' loss: the language-model loss plus coef times this micro-batch's load-balancing loss
        # (the step's mean of them with aux_loss_mean_of micro-batches); the routers' gradient follows the weight
        weight = coef / self.aux_loss_mean_of
        aux, counts = stats.loss(weight, experts)
        if torch.is_grad_enabled():  # a training step's, not an evaluation's
            self._routing.append((aux.detach(), counts))
        return loss + weight * aux.to(loss.dtype)

    def routing_summary(self) -> dict[str, float] | None:
        """The last step's least and most loaded experts' share of the top-k picks over all layers, as a multiple
        of an even share (1.0), and its load-balancing loss where on (mean over its micro-batches, before
        router_aux_loss_coef)."""
        if not self._routing:
            return None
        losses, counts = zip(*self._routing)
        self._routing.clear()
        total = torch.stack(counts).sum(dim=0)
        load = (total * total.numel() / total.sum()).tolist()
        aux = {} if losses[0] is None else {"aux_loss": torch.stack(losses).mean().item()}
        return {**aux, "expert_load_min": min(load), "expert_load_max": max(load)}


class DecoderBlock(nn.Module):
    """One HF decoder layer with the engine's block signature: forward(hidden, ctx) -> hidden.

    `router`: (the layer's router module, the index of the logits in its output, top-k, number of experts) in a
    mixture of experts; the router's logits are then kept by a forward hook (in transformers 5 the layer does not
    return them) and recorded in the context's RouterStats, and where the load-balancing loss is on given their
    gradient from it in the backward.
    """

    def __init__(self, layer: nn.Module, router: tuple[nn.Module, int, int, int] | None = None):
        super().__init__()
        self.layer = layer
        self._logits = None
        self._routing = None
        if router is not None:
            module, index, top_k, experts = router
            self._routing = (top_k, experts)
            module.register_forward_hook(lambda _m, _i, out: setattr(self, "_logits", out[index]))

    def forward(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        stats = ctx.get(ROUTER) if self._routing is not None else None
        index = ctx.get(LAYER)
        if ROUTER in ctx:  # (a dense layer among mixture-of-experts ones records nothing)
            ctx = {k: v for k, v in ctx.items() if k not in (ROUTER, LAYER)}
        out = self.layer(hidden, **ctx)
        out = out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple
        logits, self._logits = self._logits, None
        if stats is None:
            return out
        if torch.is_grad_enabled():  # the backward's recompute: the tail has set the gradient, if there is a loss
            if stats.grad is None:
                return out
            _, prob_sums, _ = stats.sums(logits, *self._routing)
            return _RouterGradient.apply(out, prob_sums, stats)
        stats.layers[index] = stats.sums(logits, *self._routing)
        return out


def layer_shapes(layers: nn.ModuleList) -> list[str]:
    """Each layer's shape, named by its kind: "experts" where it holds a mixture of experts, else "dense"; layers
    of one kind but other parameters (other widths) get a number after it."""
    signatures = [tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()) for layer in layers]
    kinds = {sig: "experts" if any(".experts." in f".{name}" for name, _ in sig) else "dense"
             for sig in dict.fromkeys(signatures)}
    names, seen = {}, {}
    for sig, kind in kinds.items():
        seen[kind] = seen.get(kind, 0) + 1
        names[sig] = kind if seen[kind] == 1 else f"{kind} {seen[kind]}"
    return [names[sig] for sig in signatures]


class HFStack:
    """`slide_scheduler.Stack` for an HF causal LM given its config and a weight source."""

    def __init__(self, config: transformers.PretrainedConfig, weights, kernels: bool = False,
                 aux_loss_mean_of: int = 1):
        self.family = family = check_supported(config)
        self.aux_loss_mean_of = aux_loss_mean_of  # (Edges)
        if kernels and (family.unfused or not family.kernels):  # only what is left on the torch path
            warnings.warn(f"engine.kernels: {family.title} ({family.model_type}) runs {kernel_note(family)}",
                          stacklevel=2)
        self.kernels = kernels and family.kernels  # slide-kernels' fused ops (family.fused) in every block
        self.sequence_tile = 0  # positions per tile of each block's per-token work (0: none), the engine's word
        self.query_tiles = False  # its attention by query tiles of as many positions too
        self.softcap = getattr(config, family.final_softcap, None) if family.final_softcap else None
        # Soft-capped attention: a fused backend on CUDA (backends.py), HF's eager path on the CPU
        self.attn_softcap = getattr(config, family.attn_softcap, None) if family.attn_softcap else None
        config._attn_implementation = "eager" if self.attn_softcap is not None else "sdpa"  # for the skeleton
        self.config = config
        self.weights = weights
        self.num_blocks = config.num_hidden_layers
        self.layer_types = layer_types(config, family)
        window = getattr(config, "sliding_window", None)
        self.windows = {kind: window if kind == "sliding_attention" else None
                        for kind in dict.fromkeys(self.layer_types)}
        heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.attention: dict[str, str] = {}  # each layer type's attention backend, the plan's choice (else: the first)
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        self._layer_cls = type(skeleton.get_submodule(family.layers)[0])
        # Layers may come in several shapes (Qwen3-MoE's dense layers among sparse ones): each block's shape, by
        # the parameters of its layer, and the first layer of each shape, which make_block builds
        self._shapes = layer_shapes(skeleton.get_submodule(family.layers))
        self._first_of = {shape: self._shapes.index(shape) for shape in dict.fromkeys(self._shapes)}
        config._attn_implementation = attention.register()  # the blocks run the mask the head builds
        self._skeleton = skeleton
        self.routing = None  # a mixture's (load-balancing loss coefficient where on, else None; experts)
        if family.experts:  # the experts implementation transformers chose for the skeleton, for the blocks too
            config._experts_implementation = skeleton.config._experts_implementation
            coef = float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else None
            self.routing = (coef, int(getattr(config, family.experts)))
            self._router = type(skeleton)._can_record_outputs["router_logits"]

    def make_edges(self) -> Edges:
        cfg, family, skeleton = self.config, self.family, self._skeleton
        hf_embed, hf_head = skeleton.get_submodule(family.embed), skeleton.get_submodule(family.lm_head)
        with torch.device("meta"):
            # (padding_idx as HF's: the pad token's row gets no gradient)
            embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=hf_embed.padding_idx)
            norm = copy.deepcopy(skeleton.get_submodule(family.norm))
            lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=hf_head.bias is not None)
        if cfg.tie_word_embeddings:
            lm_head.weight = embed.weight
        rotary = type(skeleton.get_submodule(family.rotary))(config=cfg)  # real buffers (inv_freq), on the host
        scale = None
        if family.embed_sqrt_hidden:
            scale = cfg.hidden_size**0.5
        elif family.embed_multiplier and getattr(cfg, family.embed_multiplier, 1.0) != 1.0:
            scale = float(getattr(cfg, family.embed_multiplier))
        divisor = getattr(cfg, family.logits_divisor, 1.0) if family.logits_divisor else 1.0
        edges = Edges(embed, rotary, norm, lm_head, self.windows, embed_scale=scale,
                      embed_scale_rounded=family.embed_sqrt_hidden,
                      logits_divisor=float(divisor) if divisor != 1.0 else None, softcap=self.softcap,
                      head_dim=self.head_dim, attn_softcap=self.attn_softcap, routing=self.routing,
                      aux_loss_mean_of=self.aux_loss_mean_of,
                      sequence_tile=self.sequence_tile if self.query_tiles else 0)
        edges.attention = dict(self.attention)
        if self.kernels:
            slide_kernels.apply_to(_Patchable(cfg, edges))
        return edges

    def attention_needs(self, seq: int, documents: bool, tile: int = 0) -> dict[str, backends.Needs]:
        """What each layer type's attention needs over rows of `seq` tokens (`documents`: packed rows; `tile`:
        queries per tile, where the blocks run attention by query tiles)."""
        return backends.layer_needs(self.windows, self.head_dim, self.attn_softcap, seq, documents, tile)

    def block_shape(self, index: int) -> str:
        """Block `index`'s shape: "dense", "experts", or with a number where more shapes share a kind."""
        return self._shapes[index]

    def tile_sequence(self, tile: int, queries: bool = False) -> None:
        """Blocks made from here on run their dense MLP over tiles of `tile` positions (0: whole rows) and, with
        `queries`, their attention by query tiles of as many; edges made from here on then choose attention backends
        that run such tiles."""
        self.sequence_tile, self.query_tiles = tile, queries and bool(tile)

    def make_block(self, shape: str | None = None) -> DecoderBlock:
        with torch.device("meta"):
            layer = self._layer_cls(self.config, layer_idx=self._first_of[shape] if shape is not None else 0)
        router = None
        if self.routing is not None:
            recorder = self._router
            module = next((m for m in layer.modules() if isinstance(m, recorder.target_class)), None)
            if module is not None:  # (a dense layer has no router)
                router = (module, recorder.index, int(self.config.num_experts_per_tok), self.routing[1])
        block = DecoderBlock(layer, router)
        if self.kernels:
            slide_kernels.apply_to(_Patchable(self.config, block), experts="moe_experts" in self.family.fused)
        if self.sequence_tile:  # (after the kernels: the tiles run the fused ops)
            if self.query_tiles:
                tile_layer_attention(layer, self.sequence_tile)
            tile_layer(layer, self.sequence_tile)
        return block

    def active_numel(self, block: nn.Module) -> int:
        """The parameters of `block` one token computes with: all but the experts it is not routed to (a mixture
        of experts holds every expert of its layer; a token runs `num_experts_per_tok` of them)."""
        pooled = sum(p.numel() for name, p in block.named_parameters() if ".experts." in name)
        return sum(p.numel() for p in block.parameters()) - pooled + self.routed_numel(block)

    def routed_numel(self, block: nn.Module) -> int:
        """Of those, the routed experts' (0 for a dense block): `num_experts_per_tok` of its layer's experts."""
        if not self.family.experts:
            return 0
        experts, routed = int(getattr(self.config, self.family.experts)), int(self.config.num_experts_per_tok)
        return sum(p.numel() for name, p in block.named_parameters() if ".experts." in name) * routed // experts

    def block_context(self, index: int, ctx: dict) -> dict:
        """Block `index`'s share of the head's context: the mask and rotary tables of its layer's type (and, in a
        mixture of experts, the micro-batch's RouterStats and the block's index)."""
        own = ctx[self.layer_types[index]]
        return own if ROUTER not in ctx else {**own, ROUTER: ctx[ROUTER], LAYER: index}

    def load_edges(self, params: dict[str, torch.Tensor]) -> None:
        for name, view in params.items():
            self.weights.read_into(edge_hf_name(name, self.family), view)

    def load_block(self, index: int, params: dict[str, torch.Tensor]) -> None:
        stored = dict(self.family.checkpoint)
        for name, view in params.items():
            hf = block_hf_name(index, name, self.family)
            sources = stored.get(name.removeprefix("layer."))
            if sources is None or hf in self.weights:
                self.weights.read_into(hf, view)
                continue
            prefix = f"{self.family.layers}.{index}."
            if "{e}" not in sources[0]:  # the same tensor under another name
                self.weights.read_into(prefix + sources[0], view)
                continue
            rows = view.shape[1] // len(sources)  # each expert's slice: its tensors one after the other
            for e in range(view.shape[0]):
                for k, source in enumerate(sources):
                    self.weights.read_into(prefix + source.format(e=e), view[e, k * rows:(k + 1) * rows])


class _Patchable(nn.Module):
    """What `slide_kernels.apply_to` expects to see: modules under something that has the HF config."""

    def __init__(self, config, module: nn.Module):
        super().__init__()
        self.config = config
        self.inner = module


def edge_hf_name(name: str, family: Family | None = None) -> str:
    """An edge parameter's checkpoint name ('norm.weight' -> 'model.norm.weight')."""
    family = family or DEFAULT_FAMILY
    for ours, theirs in (("embed_tokens.", family.embed), ("norm.", family.norm), ("lm_head.", family.lm_head)):
        if name.startswith(ours):
            return f"{theirs}.{name[len(ours):]}"
    raise KeyError(name)


def block_hf_name(index: int, name: str, family: Family | None = None) -> str:
    return f"{(family or DEFAULT_FAMILY).layers}.{index}." + name.removeprefix("layer.")
