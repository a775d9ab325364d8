"""Analysis of compiled programs: what XLA made of a training step (collectives, FLOPs, memory).

Modules, bottom up:
    hlo_text   read HLO module text: computations, instructions, the call graph with loop trip
               counts (``executed_instructions``), shape sizes
    tally      the collectives of a module: kind x mesh axes x phase, bytes and wire bytes
               (``tally``, ``tally_compiled``, ``collective_ops``)
    fused      XLA:TPU's collectives inside fusions: asynchronous start/continuation/done, reduce-scatters
    patterns   other readings: dot FLOPs per step, all-reduces that are reduce-scatters in disguise
    overlap    which collectives the schedule issues asynchronously, with a matmul in flight
    target     the compiler: simulated CPU devices, or a TPU topology compiled for ahead of time (libtpu)
    comm       ``jaxpar comm``: compile a step, tally it, report collectives, FLOPs and memory as JSON
    report     present ``comm`` reports: a table, several side by side, a bar chart

The ``Collective`` record they produce is jaxpar.collectives', shared with the analytic cost model
(jaxpar.cost).
"""
