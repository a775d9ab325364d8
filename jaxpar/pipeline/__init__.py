"""Pipeline parallelism over the `pipeline` mesh axis: the model's stacked layer units cut into stages, one
program on every device (GSPMD), micro-batches flowing between stages by collective-permutes.

The schedules (the arithmetic of each, for checks and the cost model: jaxpar/core/schedule.py):
  * GPipe (Huang et al. 2019), `pp_schedule = "gpipe"`: every micro-batch forward through the S stages, then
    jax.grad's backward; bubble (S-1)/(M+S-1). jaxpar/pipeline/gpipe.py.
  * circular (Narayanan et al. 2021, interleaved chunks), `pp_schedule = "circular"`: GPipe whose
    micro-batches go round the stages v = `pp_repeats` times, stage s holding v chunks; bubble
    (S-1)/(vM+S-1). The same loop as GPipe's, jaxpar/pipeline/gpipe.py.
  * 1F1B (PipeDream-flush), `pp_schedule = "1f1b"`: a micro-batch's backward starts as soon as its
    forward leaves the last stage, so activation memory is bounded by the stage count, not M; the
    schedule writes its own backward. jaxpar/pipeline/one_f_one_b.py.
  * interleaved 1F1B, `pp_schedule = "1f1b"` with `pp_repeats` v > 1: 1F1B over v chunks per stage,
    the circular schedule's bubble. jaxpar/pipeline/one_f_one_b.py.
What every schedule shares (the stage view of the weights, what one stage runs, the shift between
stages, the micro-batch split) is jaxpar/pipeline/stages.py; the stage-major order in which a circular
split stores its units, so that no step moves weights, is jaxpar/pipeline/order.py.

The trainer (jaxpar/training/trainer.py) calls
  * `pipelined_loss`: GPipe or circular, a loss for jax.grad to differentiate;
  * `pipelined_loss_and_grads`: 1F1B, interleaved or not, the loss and its gradients;
  * `unit_order`, `stacked_paths`, `reorder`: the stored order of the stacked units and the
    permutation between it and layer order.
`pipelined_stack` runs the layer stack alone (the pipeline's output without head and loss);
`split_microbatches` cuts a batch into micro-batches as the schedules and gradient accumulation do.
"""
from jaxpar.pipeline.gpipe import pipelined_loss, pipelined_stack
from jaxpar.pipeline.one_f_one_b import pipelined_loss_and_grads
from jaxpar.pipeline.order import reorder, stacked_paths, unit_order
from jaxpar.pipeline.stages import split_microbatches

__all__ = ["pipelined_loss", "pipelined_loss_and_grads", "pipelined_stack", "reorder", "split_microbatches",
           "stacked_paths", "unit_order"]
