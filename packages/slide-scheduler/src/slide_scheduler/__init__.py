"""slide-scheduler: the layer-sliding engine (head, blocks, tail; slots, boundary activations, host updates), the
placement it executes and the cost model that prices it on a machine."""

from slide_io import folders_of

from .__about__ import __version__
from .measure.host import host_cores, host_memory_bytes
from .measure.probe import probe as probe_machine
from .measure.probe import probe_disk, probe_gpu
from .plan.choices import Budgets, Overrides, arrange, expert
from .plan.cost import Estimate, disk_traffic, price
from .plan.facts import (
    DISK,
    DTYPES,
    GPU,
    HOST,
    TIERS,
    RunFacts,
    activation_tier,
    register_tier,
    resolve_device,
    run_facts,
)
from .plan.machine import Disk, Gpu, Host, Machine, Pcie, causal_attention_flops, routed_expert_flops
from .plan.placement import Allocation, Placement, UnitPlacement
from .plan.planner import (
    SEQUENCE_TILES,
    Plan,
    Suggestion,
    budget_problems,
    compute_bound_step,
    disk_share,
    longest_rows,
    place,
    suggest,
)
from .plan.shapes import Layouts, Shapes, StepShape, block_shapes, layouts_of, make_block, shapes_of
from .plan.stripe import Share, boundary_share, drive_shares, seconds_on, stripe, unit_share
from .plan.workspace import block_workspace
from .run.activations import ActivationStore
from .run.engine import EngineConfig, SlidingEngine, StepStats
from .run.ranks import Ranks
from .run.stack import Batch, Context, Edges, Stack
from .run.timeline import plot as plot_timeline
from .run.timeline import write_trace

__all__ = [
    "SEQUENCE_TILES",
    "DISK",
    "DTYPES",
    "GPU",
    "HOST",
    "TIERS",
    "ActivationStore",
    "Allocation",
    "Batch",
    "Budgets",
    "Context",
    "Disk",
    "Edges",
    "EngineConfig",
    "Estimate",
    "Gpu",
    "Host",
    "Layouts",
    "Machine",
    "RunFacts",
    "Overrides",
    "Pcie",
    "Placement",
    "Plan",
    "Ranks",
    "Shapes",
    "Share",
    "SlidingEngine",
    "Stack",
    "StepShape",
    "StepStats",
    "Suggestion",
    "UnitPlacement",
    "__version__",
    "activation_tier",
    "arrange",
    "block_shapes",
    "block_workspace",
    "boundary_share",
    "budget_problems",
    "causal_attention_flops",
    "compute_bound_step",
    "disk_share",
    "disk_traffic",
    "drive_shares",
    "expert",
    "folders_of",
    "host_cores",
    "host_memory_bytes",
    "longest_rows",
    "layouts_of",
    "make_block",
    "place",
    "plot_timeline",
    "price",
    "probe_disk",
    "probe_gpu",
    "probe_machine",
    "register_tier",
    "resolve_device",
    "routed_expert_flops",
    "run_facts",
    "seconds_on",
    "shapes_of",
    "stripe",
    "suggest",
    "unit_share",
    "write_trace",
]
