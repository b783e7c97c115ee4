"""Test matrices (spec §6, §7) as data: cells, grids that expand into cells, golden sets.

A matrix file is YAML, validated here (`calculet-load schema matrix`):

    schema: calculet-matrix/v1
    name: smoke
    repetitions: 30              # measured requests per cell (spec §8: >= 30)
    short_repetitions: 100       # ... for short cells (spec §8: >= 100)
                                 # (a burst cell sends size × rounds: its repetitions)
    cells:
      - {name: single-128-32, kind: single, prompt_tokens: 128, max_tokens: 32}
      - {kind: single, grid: {prompt_tokens: [128, 1024], max_tokens: [1, 32, 256],
                              temperature: [0.0, 0.7], stream: [true, false]}}
      - {name: closed-c4, kind: closed, concurrency: 4, prompt_tokens: 128, max_tokens: 32}
      - {name: poisson-1, kind: open, arrival: poisson, rate: 1.0, mix: mixed-70-20-10}
      - {name: burst-8, kind: burst, size: 8, rounds: 5, prompt_tokens: 128, max_tokens: 32}
      - {name: boundary-40959, kind: boundary, prompt_tokens: 40959, max_tokens: 2}

A `grid` expands to one cell per combination, named from its values. A `boundary` cell is
judged by the target's rejection/truncation policy, never as a performance cell: its
name starts with "boundary" (and no other cell's does), which is how the acceptance
rule `boundary_policy` finds it in the records.

A batch matrix (spec §7: B4/B8/B16 each measured at active lanes 1..B) declares the
artifact it is for with `compiled_batch: B`; `accept` then requires the manifest's `batch`
section (the vendor's statement of how lanes that are not filled are handled) to name
the same B, and the target's /admin/state, when it reports one, to serve it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from calculet_load.configfile import read_yaml, validate

MATRIX_SCHEMA = "calculet-matrix/v1"
SHORT_PROMPT = 512  # a cell is "short" (spec §8: 100 repetitions) at or below these sizes
SHORT_OUTPUT = 32
MIN_REPETITIONS = 30  # spec §8.6: at least 30 repetitions per case ...
MIN_SHORT_REPETITIONS = 100  # ... and 100 for short cases


class MatrixError(ValueError):
    """The matrix is invalid; `str()` is one line naming the file and the field."""


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = ""
    kind: Literal["single", "closed", "open", "burst", "boundary"]
    prompt_tokens: int = Field(default=128, ge=1, le=40959)
    max_tokens: int = Field(default=32, ge=1, le=1 << 20)
    temperature: float = Field(default=0.0, ge=0, le=100)
    stream: bool = True
    concurrency: int = Field(default=1, ge=1, le=100_000)
    arrival: Literal["poisson", "constant", "gamma"] = "poisson"
    rate: float = Field(default=1.0, gt=0, le=1e6)
    burstiness: float = Field(default=1.0, gt=0, le=1e6)
    mix: str | None = None
    size: int = Field(
        default=8, ge=1, le=100_000, description="burst: requests fired at one instant"
    )
    rounds: int = Field(default=5, ge=1, le=100_000, description="burst: how many bursts")
    repetitions: int | None = Field(
        default=None, ge=1, le=1_000_000, description="override per cell"
    )
    max_in_flight: int = Field(default=256, ge=1, le=100_000)
    grid: dict[str, list[Any]] | None = None

    @property
    def short(self) -> bool:
        return self.prompt_tokens <= SHORT_PROMPT and self.max_tokens <= SHORT_OUTPUT

    @property
    def sampling(self) -> str:
        return "greedy" if self.temperature == 0 else "seeded"


class Matrix(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["calculet-matrix/v1"] = Field(default="calculet-matrix/v1", alias="schema")
    name: str = Field(min_length=1)
    description: str = ""
    repetitions: int = Field(default=30, ge=1, le=1_000_000)
    short_repetitions: int = Field(default=100, ge=1, le=1_000_000)
    compiled_batch: int | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="spec §7: the compiled batch B of the calbin this matrix measures "
        "(active lanes 1..B); accept requires the manifest's batch section to match",
    )
    cells: list[Cell] = Field(min_length=1)

    @model_validator(mode="after")
    def _expand_and_check(self) -> Matrix:
        cells = self.expanded()
        names = [c.name for c in cells]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"cells: duplicate cell names {dupes}")
        # the analysis finds boundary cells by name (acceptance rule boundary_policy)
        wrong = [c.name for c in cells if (c.kind == "boundary") != c.name.startswith("boundary")]
        if wrong:
            raise ValueError(
                f"cells: {wrong}: a boundary cell's name starts with 'boundary', and only "
                "a boundary cell's does (the acceptance rules judge such cells by name)"
            )
        return self

    def expanded(self) -> list[Cell]:
        """Grids expanded; every cell named."""
        out: list[Cell] = []
        for cell in self.cells:
            if cell.grid is None:
                out.append(cell if cell.name else cell.model_copy(update={"name": _name(cell)}))
                continue
            keys = sorted(cell.grid)
            for values in itertools.product(*(cell.grid[k] for k in keys)):
                fields = {
                    **cell.model_dump(exclude={"grid", "name"}),
                    **dict(zip(keys, values, strict=True)),
                }
                c = Cell.model_validate(fields)
                prefix = f"{cell.name}-" if cell.name else ""
                out.append(c.model_copy(update={"name": prefix + _name(c)}))
        return out

    def repetitions_for(self, cell: Cell) -> int:
        """The requests the cell sends: a burst cell's `size` × `rounds`; otherwise its own
        `repetitions`, else the matrix's (`short_repetitions` for a short cell)."""
        if cell.kind == "burst":
            return cell.size * cell.rounds
        if cell.repetitions is not None:
            return cell.repetitions
        return self.short_repetitions if cell.short else self.repetitions


