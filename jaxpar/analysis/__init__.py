"""Analysis of compiled programs: what XLA made of a training step (collectives, FLOPs, memory).

Modules, bottom up:
    hlo_text   read HLO module text: computations, instructions, the call graph with loop trip
               counts (``executed_instructions``), shape sizes
    tally      the collectives of a module: kind x mesh axes x phase, bytes and wire bytes
               (``tally``, ``tally_compiled``, ``collective_ops``)
    patterns   other readings: dot FLOPs per step, all-reduces that are reduce-scatters in disguise
    comm       ``jaxpar comm``: compile a step, tally it, report collectives, FLOPs and memory as JSON
    report     present ``comm`` reports: a table, several side by side, a bar chart

The ``Collective`` record they produce is jaxpar.collectives', shared with the analytic cost model
(jaxpar.cost).
"""
