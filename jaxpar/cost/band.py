"""The cost model's error bands: how far its predictions fell from published runs.

experiments/study_stacks.py predicts every published training run of the published_runs_stacks collection
(jaxpar/cost/published.py: the data in the repository) with its own stack's preset (jaxpar/cost/software.py)
on its hardware profile, in sample (the committed constants) and out of sample (each source predicted with
the constants fitted on the other sources of its hardware family: leave one source out), and writes to
jaxpar/cost/bands.toml (`--write-bands`):
  per (hardware family, stack)   runs, median and worst |error| of tokens/s per device, in and out of sample
                                 (the guide's ties: `Band.guide`);
  per regime                     the stack, family, precision, PP >= 16, CP >= 8, MoE and > 1,024 devices of a
                                 layout (`regime`): the 10th to 90th percentile of its runs' signed
                                 out-of-sample errors where at least 8 runs fall in it, else "no calibrating
                                 run"; and the share of its runs inside the band the other sources' runs give;
  paired                         the error of a *difference*: over pairs of published layouts of one model on one
                                 machine (one source, sequence length and precision), the 10th to 90th
                                 percentile of (predicted ratio / published ratio - 1), each pair in both orders.
`estimate` prints its layout's regime band (and `--json` carries it as `band`); `plan` the pair's and ties
plans within the paired band (jaxpar/planning/planner.py: `tie_band`). A band is a
record of past predictions, not a guarantee: runs of other models, scales and stacks may fall outside it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import statistics

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


# ---- regimes: where the out-of-sample errors of like layouts lie ----------------------------------------

REGIME_MIN_RUNS = 8            # fewer published runs in a regime: "no calibrating run"
REGIME_QUANTILES = (0.1, 0.9)  # the band: the 10th to the 90th percentile of the regime's out-of-sample errors
PRECISION = {"float8": "fp8", "bfloat16": "bf16", "float32": "fp32"}


def regime(software: str, family: str, dtype: str, sizes: dict[str, int], moe: bool) -> str:
    """The regime a layout's error is banded in, as one name: the stack, the hardware family and the compute
    precision, and each of pipeline >= 16 stages, context >= 8, a mixture of experts and more than 1,024
    devices that holds ("megatron-core h100-sxm fp8 PP>=16")."""
    flags = [("PP>=16", sizes.get("pipeline", 1) >= 16), ("CP>=8", sizes.get("context", 1) >= 8), ("MoE", moe),
             (">1024 devices", math.prod(sizes.values()) > 1024)]
    return " ".join([software, family, PRECISION.get(dtype, dtype)] + [name for name, holds in flags if holds])


@dataclasses.dataclass(frozen=True)
class RegimeBand:
    regime: str
    count: int                     # published runs in the regime, each predicted out of sample
    low: float | None = None       # the 10th and 90th percentile of predicted / published - 1 (None: < 8 runs)
    high: float | None = None
    coverage: float | None = None  # share of the runs inside the band the other sources' runs give (None: too few)

    def to_json(self) -> dict | None:
        """`estimate --json`'s `band`: the regime's interval and count, or None where no run calibrates it."""
        if self.low is None:
            return None
        return {"regime": self.regime, "low": self.low, "high": self.high, "count": self.count}

    def describe(self) -> str:
        if self.low is None:
            return (f"regime {self.regime}: no calibrating run ({self.count} published run"
                    f"{'s' if self.count != 1 else ''} in it, fewer than {REGIME_MIN_RUNS})")
        return (f"regime {self.regime}: {self.low:+.1%} to {self.high:+.1%} (10th to 90th percentile of "
                f"{self.count} published runs' errors, out of sample; jaxpar/cost/band.py)")


def quantile_band(errors: list[float]) -> tuple[float, float] | None:
    """(10th, 90th percentile) of `errors`, or None below REGIME_MIN_RUNS."""
    if len(errors) < REGIME_MIN_RUNS:
        return None
    deciles = statistics.quantiles(errors, n=10, method="inclusive")
    return round(deciles[0], 4), round(deciles[-1], 4)


@functools.cache
def _table() -> dict:
    """bands.toml's top-level tables ({} when the file is absent)."""
    return read_toml(BANDS, "bands") if BANDS.exists() else {}