def minimum_repetitions(cell: Cell) -> int | None:
    """Spec §8.6: the fewest repetitions an acceptance may give the cell, 100 for a short
    case (prompt <= SHORT_PROMPT and output <= SHORT_OUTPUT tokens) and 30 otherwise;
    None for a boundary cell (a test of the overflow policy, not a measurement)."""
    if cell.kind == "boundary":
        return None
    return MIN_SHORT_REPETITIONS if cell.short else MIN_REPETITIONS


def _name(c: Cell) -> str:
    if c.kind == "closed":
        shape = f"c{c.concurrency}"
    elif c.kind == "open":
        shape = f"{c.arrival}{c.rate:g}"
    elif c.kind == "burst":
        shape = f"burst{c.size}"
    else:
        shape = c.kind
    size = c.mix if c.mix else f"p{c.prompt_tokens}-o{c.max_tokens}"
    extra = ("-seeded" if c.temperature else "") + ("" if c.stream else "-nostream")
    return f"{shape}-{size}{extra}"


def parse_matrix(data: Any, source: str) -> Matrix:
    if not isinstance(data, dict):
        raise MatrixError(f"{source}: top level must be a mapping")
    return validate(Matrix, data, source, MatrixError)


def load_matrix(path: str | Path) -> Matrix:
    return parse_matrix(read_yaml(path, MatrixError), str(path))


def matrix_json_schema() -> dict[str, Any]:
    return Matrix.model_json_schema(by_alias=True)


# ------------------------------------------------------------------ golden sets
class GoldenCase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    prompt_tokens: int = Field(ge=1, le=40959)
    max_tokens: int = Field(ge=1)
    sample: int = Field(default=0, ge=0)
    seed: int | None = None
    temperature: float = Field(default=0.0, ge=0)
    token_hash: str | None = Field(default=None, description="expected; null until recorded")


class GoldenSet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["calculet-golden/v1"] = Field(default="calculet-golden/v1", alias="schema")
    model_alias: str = Field(min_length=1)
    cases: list[GoldenCase] = Field(min_length=1)


def load_golden(path: str | Path) -> GoldenSet:
    return validate(GoldenSet, read_yaml(path, MatrixError), str(path), MatrixError)
