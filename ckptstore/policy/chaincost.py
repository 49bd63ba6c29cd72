"""How long a lossless chain may grow: by what a residual level costs at checkout, not by a constant.

Checkout of a chunk decodes its keyframe's planes and XORs in every residual level above it, so each
level adds decode time. `ChainCosts` holds that time per byte (measured on this machine by
repo/chaincost.py, timing a real decode) beside torch.load's time to read the same bytes; a tensor
keeps chaining while restoring it at the chain's new end stays faster than torch.load by `margin`.
Whether a residual still pays in size is decided per tensor by the writer (`after_attempt`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AUTO = "auto"
# Restoring the deepest commit of a chain must stay this much faster than torch.load of its bytes:
# the measurement is of one thread on a noisy machine, and checkout also reads and checks objects.
MARGIN = 1.25
# The longest chain the rule may choose, whatever it measures: replay walks chains of up to 64
# levels and a longer chain only saves the rare exponent-plane change.
AUTO_CAP = 16
# Where nothing was measured (the rule asked without costs): the old constant.
FALLBACK = 2


@dataclass(frozen=True)
class ChainCosts:
    """Seconds per raw byte on one thread: restoring a keyframe chunk, each level on it, torch.load.

    Checkout's threads decode chunks `workers` times faster than one (measured: fewer than the CPUs);
    torch.load reads on one.
    """

    keyframe: float
    level: float
    load: float
    workers: float = 1
    # measured while other processes held every CPU: this process's figures alone, never kept (repo/chaincost.py)
    provisional: bool = field(default=False, compare=False)

    def restore_seconds(self, nbytes: int, depth: int) -> float:
        """Modelled time to decode `nbytes` of a tensor at `depth` levels above its keyframe."""
        return nbytes * (self.keyframe + depth * self.level) / max(1, self.workers)

    def deepest(self, margin: float = MARGIN, cap: int = AUTO_CAP) -> int:
        """The deepest level whose restore stays `margin` times faster than torch.load (0 to `cap`)."""
        budget = self.load / margin * max(1, self.workers) - self.keyframe
        if budget < 0:
            return 0
        levels = budget / self.level if self.level > 0 else math.inf
        return cap if not math.isfinite(levels) else min(cap, int(levels))  # a tiny level cost: no level limits


def chain_limit(max_chain: int | str, width: int, costs: dict[int, ChainCosts] | None) -> int:
    """The longest chain a tensor of element `width` bytes may have.

    An explicit `max_chain` is a hard cap the user set; "auto" asks the measured costs of that width
    (the widest measured below it, else the fallback constant when there are none).
    """
    if max_chain != AUTO:
        return int(max_chain)
    if not costs:
        return FALLBACK
    known = [w for w in costs if w <= width] or [min(costs)]
    return costs[max(known)].deepest()
