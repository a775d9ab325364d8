"""Energy per step and per token: a per-device power model over the estimate's busy times.

The survey lists energy as an open challenge of hybrid parallelism; what the cost model can say is
how a layout spends the step: a device draws `idle_w` for the whole step (bubbles and exposed
communication included) and, above that, its dynamic power (tdp_w - idle_w) in proportion to how
busy each part is:

    E_device = idle_w * T + (tdp_w - idle_w) * (COMPUTE * t_matmul + MEMORY * t_hbm + LINKS * t_links)

t_matmul: the step's matmuls at the calibrated efficiency (the tensor cores / MXUs busy); t_hbm: the
bandwidth-bound elementwise work; t_links: every collective's alpha-beta time, hidden or not (a link
moving bytes under compute still draws power). All three at most T each. The shares of dynamic power
(COMPUTE 0.6, MEMORY 0.3, LINKS 0.1) are an assumption, not a measurement: GPU power studies put the
SMs / tensor cores first and HBM second (e.g. Hong and Kim 2010, ISCA, "An integrated GPU power and
performance model"; the link share is the NVLink/ICI SerDes', small at these bandwidths). tdp_w and
idle_w per device are in each hardware profile's [power] table with their source; a profile without
one has no energy figures. Joules per token divide the energy of all devices by the step's tokens.
"""
from __future__ import annotations

import dataclasses

COMPUTE, MEMORY, LINKS = 0.6, 0.3, 0.1


@dataclasses.dataclass(frozen=True, slots=True)
class Energy:
    joules_per_step: float     # all devices
    joules_per_token: float
    average_watts: float       # per device, over the step
    idle_share: float          # of the energy: idle_w * T (bubbles and waiting included)


def step_energy(step_s: float, matmul_s: float, hbm_s: float, link_s: float, devices: int, tokens: float,
                tdp_w: float, idle_w: float) -> Energy | None:
    """None when the profile has no power figures (tdp_w == 0)."""
    if not tdp_w:
        return None
    busy = COMPUTE * min(matmul_s, step_s) + MEMORY * min(hbm_s, step_s) + LINKS * min(link_s, step_s)
    per_device = idle_w * step_s + (tdp_w - idle_w) * busy
    total = per_device * devices
    return Energy(joules_per_step=total, joules_per_token=total / tokens, average_watts=per_device / step_s,
                  idle_share=idle_w * step_s / per_device)
