"""Random distributions of workload parameters (pydantic models, YAML-ready).

Each model draws one value per ``sample(rng)`` from the ``random.Random`` it is given; none keeps
state or touches global randomness. In YAML a bare number means a constant (see :data:`Dist`).
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

__all__ = ["STRICT", "Constant", "LogNormal", "Uniform", "Choice", "Dist"]

#: Unknown keys are errors and parsed values never change.
STRICT = ConfigDict(extra="forbid", frozen=True)


class Constant(BaseModel):
    model_config = STRICT
    dist: Literal["constant"] = "constant"
    value: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.value


class LogNormal(BaseModel):
    """Log-normal given by its median and 90th percentile, clipped to [min, max]."""

    model_config = STRICT
    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    p90: float = Field(gt=0)
    min: float = Field(default=0.0, ge=0)
    max: float | None = None

    @model_validator(mode="after")
    def _check(self) -> "LogNormal":
        if self.p90 < self.median:
            raise ValueError(f"p90 ({self.p90}) must be >= median ({self.median})")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / 1.2815515655446004  # z(0.9)

    def sample(self, rng: random.Random) -> float:
        x = rng.lognormvariate(math.log(self.median), self.sigma)
        x = max(self.min, x)
        return x if self.max is None else min(self.max, x)


class Uniform(BaseModel):
    model_config = STRICT
    dist: Literal["uniform"] = "uniform"
    low: float = Field(ge=0)
    high: float = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> "Uniform":
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


class Choice(BaseModel):
    model_config = STRICT
    dist: Literal["choice"] = "choice"
    values: list[float] = Field(min_length=1)
    weights: list[float] | None = None

    @model_validator(mode="after")
    def _check(self) -> "Choice":
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise ValueError("weights must have as many entries as values")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError("weights must be >= 0 with a positive sum")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.choices(self.values, weights=self.weights)[0]


def _scalar_to_constant(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"dist": "constant", "value": v}
    return v


#: A distribution; a bare number in YAML means a constant.
Dist = Annotated[
    Union[Constant, LogNormal, Uniform, Choice],
    BeforeValidator(_scalar_to_constant),
    Field(discriminator="dist"),
]
