"""Per-row LoRA inside one forward: each row of a step batch adds its own adapters' low-rank
deltas to the shared base output.

For a module ``y = W x`` (run once for every row), rows are grouped by (slot, scale): each
group of rows ``G`` sharing adapter slot ``s`` at request scale ``w`` gets
``y[G] += w * B_s (A_s x[G])`` (``B_s`` already holds PEFT's ``scaling``): two thin matmuls per
group, the second accumulated into ``y`` in place (``addmm_``, ``index_add_``). A row with
several adapters is in several groups; a row without any is in none and costs nothing. This is
the segmented grouped matmul of Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving")
and S-LoRA (Sheng et al. 2023), written with PyTorch matmuls: a diffusion row is a whole image
(thousands of tokens), so each group's matmul is already large.

Slots are fixed-size (`LoraModuleSlots`: ``max_loras`` x ``max_rank``, ranks zero-padded), so
putting a new adapter into a slot is a copy into existing tensors. Under ``torch.compile`` the
hook calls one opaque custom op (``diffserve::lora_rows_``) that reads the current plan and the
module's slots at run time: graphs see neither, so a new adapter, a new mix of adapters or new
scales never recompile; the graph only depends on whether LoRA rows exist at all (two
variants).

Rows: each request's adapters are its row data ``"loras"`` (`diffserve.pipelines.row_data`),
laid out per forward row (branch-major) by collation; a plan is made for the step batch's rows.
A forward over part of the rows (TeaCache's computing requests, CFG parallelism's share) narrows
the forward context, and the hooks follow it (`LoraSwitch.current`).
Modules whose input has ``k`` rows per batch row (e.g. per-token timestep embeddings flattened to
``rows * tokens``) get the plan stretched row-major; a plan whose rows all carry the same
adapters applies to any number of rows (text encoders encoding several texts for one request).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffserve.pipelines.row_data import current_rows

#: The row-data key of a request's LoRA adapters (its `RowLoras`).
ROW_KEY = "loras"

#: A row's adapters: sorted ``(slot, scale)`` pairs (empty: no LoRA).
RowLoras = tuple[tuple[int, float], ...]

#: A group whose rows form more contiguous runs than this is gathered (``index_select``) and
#: scattered back (``index_add_``) instead of being computed run by run on slices.
MAX_RUNS = 4
#: With more (slot, scale) groups than this, a linear module computes every LoRA row at once:
#: each row's factors are gathered from the slots and two batched matmuls (``bmm``) run over
#: all of them (Punica's BGMV; ranks padded to the batch's largest), instead of two matmuls
#: per group. A diffusion row carries thousands of tokens, so gathering its (r, in) factors
#: costs a small fraction of reading its input. (Measured on CPU, 32 rows: grouped matmuls on
#: row slices were faster up to 4 adapters, the batched ones at 16; benchmarks/lora.py.)
MAX_GROUPS = 4


class LoraRowsError(RuntimeError):
    """A LoRA module saw an input whose rows cannot be mapped to the step batch's rows (e.g.
    one shared row for a batch whose rows carry different adapters). The runner then retries
    the batch's requests one forward each."""


@dataclass(frozen=True)
class LoraGroup:
    """Rows sharing one adapter slot at one scale.

    Attributes:
        slot: the adapter's slot.
        scale: the requests' scale for it (diffusers' ``set_adapters`` weight).
        runs: the rows as contiguous ``[lo, hi)`` runs.
        index: (rows,) int64 on the device when there are more than `MAX_RUNS` runs, else None.
    """

    slot: int
    scale: float
    runs: tuple[tuple[int, int], ...]
    index: torch.Tensor | None


