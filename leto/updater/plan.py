"""Cut the flat parameter space into chunks and find the state bytes each chunk touches.

Parameters are numbered in optimizer order and laid end to end (the *flat parameter
space*). Chunk ``j`` is elements ``[j*E, (j+1)*E)`` of it, which may cover the tail of one
parameter and the head of the next. For AdamW, element range ``[a, b)`` of a parameter
touches the same range of its ``param``, ``exp_avg`` and ``exp_avg_sq`` slots; its scalar
``step`` counter is advanced by the chunk holding the parameter's element 0 (later chunks
of the same parameter read the advanced value). The last chunk also installs the RNG state
saved after the step's compute.

Under the ``torch`` rule (any other optimizer: its own ``step()`` runs per chunk) a chunk
holds whole parameters, consecutive ones while their bytes fit ``chunk_bytes``, a larger
parameter alone; its spans are each parameter's param slot and every state slot.

Each chunk's byte spans are rounded out to ``align`` bytes (the 2 KiB tile of the erasure
code, so a span's old and new bytes can be folded into parity directly) and merged so they
are disjoint: a byte that two spans would share must enter the parity delta once.
Bytes a span covers but the optimizer does not write are unchanged, so their delta is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from leto.errors import ConfigError
from leto.retained.layout import Layout
from leto.retained.slot import element_size


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[lo, hi)`` of parameter ``param`` (index into ``Layout.params``)."""

    param: int
    lo: int
    hi: int

    @property
    def owns_step(self) -> bool:
        """This piece advances the parameter's step counter (it holds element 0)."""
        return self.lo == 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """One transaction of the update: its pieces and the state-region bytes they touch."""

    index: int
    pieces: tuple[Piece, ...]
    spans: tuple[tuple[int, int], ...]
    """Disjoint, sorted ``(offset, nbytes)`` ranges of the state region."""
    installs_rng: bool

    @property
    def undo_bytes(self) -> int:
        return sum(n for _, n in self.spans)


def plan_chunks(layout: Layout, chunk_bytes: int, align: int, region_bytes: int) -> list[Chunk]:
    """The chunks of one update (at least one: the RNG install needs a transaction)."""
    if layout.rule.kind == "torch":
        return _whole_parameter_chunks(layout, chunk_bytes, align, region_bytes)
    dtypes = {s.dtype for s in layout.params}
    if len(dtypes) > 1:
        raise ConfigError(
            f"consistency: rmu needs one parameter dtype, got {sorted(map(str, dtypes))}; "
            "use consistency: snapshot"
        )
    itemsize = element_size(layout.params[0].dtype) if layout.params else 4
    per_chunk = max(1, chunk_bytes // itemsize)
    sizes = [_numel(s.shape) for s in layout.params]
    total = sum(sizes)
    count = max(1, -(-total // per_chunk))
    chunks: list[Chunk] = []
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for j in range(count):
        a, b = j * per_chunk, min(total, (j + 1) * per_chunk)
        pieces = tuple(
            Piece(i, max(a, s) - s, min(b, s + n) - s)
            for i, (s, n) in enumerate(zip(starts, sizes, strict=True))
            if n and s < b and a < s + n
        )
        raw: list[tuple[int, int]] = []
        for p in pieces:
            slots = [
                layout.params[p.param],
                layout.optim[p.param]["exp_avg"],
                layout.optim[p.param]["exp_avg_sq"],
            ]
            raw += [(s.offset + p.lo * itemsize, (p.hi - p.lo) * itemsize) for s in slots]
            if p.owns_step:
                step = layout.optim[p.param]["step"]
                raw.append((step.offset, step.nbytes))
        last = j == count - 1
        if last:
            raw.append((layout.rng.offset, layout.rng.nbytes))
        chunks.append(Chunk(j, pieces, _merge(raw, align, region_bytes), last))
    return chunks


def _whole_parameter_chunks(
    layout: Layout, chunk_bytes: int, align: int, region_bytes: int
) -> list[Chunk]:
    if not layout.rule.separable:
        raise ConfigError(
            f"consistency: rmu steps the optimizer one chunk of parameters at a time, but "
            f"{layout.rule.reason}; use consistency: snapshot"
        )
    members: list[list[int]] = [[]]
    size = 0
    for i, s in enumerate(layout.params):
        if members[-1] and size + s.nbytes > chunk_bytes:
            members.append([])
            size = 0
        members[-1].append(i)
        size += s.nbytes
    chunks = []
    for j, group in enumerate(members):
        raw = [
            (s.offset, s.nbytes)
            for i in group
            for s in (layout.params[i], *layout.optim[i].values())
            if s.nbytes
        ]
        last = j == len(members) - 1
        if last:
            raw.append((layout.rng.offset, layout.rng.nbytes))
        pieces = tuple(Piece(i, 0, _numel(layout.params[i].shape)) for i in group)
        chunks.append(Chunk(j, pieces, _merge(raw, align, region_bytes), last))
    return chunks


def _merge(spans: list[tuple[int, int]], align: int, limit: int) -> tuple[tuple[int, int], ...]:
    """Round spans out to ``align`` and merge overlapping or touching ones."""
    out: list[list[int]] = []
    for off, n in sorted(spans):
        lo, hi = off // align * align, min(limit, -(-(off + n) // align) * align)
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi - lo) for lo, hi in out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
