"""The rows of an untied embedding that a step's tokens touched, so that the others are updated before the step's
backward ends.

Why: the embedding's gradient is complete only when the backward ends, and the next forward needs the embedding
first, so its update is the step's boundary: on the GPU its master and moments cross PCIe (10 1/8 bytes an element
each way with the master as planes) while the compute stream waits. A row that no token of the step touched has a
zero gradient, and AdamW's update of it (the moments decayed, the weight decayed and moved by the old moments) does
not depend on the gradient otherwise. So once the step's last backward has begun, the GPU updates the whole table
with a zero gradient (`DeviceUpdater.run_untouched`), beside the backward; the touched rows' old state is gathered
first into pinned staging here, and at the boundary only those rows go up, are updated with their gradient rows,
and come back (`DeviceUpdater.run` then takes the touched rows only; a clipped step's gradient, held on the host
for the norm, has its touched rows gathered there as well). Every element goes through the same elementwise fused
AdamW with the same inputs as a whole-table update: the result is the same, bit for bit.

The staging is reserved after the first training step, whose own buffers then hold their host memory: for the rows
that step touched (all its micro-batches', with accumulation) and a margin of up to a quarter more, holding at most
half the table (beyond, the boundary's share of the update is most of it) and taking at most 1/`RAM_SHARE` of the host
RAM free then; the margin is what those limits leave. Sized by what the data touches, not by the tokens: text's skew
touches far fewer rows than it has tokens (at 65,536 tokens of Llama-3's 128,256 ids, ids drawn with a Zipf law of
exponent 1 touch about 15% of the rows, uniform ids about 40%, whose margin the half then trims). A later step that
touches more rows than it holds grows it on the same terms, on the updater's thread, which alone uses it (the step's
pass has not begun, the last one's put-back is done). The first step, and a step whose rows the staging cannot hold
even grown, update the whole table at the boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lightning_slide.master_halves import LOW_DTYPES, MasterHalves
from lightning_slide.pinned import host_empty, pin_, unpin_
from lightning_slide.streams import Lane, host_wait

MARGIN = 1.25  # staging for up to 5/4 of the rows the first step touched: later steps touch a few more or fewer
CAPACITY_SHARE = 2  # ... holding at most 1/2 of the table's rows
RAM_SHARE = 4  # ... and taking at most 1/4 of the host RAM free after the first step (its own buffers allocated)


class TouchedRows:
    """The touched rows of one embedding unit (`vocab` x `hidden` weight, the unit's only trainable range): a device
    mask that its forwards mark (`see`), sent to the host when the step's last backward begins (`send`), and pinned
    staging for the touched rows' state (`reserve`, `gather`, `scatter`)."""

    def __init__(self, unit: int, vocab: int, hidden: int, device: torch.device, plane_bits: int | None,
                 free_ram: Callable[[], int], held: torch.dtype | None = None) -> None:
        """`free_ram()`: the host bytes free for the staging now. `held`: the dtype a step's gradient waits in on
        the host (clipped steps), whose touched rows the staging gathers too; None where the gradient stays on the
        device (eager steps)."""
        self.unit, self.vocab, self.hidden, self.device, self.plane_bits = unit, vocab, hidden, device, plane_bits
        self.free_ram, self.held = free_ram, held
        self.grads: torch.Tensor | None = None  # staging for the touched rows of a gradient held on the host
        self.mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.host = host_empty(vocab, torch.uint8).view(torch.bool)
        self._mask_pinned = device.type == "cuda" and pin_(self.host)
        self._pinned: list[torch.Tensor] = []  # the staging's locked tensors
        self.capacity = 0  # rows the staging holds (none until `reserve`: nothing is updated ahead)
        self.reserved = False  # once `reserve` succeeded (the staging may grow, never goes: the training thread asks)
        self.staging: list[torch.Tensor] = []  # the fp32 master or its low plane and parities, exp_avg, exp_avg_sq
        self.sent: object = None  # the event after the mask's copy to the host
        # once the untouched rows are updated: ((unit, step), the touched rows, their staged state)
        self.ahead: tuple[tuple[int, int], torch.Tensor, list[torch.Tensor]] | None = None
        self.steps_ahead = 0  # steps whose untouched rows were updated ahead, for the engine's stats
        self.on_device: torch.Tensor | None = None  # the touched rows' indices, while the lanes may read them
        self.underway: object = None  # the updater's pass over the untouched rows, while it is being queued
        # (event, rows, their places, their staged state) until the touched rows are put back in place
        self.back: tuple[object, torch.Tensor, list[_Rows | _ChunkRows], list[torch.Tensor]] | None = None

    def first_touched(self) -> int:
        """How many rows the first step touched: its forwards marked them, and nothing has sent the mask since (one
        device sync, once). The mask then starts again empty, for the next step's rows."""
        touched = int(self.mask.sum())
        self.mask.zero_()
        return touched

    def staging_bytes(self, rows: int) -> int:
        """Pinned bytes of the staging for `rows` touched rows (`reserve`)."""
        held = 0 if self.held is None else self.held.itemsize
        return int(rows * self.hidden * (_row_bytes(self.plane_bits) + held))

    def reserve(self, touched: int) -> str | None:
        """Staging for `touched` rows and a margin: `MARGIN` times as many, or fewer where that would hold more than
        1/`CAPACITY_SHARE` of the table or take more than 1/`RAM_SHARE` of the free host bytes (a smaller staging it
        replaces counting as free). Returns None once reserved, else why not: the touched rows alone pass neither
        limit (a staging reserved before then stays)."""
        share = self.vocab // CAPACITY_SHARE
        if touched > share:
            return f"a step touched {touched} of its {self.vocab} rows, more than 1/{CAPACITY_SHARE} of them"
        affordable = (self.free_ram() + self.staging_bytes(self.capacity)) // RAM_SHARE // self.staging_bytes(1)
        if touched > affordable:
            return (f"staging its {touched} touched rows would take {self.staging_bytes(touched) / 2**30:.2f} GiB, "
                    f"more than 1/{RAM_SHARE} of the free host RAM")
        rows = min(math.ceil(touched * MARGIN), share, affordable)
        self._release_staging()
        self.capacity = rows
        n = rows * self.hidden
        master = [host_empty(n)] if self.plane_bits is None else [
            host_empty(n, LOW_DTYPES[self.plane_bits]), host_empty(n // 8, torch.uint8)]
        self.staging = [*master, host_empty(n), host_empty(n)]
        self.grads = None if self.held is None else host_empty(n, self.held).view(rows, self.hidden)
        locked = [*self.staging, *([] if self.grads is None else [self.grads])]
        self._pinned = [t for t in locked if self.device.type == "cuda" and pin_(t)]
        self.reserved = True
        return None

    def see(self, ids: torch.Tensor) -> None:
        """A training forward looks up `ids` (on the current stream)."""
        self.mask[ids.reshape(-1).to(self.device)] = True

    def send(self, compute: Lane) -> None:
        """The step's tokens are all seen: the mask goes to the host (on `compute`, after the forwards that marked
        it) and starts again empty for the next step."""
        with compute():
            self.host.copy_(self.mask, non_blocking=True)
            self.sent = compute.record()
            self.mask.zero_()

    def touched(self) -> torch.Tensor | None:
        """The sent mask's rows (sorted), or None where the staging cannot hold them, even grown (on the updater's
        thread, before the step's pass gathers anything)."""
        host_wait(self.sent)
        rows = self.host.nonzero().flatten()
        if rows.numel() > self.capacity:
            self.reserve(rows.numel())
        return rows if 0 < rows.numel() <= self.capacity else None

    def gather(self, rows: torch.Tensor, sources: list[_Rows | _ChunkRows]) -> list[torch.Tensor]:
        """`rows` of each source (`rows_of`) into the staging, in order; returns the staged rows."""
        staged = [s[: rows.numel() * self._width(s)].view(rows.numel(), -1) for s in self.staging]
        for source, into in zip(sources, staged):
            source.gather(rows, into)
        return staged

    def scatter(self, rows: torch.Tensor, places: list[_Rows | _ChunkRows], staged: list[torch.Tensor]) -> None:
        """`gather`'s way back: the staged rows into their places."""
        for place, rows_in in zip(places, staged):
            place.scatter(rows, rows_in)

    def _width(self, staging: torch.Tensor) -> int:
        return staging.numel() // self.capacity

    def _release_staging(self) -> None:
        for t in self._pinned:
            unpin_(t)
        self._pinned, self.staging, self.grads, self.capacity = [], [], None, 0

    def close(self) -> None:
        self._release_staging()
        if self._mask_pinned:
            unpin_(self.host)
            self._mask_pinned = False


def _row_bytes(plane_bits: int | None) -> float:
    """Staged bytes per element of a row: the fp32 master (or its low plane and parity bit), both fp32 moments."""
    master = 4 if plane_bits is None else LOW_DTYPES[plane_bits].itemsize + 1 / 8
    return master + 8


class _Rows:
    """Host state viewed as rows (`vocab` x its width per row)."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view

    def gather(self, rows: torch.Tensor, into: torch.Tensor) -> None:
        torch.index_select(self.view, 0, rows, out=into)

    def scatter(self, rows: torch.Tensor, rows_in: torch.Tensor) -> None:
        self.view.index_copy_(0, rows, rows_in)


class _ChunkRows:
    """The low plane of a `MasterHalves` as rows of `hidden` elements: each chunk keeps its weights first and its low
    parts after them (`MasterHalves.pieces`), so a row's low parts are contiguous, but the plane is not one strided
    view; its full chunks are, and the last (shorter) chunk is another."""

    def __init__(self, halves: MasterHalves, hidden: int) -> None:
        n, chunk, size = halves.master.numel(), halves.chunk, halves.low_dtype.itemsize
        data = halves.master.view(torch.uint8)
        full, self.per_chunk = n // chunk, chunk // hidden
        self.full = data[: 4 * full * chunk].view(full, 4 * chunk)[:, 2 * chunk : (2 + size) * chunk]
        self.full = self.full.view(full, self.per_chunk, size * hidden)
        m = n - full * chunk  # the last chunk's elements
        start = 4 * full * chunk + 2 * m
        self.last = data[start : start + size * m].view(m // hidden, size * hidden)
        self.dtype, self.full_rows = halves.low_dtype, full * self.per_chunk

    def _split(self, rows: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        k = int(torch.searchsorted(rows, self.full_rows))  # sorted rows: those of the last chunk come last
        return k, rows[:k] // self.per_chunk, rows[:k] % self.per_chunk, rows[k:] - self.full_rows

    def gather(self, rows: torch.Tensor, into: torch.Tensor) -> None:
        k, chunk, row, last = self._split(rows)
        out = into.view(torch.uint8).view(rows.numel(), -1)
        out[:k] = self.full[chunk, row]
        out[k:] = self.last[last]

    def scatter(self, rows: torch.Tensor, rows_in: torch.Tensor) -> None:
        k, chunk, row, last = self._split(rows)
        data = rows_in.view(torch.uint8).view(rows.numel(), -1)
        self.full[chunk, row] = data[:k]
        self.last[last] = data[k:]


def rows_of(master: torch.Tensor, halves: MasterHalves | None, moments: tuple[torch.Tensor, torch.Tensor],
            hidden: int) -> list[_Rows | _ChunkRows]:
    """The host state of an embedding's rows, in `TouchedRows.staging`'s order: its fp32 master (or, as planes,
    its low plane and parities), then both moments, each indexable by row."""
    vocab = master.numel() // hidden
    masters = [_Rows(master.view(vocab, hidden))] if halves is None else [
        _ChunkRows(halves, hidden), _Rows(halves.parity[: vocab * hidden // 8].view(vocab, hidden // 8))]
    return [*masters, *(_Rows(m.view(vocab, hidden)) for m in moments)]


def applies(chunk: int, hidden: int, plane_bits: int | None) -> bool:
    """Whether rows line up with what the updater moves: buffer sets and planes chunks (`chunk`) of whole rows,
    whole parity bytes per row, and a master kept whole or as 32-bit planes (24-bit planes round with noise drawn
    per element index, which a row's update out of place would not reproduce)."""
    return chunk >= hidden and chunk % hidden == 0 and hidden % 8 == 0 and plane_bits in (None, 32)
