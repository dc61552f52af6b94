"""Where a trial's slots go on a Ray cluster: one node when one can hold them all, else an equal
share on each of the fewest nodes that can, as torchrun needs (the same processes per node).

Slots are GPUs where the cluster has any, else CPUs (one process per CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dsat.errors import DsatError
from dsat.runners.trial_runner import fewer_slots_fix


@dataclasses.dataclass(frozen=True)
class TrialLayout:
    nodes: int
    slots_per_node: int
    resource: str  # "GPU" or "CPU"

    @property
    def bundles(self) -> list[dict[str, float]]:
        """A placement group's bundles: one per node of the trial."""
        return [{self.resource: float(self.slots_per_node)} for _ in range(self.nodes)]

    @property
    def strategy(self) -> str:
        # STRICT_SPREAD puts each bundle on its own node: one torchrun per node.
        return "STRICT_PACK" if self.nodes == 1 else "STRICT_SPREAD"

    def fits(self, capacities: Sequence[int]) -> bool:
        """Whether nodes with ``capacities`` can hold this layout at all (when free)."""
        return sum(1 for capacity in capacities if capacity >= self.slots_per_node) >= self.nodes

    def describe(self) -> str:
        unit = self.resource
        if self.nodes == 1:
            return f"{self.slots_per_node} {unit}(s) on one node"
        return f"{self.slots_per_node} {unit}(s) on each of {self.nodes} nodes"


def slot_resource(nodes: Sequence[Mapping[str, Any]]) -> str:
    """GPU where any live node has one, else CPU."""
    has_gpu = any(float(n.get("Resources", {}).get("GPU", 0)) > 0 for n in nodes if n["Alive"])
    return "GPU" if has_gpu else "CPU"


def node_capacities(nodes: Sequence[Mapping[str, Any]], resource: str) -> list[int]:
    """Each live node's whole count of ``resource`` (what it has, not what is free now)."""
    return [int(float(n.get("Resources", {}).get(resource, 0))) for n in nodes if n["Alive"]]


def trial_layout(
    slots: int, capacities: Sequence[int], resource: str, resumed: bool = False
) -> TrialLayout:
    """The layout for a trial of ``slots`` on nodes with ``capacities``; a DsatError when none
    fits (a trial that fits the cluster but not what is free now waits for it instead)."""
    if any(capacity >= slots for capacity in capacities):
        return TrialLayout(1, slots, resource)
    for per_node in sorted((d for d in range(1, slots) if slots % d == 0), reverse=True):
        nodes_needed = slots // per_node
        if sum(1 for capacity in capacities if capacity >= per_node) >= nodes_needed:
            return TrialLayout(nodes_needed, per_node, resource)
    shown = ", ".join(str(c) for c in capacities) or "none"
    raise DsatError(
        f"resources.slots_per_trial {slots} cannot be placed on the Ray cluster: its live nodes "
        f"have {shown} {resource}(s); add nodes or {fewer_slots_fix(slots, resumed)}"
    )
