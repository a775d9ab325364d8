"""The cost model's error band: how far its predictions fell from published runs of one stack on one
hardware family.

experiments/study_stacks.py predicts every published training run of shared/reference/
published_runs_stacks.toml with its own stack's preset (jaxpar/cost/software.py) on its hardware
profile, and writes the residuals per (hardware family, stack) to jaxpar/cost/bands.toml: the number of
runs, the median and the worst absolute error of tokens/s per device, in sample (the committed constants)
and out of sample (each source predicted with the constants fitted on the other sources of its hardware
family: experiments/study_stacks.py's leave-one-source-out). `estimate` and `plan` print the in-sample band of
the pair they price beside every figure ("±x% over N published runs"); a pair with no published run says so.
The design guide (experiments/README.md) quotes the out-of-sample band, the one that says how far a run not
in the calibration may fall. A band is a record of past predictions, not a guarantee: runs of other models,
scales and stacks may fall outside it.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib

from jaxpar.core.inputs import read_toml

BANDS = pathlib.Path(__file__).resolve().parent / "bands.toml"


@dataclasses.dataclass(frozen=True)
class Band:
    family: str      # hardware family (a profile's `family`: h100-sxm, h200-sxm and h800-sxm are one)
    software: str
    runs: int        # published runs predicted
    median: float    # median |predicted / published - 1| of tokens/s per device
    worst: float
    oos_median: float | None = None   # out of sample; None where no other source covers the family
    oos_worst: float | None = None

    def guide(self) -> float:
        """The share within which the guide calls two predictions a tie: the out-of-sample median where
        another source covers the family, else the in-sample median."""
        return self.median if self.oos_median is None else self.oos_median

    def describe(self) -> str:
        oos = ("" if self.oos_median is None else
               f"; out of sample ±{self.oos_median:.1%} median, {self.oos_worst:.0%} worst")
        return (f"±{self.median:.0%} median, {self.worst:.0%} worst over {self.runs} published "
                f"{self.software} run{'s' if self.runs != 1 else ''} on {self.family}{oos}")


@functools.cache
def bands() -> dict[tuple[str, str], Band]:
    """{(family, software): Band} from bands.toml (empty when the file is absent)."""
    if not BANDS.exists():
        return {}
    out = {}
    for row in read_toml(BANDS, "bands").get("band", []):
        oos = (float(row["oos_median"]), float(row["oos_worst"])) if "oos_median" in row else (None, None)
        b = Band(row["family"], row["software"], int(row["runs"]), float(row["median"]), float(row["worst"]), *oos)
        out[b.family, b.software] = b
    return out


def band_for(family: str, software: str) -> Band | None:
    return bands().get((family, software))


def describe(family: str, software: str) -> str:
    """One line for a report: the band of (family, software), or that there is none."""
    b = band_for(family, software)
    if b is None:
        return f"error band: none (no published {software} run on {family} in the calibration)"
    return f"error band: {b.describe()} (jaxpar/cost/band.py)"


def to_toml(rows: list[Band]) -> str:
    """bands.toml's text for `rows` (experiments/study_stacks.py writes it)."""
    head = ("# Written by experiments/study_stacks.py --write-bands: the cost model's residuals on the published\n"
            "# runs of shared/reference/published_runs_stacks.toml, per hardware family and stack (jaxpar/cost/band.py).\n")
    def oos(b: Band) -> str:
        return "" if b.oos_median is None else f"oos_median = {b.oos_median:.4f}\noos_worst = {b.oos_worst:.4f}\n"
    body = "".join(f'\n[[band]]\nfamily = "{b.family}"\nsoftware = "{b.software}"\nruns = {b.runs}\n'
                   f"median = {b.median:.4f}\nworst = {b.worst:.4f}\n{oos(b)}" for b in rows)
    return head + body