class LoraPlan:
    """Which rows add which slot's delta at which scale, for one forward.

    Args:
        rows: each row's `RowLoras` (the forward's row order).
        device: where gather indices live.
    """

    def __init__(self, rows: Sequence[RowLoras], device: torch.device | str = "cpu"):
        self.rows = tuple(rows)
        self.device = torch.device(device)
        self.num_rows = len(self.rows)
        self.uniform = len(set(self.rows)) <= 1
        members: dict[tuple[int, float], list[int]] = {}
        for i, pairs in enumerate(self.rows):
            for pair in pairs:
                members.setdefault(pair, []).append(i)
        self.groups = [self._group(slot, scale, at) for (slot, scale), at in members.items()]
        self.slots = sorted({slot for slot, _ in members})
        self._stretched: dict[int, LoraPlan] = {}
        self._pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.dense = False
        self.unit_scales = False

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (row, adapter) pair, by row: rows (P,) int64, slots (P,) int64 and scales (P,)
        float32, on the device (built once per plan)."""
        if self._pairs is None:
            pairs = sorted((i, slot, scale) for i, row in enumerate(self.rows) for slot, scale in row)
            self._pairs = (torch.tensor([p[0] for p in pairs], dtype=torch.long).to(self.device, non_blocking=True),
                           torch.tensor([p[1] for p in pairs], dtype=torch.long).to(self.device, non_blocking=True),
                           torch.tensor([p[2] for p in pairs], dtype=torch.float32).to(self.device, non_blocking=True))
            #: every row has exactly one adapter: pair i is row i (no gather, no scatter)
            self.dense = [p[0] for p in pairs] == list(range(self.num_rows))
            self.unit_scales = all(p[2] == 1.0 for p in pairs)
        return self._pairs

    def _group(self, slot: int, scale: float, rows: list[int]) -> LoraGroup:
        runs: list[list[int]] = []
        for i in rows:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        index = None
        if len(runs) > MAX_RUNS:
            index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return LoraGroup(slot, scale, tuple((lo, hi) for lo, hi in runs), index)

    @property
    def active(self) -> bool:
        """Whether any row has an adapter."""
        return bool(self.groups)

    def for_leading(self, n: int) -> "LoraPlan":
        """This plan for a module input with `n` leading rows: itself when ``n`` is the plan's
        row count; each row repeated ``n / rows`` times (row-major) when ``n`` is a multiple;
        any ``n`` when every row carries the same adapters.

        Raises:
            LoraRowsError: none of these holds.
        """
        if n == self.num_rows:
            return self
        plan = self._stretched.get(n)
        if plan is None:
            if self.num_rows and n % self.num_rows == 0:
                k = n // self.num_rows
                plan = LoraPlan([r for r in self.rows for _ in range(k)], self.device)
            elif self.uniform and self.num_rows:
                plan = LoraPlan([self.rows[0]] * n, self.device)
            else:
                raise LoraRowsError(f"a LoRA module's input has {n} rows for a step batch of {self.num_rows} rows "
                                    "with different adapters")
            self._stretched[n] = plan
        return plan

    def select(self, rows: Sequence[int]) -> "LoraPlan":
        """The plan of a forward over `rows` of this one (in that order)."""
        return LoraPlan([self.rows[i] for i in rows], self.device)


class LoraSwitch:
    """The plan in force for one group of modules (the denoiser's, or the text encoders'),
    set around their forward by `use`. ``active`` is what compiled graphs branch on."""

    def __init__(self) -> None:
        self.plan: LoraPlan | None = None
        self.active = False
        self._lock = threading.RLock()
        #: the last forward context seen by `current` and its plan
        self._context = None
        self._context_plan: LoraPlan | None = None

    @contextmanager
    def use(self, plan: LoraPlan | None) -> Iterator[None]:
        """Within the block, the hooked modules add `plan`'s deltas (nothing when None or
        without LoRA rows). Not re-entrant across threads: one forward at a time per switch."""
        with self._lock:
            previous = self.plan, self.active
            self.plan, self.active = (plan, True) if plan is not None and plan.active else (None, False)
            try:
                yield
            finally:
                self.plan, self.active = previous

    def current(self) -> LoraPlan | None:
        """The plan of the forward running now: `plan`, or, inside a forward over part of the
        batch's rows (a narrowed forward context holding other ``"loras"`` rows), the plan of
        those rows (built once per narrowed context)."""
        plan = self.plan
        if plan is None:
            return None
        rows = current_rows()
        loras = rows.get(ROW_KEY) if rows else None
        if loras is None:
            return plan
        if rows is self._context:
            return self._context_plan
        if len(loras) == plan.num_rows and tuple(r or () for r in loras) == plan.rows:
            narrowed = plan
        else:
            narrowed = LoraPlan([r or () for r in loras], plan.device)
        self._context, self._context_plan = rows, narrowed
        return narrowed


class LoraModuleSlots:
    """The device slots of one adapted module: the factors of up to ``num_slots`` adapters,
    ranks zero-padded to ``max_rank`` (allocated at the first write).

    Tensors (model dtype, model device): ``a`` (S, max_rank, in, *kernel), ``b`` (S, out,
    max_rank, 1, ...) holding ``scaling * B``, ``bias`` (S, out) holding ``scaling * bias`` (only
    once an adapter with a LoRA bias was written). ``ranks[s]`` is slot ``s``'s rank, 0 = empty.
    """

    def __init__(self, module: torch.nn.Module, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.module = module
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.ranks = [0] * num_slots
        self.has_bias = [False] * num_slots
        self.stride: tuple[int, ...] | None = None
        self.padding = None
        self.conv = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.bias) if t is not None)

    @torch.inference_mode()
    def write(self, slot: int, m) -> None:
        """Put `m` (a `LoraModule`, or None to empty the slot) into `slot` (slots are inference
        tensors: written and read only in inference mode)."""
        if m is None:  # zeroed: the batched path reads whole slots
            if self.a is not None:
                self.a[slot].zero_()
                self.b[slot].zero_()
            if self.bias is not None:
                self.bias[slot].zero_()
            self.ranks[slot] = 0
            self.has_bias[slot] = False
            return
        r = m.rank
        if r > self.max_rank:
            raise ValueError(f"rank {r} exceeds max_lora_rank {self.max_rank}")
        if self.a is None:
            self.a = torch.zeros((self.num_slots, self.max_rank, *m.a.shape[1:]), dtype=self.dtype, device=self.device)
            self.b = torch.zeros((self.num_slots, m.b.shape[0], self.max_rank, *m.b.shape[2:]), dtype=self.dtype,
                                 device=self.device)
            if m.is_conv:
                self.stride, self.padding = m.stride, m.padding
                self.conv = (F.conv1d, F.conv2d, F.conv3d)[m.a.dim() - 3]
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :r].copy_(m.a.to(self.dtype), non_blocking=True)
        self.b[slot, :, :r].copy_((m.b.float() * m.scaling).to(self.dtype), non_blocking=True)
        if m.bias is not None:
            if self.bias is None:
                self.bias = torch.zeros((self.num_slots, m.b.shape[0]), dtype=self.dtype, device=self.device)
            self.bias[slot].copy_((m.bias.float() * m.scaling).to(self.dtype), non_blocking=True)
        self.has_bias[slot] = m.bias is not None
        self.ranks[slot] = r

    def add(self, out: torch.Tensor, x: torch.Tensor, plan: LoraPlan) -> None:
        """``out += `` each group's delta (in place; `out` is the module's output for input `x`)."""
        n = x.shape[0]
        plan = plan.for_leading(n)
        if len(plan.groups) > MAX_GROUPS and self.conv is None:
            self._add_batched(out, x, plan)
            return
        for group in plan.groups:
            r = self.ranks[group.slot]
            if not r:
                continue
            s = group.slot
            a, b = self.a[s, :r], self.b[s, :, :r]
            bias = self.bias[s] if self.has_bias[s] else None
            if group.index is None:
                for lo, hi in group.runs:
                    whole = lo == 0 and hi == n
                    self._add(out if whole else out[lo:hi], x if whole else x[lo:hi], a, b, bias, group.scale)
            else:
                delta = self._delta(x.index_select(0, group.index), a, b, bias)
                out.index_add_(0, group.index, delta.to(out.dtype), alpha=group.scale)

    def _add_batched(self, out: torch.Tensor, x: torch.Tensor, plan: LoraPlan) -> None:
        """All LoRA rows in two batched matmuls: factors gathered per (row, adapter) pair
        (scales folded into ``B``), ranks padded to the largest rank among the plan's slots
        (empty slots hold zeros). When every row has exactly one adapter the rows are used in
        place and the second matmul accumulates straight into `out` (``baddbmm_``); otherwise
        the LoRA rows are gathered and their deltas scattered back (``index_add_``)."""
        r = max(self.ranks[s] for s in plan.slots)
        if not r:
            return
        rows, slots, scales = plan.pairs()
        p = rows.shape[0]
        a = self.a.index_select(0, slots)[:, :r]  # (P, r, in)
        b = self.b.index_select(0, slots)[:, :, :r]  # (P, out, r)
        if not plan.unit_scales:
            b = b * scales.to(b.dtype).view(p, 1, 1)
        if plan.dense and out.is_contiguous() and out.dtype == a.dtype:
            h = torch.bmm(x.to(a.dtype).reshape(p, -1, x.shape[-1]), a.transpose(1, 2))  # (P, T, r)
            out.view(p, -1, out.shape[-1]).baddbmm_(h, b.transpose(1, 2))
        else:
            xs = x.index_select(0, rows).to(a.dtype).reshape(p, -1, x.shape[-1])  # (P, T, in)
            delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))  # (P, T, out)
            out.index_add_(0, rows, delta.reshape(p, *out.shape[1:]).to(out.dtype))
        if self.bias is not None:
            bias = self.bias.index_select(0, slots).mul(scales.to(a.dtype).view(p, 1))  # (P, out)
            shape = (p,) + (1,) * (out.dim() - 2) + (out.shape[-1],)
            out.index_add_(0, rows, bias.view(shape).expand(p, *out.shape[1:]).to(out.dtype))

    def _delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.to(a.dtype)
        if self.conv is None:
            d = F.linear(F.linear(x, a), b, bias)
        else:
            d = self.conv(self.conv(x, a, None, self.stride, self.padding), b, bias)
        return d

    def _add(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             bias: torch.Tensor | None, scale: float) -> None:
        if self.conv is None and out.dtype == a.dtype and out.is_contiguous():
            h = F.linear(x.to(a.dtype), a)
            out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.t(), alpha=scale)
            if bias is not None:
                out.add_(bias, alpha=scale)
        else:
            out.add_(self._delta(x, a, b, bias).to(out.dtype), alpha=scale)


# ----------------------------------------------------------------------------- hooks
#: hooked modules by key: (slots, switch); read by the custom op at run time
_HOOKED: dict[int, tuple[LoraModuleSlots, LoraSwitch]] = {}
_KEYS = itertools.count()


@torch.library.custom_op("diffserve::lora_rows_", mutates_args=("out",))
def _lora_rows_op(out: torch.Tensor, x: torch.Tensor, key: int) -> None:
    """``out += `` the per-row LoRA deltas of hooked module `key` for input `x` under the
    current plan (what compiled graphs call: opaque, so plans and slots never recompile)."""
    slots, switch = _HOOKED[key]
    plan = switch.current()
    if plan is not None:
        slots.add(out, x, plan)


@_lora_rows_op.register_fake
def _(out: torch.Tensor, x: torch.Tensor, key: int) -> None:
    return None


def install_hook(slots: LoraModuleSlots, switch: LoraSwitch) -> torch.utils.hooks.RemovableHandle:
    """Hook `slots.module` so that its output gets the per-row deltas of `switch`'s plan.
    Eager forwards call `LoraModuleSlots.add` directly; compiled ones the custom op."""
    key = next(_KEYS)
    _HOOKED[key] = (slots, switch)

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor):
        if not switch.active:
            return None
        if torch.compiler.is_compiling():
            torch.ops.diffserve.lora_rows_(out, args[0], key)
        else:
            plan = switch.current()
            if plan is not None:
                slots.add(out, args[0], plan)
        return out

    handle = slots.module.register_forward_hook(hook)
    original_remove = handle.remove

    def remove() -> None:
        original_remove()
        _HOOKED.pop(key, None)

    handle.remove = remove
    return handle


class PlanCache:
    """The last few plans by their rows (a step batch repeats its rows every step)."""

    def __init__(self, size: int = 16):
        self.size = size
        self._plans: OrderedDict[tuple, LoraPlan] = OrderedDict()

    def get(self, rows: Sequence[RowLoras], device: torch.device) -> LoraPlan:
        key = tuple(rows)
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = LoraPlan(key, device)
        self._plans[key] = plan
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        self._plans.clear()