@functools.cache
def regime_bands() -> dict[str, RegimeBand]:
    """{regime: RegimeBand} from bands.toml's [[regime]] tables."""
    return {r["regime"]: RegimeBand(r["regime"], int(r["count"]), r.get("low"), r.get("high"), r.get("coverage"))
            for r in _table().get("regime", [])}


def regime_band(name: str) -> RegimeBand:
    """The band of regime `name`: its record, or a count of 0 where no published run falls in it."""
    return regime_bands().get(name, RegimeBand(name, 0))


@functools.cache
def bands() -> dict[tuple[str, str], Band]:
    """{(family, software): Band} from bands.toml (empty when the file is absent)."""
    out = {}
    for row in _table().get("band", []):
        oos = (float(row["oos_median"]), float(row["oos_worst"])) if "oos_median" in row else (None, None)
        b = Band(row["family"], row["software"], int(row["runs"]), float(row["median"]), float(row["worst"]), *oos)
        out[b.family, b.software] = b
    return out


# ---- pairs: how well the model tells two layouts apart ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PairedBand:
    pairs: int                  # pairs of published layouts of one model on one machine, from one source
    sources: int                # the sources they come from
    low: float | None = None    # 10th and 90th percentile of predicted ratio / published ratio - 1, both
    high: float | None = None   # orders of each pair (None: fewer than REGIME_MIN_RUNS pairs)

    def describe(self) -> str:
        if self.high is None:
            return f"paired band: none ({self.pairs} published layout pairs, fewer than {REGIME_MIN_RUNS})"
        return (f"paired band: {self.low:+.1%} to {self.high:+.1%} (10th to 90th percentile of the error of "
                f"the ratio of two layouts' speeds, over {self.pairs} published pairs from {self.sources} sources, "
                "out of sample; jaxpar/cost/band.py)")


def paired_errors(pairs: list[tuple[float, float, float, float]]) -> list[float]:
    """Each (predicted a, predicted b, published a, published b) as the error of its ratio, in both orders."""
    out = []
    for pa, pb, qa, qb in pairs:
        e = math.log(pa / pb) - math.log(qa / qb)
        out += [math.expm1(e), math.expm1(-e)]
    return out


@functools.cache
def paired_band() -> PairedBand:
    """bands.toml's [paired] table (no pairs when the file or the table is absent)."""
    row = _table().get("paired", {})
    return PairedBand(int(row.get("pairs", 0)), int(row.get("sources", 0)), row.get("low"), row.get("high"))


def band_for(family: str, software: str) -> Band | None:
    return bands().get((family, software))


def describe(family: str, software: str) -> str:
    """One line for a report: the band of (family, software), or that there is none."""
    b = band_for(family, software)
    if b is None:
        return f"error band: none (no published {software} run on {family} in the calibration)"
    return f"error band: {b.describe()} (jaxpar/cost/band.py)"


def to_toml(rows: list[Band], regimes: list[RegimeBand] = (), paired: PairedBand | None = None) -> str:
    """bands.toml's text for `rows`, `regimes` and `paired` (experiments/study_stacks.py writes it)."""
    head = ("# Written by experiments/study_stacks.py --write-bands: the cost model's residuals on the published\n"
            "# runs of jaxpar/cost/published/ (published_runs_stacks), per hardware family and stack (jaxpar/cost/band.py).\n")
    def oos(b: Band) -> str:
        return "" if b.oos_median is None else f"oos_median = {b.oos_median:.4f}\noos_worst = {b.oos_worst:.4f}\n"
    body = "".join(f'\n[[band]]\nfamily = "{b.family}"\nsoftware = "{b.software}"\nruns = {b.runs}\n'
                   f"median = {b.median:.4f}\nworst = {b.worst:.4f}\n{oos(b)}" for b in rows)
    def fields(r: RegimeBand) -> str:
        return "".join(f"{k} = {getattr(r, k):.4f}\n" for k in ("low", "high", "coverage") if getattr(r, k) is not None)
    regimes_text = "".join(f'\n[[regime]]\nregime = "{r.regime}"\ncount = {r.count}\n{fields(r)}' for r in regimes)
    pair_text = "" if paired is None else (f"\n[paired]\npairs = {paired.pairs}\nsources = {paired.sources}\n"
                                           + "".join(f"{k} = {getattr(paired, k):.4f}\n" for k in ("low", "high")
                                                     if getattr(paired, k) is not None))
    return head + body + regimes_text + pair_text
