"""The linear-ce kind, main-process side: its cases, its inputs and its judgement.

A fused linear-cross-entropy kernel is the head of the probe model: the hidden states it gets
are the probe model's ``h`` for the batch, and its ``dh`` flows back through the probe body into
the input path.  So the tie is judged as for a model (``dE`` = the kernel's ``dE`` plus the
scatter-add of the input path its ``dh`` implies, against the reference's two paths), and the
kernel's own outputs are judged one by one first: which known bug (a :data:`VARIANTS` entry of
:mod:`kinds.linear_ce.reference`) they match, or which output is wrong.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from tyingspec._src.core import memory
from tyingspec._src.core.adapters import Returned
from tyingspec._src.core.cases import Batch, Case, case_seed, working_dtype
from tyingspec._src.core.diagnosis import Label
from tyingspec._src.core.findings import Finding, failed, passed
from tyingspec._src.core.paths import (
    Array,
    InputPath,
    IntArray,
    OutputPath,
    Paths,
    draw_directions,
    input_path_terms,
    row_block,
    scatter_rows,
    segment_sums,
    two_paths,
)
from tyingspec._src.core.tolerance import (
    SAFETY,
    UNIT_ROUNDOFF,
    Terms,
    Tolerance,
    row_tolerance,
    value_tolerance,
)
from tyingspec._src.kinds.linear_ce.draws import CHUNK as CHUNK
from tyingspec._src.kinds.linear_ce.draws import IGNORE_INDEX as IGNORE_INDEX
from tyingspec._src.kinds.linear_ce.draws import LENGTH_CASES
from tyingspec._src.kinds.linear_ce.draws import OPTION_NAMES as OPTION_NAMES
from tyingspec._src.kinds.linear_ce.draws import REDUCTION_VALUES as REDUCTION_VALUES
from tyingspec._src.kinds.linear_ce.draws import ce_options as ce_options
from tyingspec._src.kinds.linear_ce.draws import drawn_ignore_index as drawn_ignore_index
from tyingspec._src.kinds.linear_ce.draws import with_ce as with_ce
from tyingspec._src.kinds.linear_ce.reference import VARIANTS, CEOptions, CEResult, linear_ce

#: What a kernel declares to be run on a case in a low precision (a torch class does: see
#: ``kinds.linear_ce.adapter.supported``).
LOW_PRECISIONS = ("dtype=bfloat16", "dtype=float16")
#: Where a kernel runs (``--device``): its inputs are moved there, its outputs back to be
#: judged.  Only a torch-form kernel declares ``device=cuda`` (a numpy one takes arrays).
DEVICES = ("cpu", "cuda")


def device_of(setting: str) -> str:
    """The device a case's setting (``--device``) names; ``cpu`` when none."""
    return next((p.partition("=")[2] for p in setting.split(",")
                 if p.partition("=")[0] == "device"), "cpu")


def needed_options(case: Case) -> set[str]:
    """What a kernel must declare to run a case: each option the case sets (a reduction by
    its value, ``reduction=sum``; ``none`` also needs ``grad_output``), ``ignore_index`` for
    ignored tokens, ``bias`` for a case with a bias and ``dtype=bfloat16`` (``float16``) for
    a case in that precision."""
    opts = ce_options(case.ce)
    need = {k for k in opts if k in OPTION_NAMES and k != "reduction"}
    if "reduction" in opts:
        need.add(f"reduction={opts['reduction']}")
        if opts["reduction"] == "none":
            need.add("grad_output")
    if "ignored" in opts:
        need.add("ignore_index")
    if case.bias:
        need.add("bias")
    if f"dtype={case.dtype}" in LOW_PRECISIONS:
        need.add(f"dtype={case.dtype}")
    if device_of(case.setting) != "cpu":
        need.add(f"device={device_of(case.setting)}")
    return need


def restricted(case: Case, supported: Iterable[str]) -> Case:
    """``case`` without the settings that need something the kernel does not declare: what a
    property draws for such a kernel (its cases range over what it supports only; no bias
    for a kernel without one, float32 for one not run in a low precision)."""
    have = set(supported)

    def keep(key: str, value: str) -> bool:
        if key == "reduction":
            return f"reduction={value}" in have and (value != "none" or "grad_output" in have)
        if key == "ignored":
            return "ignore_index" in have
        return key not in OPTION_NAMES or key in have

    kept = [f"{k}={v}" for k, v in ce_options(case.ce).items() if keep(k, v)]
    low = f"dtype={case.dtype}" in LOW_PRECISIONS and f"dtype={case.dtype}" not in have
    return replace(case, ce=",".join(kept), bias=case.bias and "bias" in have,
                   dtype="float32" if low else case.dtype)


def options_of(batch: Batch) -> CEOptions:
    opts = ce_options(batch.ce)
    softcap = opts.get("softcap")
    return CEOptions(
        logit_scale=float(opts.get("logit_scale", 1.0)),
        softcap=None if softcap is None else float(softcap),
        label_smoothing=float(opts.get("label_smoothing", 0.0)),
        lse_square_scale=float(opts.get("lse_square_scale", 0.0)),
        ignore_index=int(opts.get("ignore_index", IGNORE_INDEX)),
        reduction=opts.get("reduction", "mean"),
        ce_weight=None if batch.ce_weight is None else
        tuple(float(w) for w in batch.ce_weight))


def kernel_keywords(batch: Batch) -> dict[str, Any]:
    """The options a kernel is called with: only those the case sets (an adapter that does not
    support one is never handed it, and never judged on a case that needs it)."""
    opts = ce_options(batch.ce)
    out: dict[str, Any] = {}
    for key in ("logit_scale", "softcap", "label_smoothing", "lse_square_scale"):
        if key in opts:
            out[key] = float(opts[key])
    if "reduction" in opts:
        out["reduction"] = opts["reduction"]
    if "ignore_index" in opts:  # set by with_ce for a case with ignored tokens
        out["ignore_index"] = int(opts["ignore_index"])
    if batch.ce_weight is not None:
        out["ce_weight"] = batch.ce_weight
    return out


def body(batch: Batch) -> tuple[Array, Array]:
    """The probe body's forward: h and tanh(x @ W) (what its backward needs)."""
    x = batch.s_in * batch.E[batch.tokens]
    t = np.tanh(x @ batch.W)
    return batch.res * x + t, t


def body_rows(batch: Batch, t: Array, dh: Array) -> Array:
    """The input path's per-position rows for an upstream dh: s_in * dL/dx."""
    dh = np.asarray(dh, dtype=t.dtype)
    dx = batch.res * dh + (dh * (1 - t * t)) @ batch.W.T
    return np.asarray(batch.s_in * dx)


def inputs(batch: Batch) -> dict[str, Any]:
    h, _ = body(batch)
    # in E's own dtype (numpy's bfloat16 arithmetic returns float32 from tanh)
    return {"h": np.asarray(h, dtype=batch.E.dtype), "E": batch.E, "targets": batch.targets,
            "b": batch.b, "options": kernel_keywords(batch), "grad_output": batch.grad_output,
            "device": device_of(batch.setting)}


def _scalar(loss: Any, grad_output: Array | None) -> float:
    arr = np.asarray(loss, dtype=np.float64)
    if arr.ndim == 0:
        return float(arr)
    weights = np.ones(arr.shape) if grad_output is None else np.asarray(grad_output, np.float64)
    return float((weights * arr).sum())


def complete(batch: Batch, inp: dict[str, Any], precision: str,
             returned: Returned) -> tuple[Returned, Paths]:
    """The kernel's outputs judged (findings), and the tie: the returned tied gradient (its dE
    plus the input path its dh implies) with the reference's two paths.  ``returned`` is taken
    over: its dE may become the total (see :func:`_tied_total`), so a caller keeps using the
    Returned this gives back, not the one it gave."""
    V, d = batch.E.shape
    N = batch.tokens.shape[0]
    opts = options_of(batch)
    dt = working_dtype(V * d * N, precision)
    h = np.asarray(inp["h"])
    args = (h, batch.E, batch.targets, batch.b, opts, batch.grad_output)
    # At large shapes (as for a kernel, core.paths.SKETCH_ABOVE) the reference's dE is kept as
    # its factors dz.T @ h and the rows no token or target touches are judged through
    # projections: a [V, d] reference is 2.1 GB at Llama-3's head, and the repeat call ran
    # beside it and the first call's total
    drawn = draw_directions(V, d, N, batch.tokens, None, None)
    ref = _reference_of(batch, inp, args, dt, None if drawn is None else drawn[0])
    # the rows of E the batch reads, in dt: what a whole E.astype(dt) would give them, without
    # a [V, d] copy (2.1 GB at Llama-3's head)
    _, t = body(replace(batch, E=batch.E[batch.tokens].astype(dt),
                        tokens=np.arange(N), W=batch.W.astype(dt)))
    rows_ref = body_rows(batch, t, ref.dh)
    ev = returned.evidence
    dh = np.nan_to_num(np.asarray(ev["dh"], dtype=np.float64), nan=0.0, posinf=0.0,
                       neginf=0.0)
    rows_ker = body_rows(batch, t.astype(np.float64), dh)
    tokens: IntArray = batch.tokens
    h_inf = np.abs(h).max(axis=1, initial=0.0).astype(np.float64)
    # the largest logit enters k as in the probe model's bound: a softmax of logits near 1e4
    # rounds at 1e4 * u before any reduction
    zmag = opts.logit_scale * (float(h_inf.max(initial=0.0)) * _abs_row_sum_max(batch.E) + (
        0.0 if batch.b is None else float(np.abs(batch.b).max(initial=0.0))))
    k = float(N + d + np.sqrt(V) + 1 + zmag)
    # The kernel's dh carries the rounding of its target entry p - 1 even where that cancels
    # to ~0 (a softmax saturated at its target), and the input path it implies carries it
    # too: without it a correct kernel's tied row was 1.24x past its bound there (logits
    # 1e4, float32).  That is a few roundings of one entry (exp, the sum, the division), so
    # it is counted as 4 of them, not as a k-term reduction: counted k times, or with all of
    # dh's terms as the probe model's bound counts them, it took every bfloat16 case's power.
    in_terms = input_path_terms(tokens, np.abs(rows_ref).max(axis=1, initial=0.0)
                                .astype(np.float64), ref.dh_target_terms * (4.0 / k),
                                batch.W, batch.res, batch.s_in, V)
    terms = Terms(rows=ref.dE_terms + in_terms, k=k,
                  loss=float(np.abs(np.asarray(ref.loss, np.float64)).sum()) + 1.0 + zmag,
                  db=ref.db_terms)
    per_position = rows_ref.astype(np.float64)
    if drawn is None:
        # in the reference's dtype: every comparison reads it a block at a time
        dE_in: Array | InputPath = scatter_rows(tokens, per_position, V)
        dE_out: Array | OutputPath = ref.dE
        sketch = None
    else:
        assert ref.projected is not None
        live = batch.targets[(batch.targets >= 0) & (batch.targets < V)]
        exact = np.union1d(tokens, live).astype(np.int64)
        dE_in, dE_out, sketch = two_paths(tokens, per_position, ref.dz, np.asarray(h, dt), V,
                                          exact, drawn, ref.projected)
    paths = Paths(loss=_scalar(ref.loss, batch.grad_output), dE_in=dE_in, dE_out=dE_out,
                  dW=np.zeros((0, 0)),
                  db=None if ref.db is None else np.asarray(ref.db, np.float64),
                  per_position=per_position, tokens=tokens, terms=terms, sketch=sketch)
    loss = ev["loss"]
    if _nan_mean_of_nothing(opts, args, ev):
        loss = ref.loss  # PyTorch's 0/0 (see _nan_mean_of_nothing): judged as the defined 0
        ev = dict(ev, loss=np.zeros_like(np.asarray(ev["loss"], np.float64)),
                  nonfinite=[])
    findings = _kernel_findings(args, dt, ref, ev, returned, precision, k, zmag)
    total = _tied_total(returned, tokens, rows_ker, precision)
    return replace(returned, dE=total, loss=_scalar(loss, batch.grad_output),
                   findings=tuple(findings)), paths


def _tied_total(returned: Returned, tokens: IntArray, rows_ker: Array, precision: str
                ) -> Array:
    """``dE + scatter_rows(tokens, rows_ker, V)`` as one [V, d] (not three): the touched rows'
    sums added in place, inf and NaN read as 0 (they are the ``not_finite`` finding's).

    Judged at float32 or below it is in float32, not float64 (4.2 GB at Llama-3's head), and
    in dE's own dtype where that is bfloat16 or float16 judged at its own precision (2.1 GB
    less there): the touched rows take one more rounding of their sum at the judged precision,
    far inside a bound whose terms are at least the row's magnitude times N + d units.  Where
    dE is already in that dtype and nothing but its Returned holds it (``core.memory.unshared``:
    an adapter that reuses its buffer still gets a copy), it is the total itself, no copy."""
    dE = returned.dE
    low = ("bfloat16", "float16")
    want = np.dtype(np.float64) if precision == "float64" else \
        dE.dtype if dE.dtype.name in low and precision in low else \
        np.result_type(dE.dtype, np.float32)
    # holders: its Returned and the name dE here
    total = dE if dE.dtype == want and memory.unshared(dE, holders=2) else \
        np.array(dE, dtype=want)
    del dE
    touched, sums = segment_sums(tokens, rows_ker)
    total[touched] += sums
    if total.dtype.kind == "f":
        out: Array = np.nan_to_num(total, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        return out
    for s in range(0, total.shape[0], _ROWS):  # bfloat16: numpy's nan_to_num leaves it as is
        block = total[s:s + _ROWS]
        block[~np.isfinite(block)] = 0
    return total


#: The last reference :func:`complete` built: the batch it was for (weakly), the inputs dict
#: (the very object), the dtype, the reference.  The kind's second call repeats the first on
#: the same batch and inputs, and its reference is the same arrays (at Llama-3's head a second
#: one is another 2.1 GB dE and 0.5 GB dz beside the first's).  It goes when its batch goes.
_last: list[tuple[weakref.ref[Batch], dict[str, Any], str, CEResult]] = []


def _reference_of(batch: Batch, inp: dict[str, Any], args: tuple[Any, ...],
                  dt: str, Z: Array | None = None) -> CEResult:
    """:func:`_reference` of ``args`` (with ``Z``: factored, and its projections), reused for
    a repeat call on the same inputs."""
    if _last:
        was, was_inp, was_dt, ref = _last[0]
        if was() is batch and was_inp is inp and was_dt == dt and \
                (ref.projected is None) == (Z is None):
            return ref
    _last.clear()  # let the previous one go before the next is built
    ref = _reference(args, dt, Z)

    def gone(w: weakref.ref[Batch]) -> None:
        if _last and _last[0][0] is w:
            _last.clear()

    _last.append((weakref.ref(batch, gone), inp, dt, ref))
    return ref


def _abs_row_sum_max(E: Array) -> float:
    """max_v sum_j |E[v, j]| in float64, a block of rows at a time (no float64 copy of E)."""
    out = 0.0
    for s in range(0, E.shape[0], _ROWS):
        block = np.abs(np.asarray(E[s:s + _ROWS], np.float64))
        out = max(out, float(block.sum(axis=1).max(initial=0.0)))
    return out


#: Rows per block where a [V, d] array is read in float64: a few MB per temporary.
_ROWS = 1024


def _all_close(tol: Tolerance, actual: Array, expected: Array | OutputPath) -> bool:
    """``tol.close(actual, expected).all()`` in float64, a block of rows at a time: whole
    float64 [V, d] temporaries are 4.2 GB each at Llama-3's head (and a factored ``expected``
    is built a block at a time)."""
    for s in range(0, actual.shape[0], _ROWS):
        rows = np.arange(s, min(s + _ROWS, actual.shape[0]))
        if not tol.rows(rows).close(np.asarray(actual[s:s + _ROWS], np.float64),
                                    np.asarray(row_block(expected, s, s + _ROWS),
                                               np.float64)).all():
            return False
    return True


def _total_weight(args: tuple[Any, ...]) -> float:
    """sum_i t_i of a call's targets under its options (0: the mean is over nothing)."""
    _, _, y, _, opts, _ = args
    y = np.asarray(y)
    live = y != opts.ignore_index
    if opts.ce_weight is None:
        return float(live.sum())
    w = np.asarray(opts.ce_weight, np.float64)
    return float(w[np.where(live, y, 0)][live].sum())


def _nan_mean_of_nothing(opts: CEOptions, args: tuple[Any, ...], ev: Any) -> bool:
    """A mean over zero total weight returned as NaN with finite gradients: PyTorch's
    ``F.cross_entropy`` (0/0), and so transformers' ``ForCausalLMLoss`` and torchtune's
    chunked loss.  The contract defines 0 (litgpt's max(count, 1) division); either is
    accepted, the gradients must still be zero."""
    return (opts.reduction == "mean" and _total_weight(args) == 0
            and list(ev.get("nonfinite", ())) == ["loss"]
            and bool(np.all(np.isnan(np.asarray(ev["loss"], np.float64)))))


def _reference(args: tuple[Any, ...], dt: str, Z: Array | None = None) -> CEResult:
    """The closed form (with directions ``Z``, dE factored and projected); on tiny shapes its
    loss and gradients come from the sympy derivation instead (as the probe model's do), the
    closed form keeping the bound terms."""
    ref = linear_ce(*args, dtype=dt, Z=Z, factored=Z is not None)
    V, d = np.shape(args[1])
    if V * d > SYMBOLIC_CE_ENTRIES or dt != "float64":
        return ref
    # lazy: the sympy reference, only for the small float64 shapes it is derived at
    from tyingspec._src.kinds.linear_ce.symbolic import symbolic_linear_ce

    with np.errstate(all="ignore"):
        sym = symbolic_linear_ce(*args)
    values = [sym.loss, sym.dh, sym.dE] + ([] if sym.db is None else [sym.db])
    if not all(np.all(np.isfinite(v)) for v in values):
        return ref  # sympy's expression exponentiates unshifted logits: ~1e4 overflows
    return replace(ref, loss=sym.loss, dh=sym.dh, dE=sym.dE, db=sym.db)


#: Kernels whose E has at most this many entries are judged against sympy's derivation.
SYMBOLIC_CE_ENTRIES = 6


_CHECK = "kernel outputs"
_INVARIANT = ("the kernel's loss, dh, dE and db are the linear cross-entropy's, under its "
              "options, within the rounding bound")


def _matches(result: CEResult, dh: Array, dE: Array, precision: str, k: float) -> tuple[bool,
                                                                                       bool]:
    dE_tol = row_tolerance(Terms(rows=result.dE_terms, k=k), precision)  # type: ignore[arg-type]
    dh_tol = row_tolerance(Terms(rows=result.dh_terms, k=k), precision)  # type: ignore[arg-type]
    ok_dE = _all_close(dE_tol, dE, result.dE)
    ok_dh = _all_close(dh_tol, dh, result.dh)
    return ok_dh, ok_dE


def _kernel_findings(args: tuple[Any, ...], dt: str, ref: CEResult, ev: Any,
                     returned: Returned, precision: str, k: float, zmag: float,
                     ) -> list[Finding]:
    nonfinite = list(ev.get("nonfinite", ()))
    arrays = {"loss": ev["loss"], "dh": ev["dh"], "dE": returned.dE, "db": returned.db}
    if nonfinite:
        return [failed(_CHECK, _INVARIANT, "not_finite",
                       _nonfinite_detail(nonfinite, arrays, args, precision, zmag))]
    summed = _none_summed(args, ev["loss"], ref)
    if summed is not None:
        return [summed]
    dh = np.asarray(ev["dh"], np.float64)
    ok_dh, ok_dE = _matches(ref, dh, returned.dE, precision, k)
    ok_db = True
    db_detail = ""
    if ref.db is not None and returned.db is not None:
        tol = value_tolerance(Terms(rows=ref.dE_terms, k=k), precision,  # type: ignore[arg-type]
                              ref.db_terms)
        got_db = np.asarray(returned.db, np.float64)
        bad = np.abs(got_db - ref.db) > np.asarray(tol.atol) + tol.rtol * np.abs(ref.db)
        ok_db = not bool(bad.any())
        if not ok_db:
            worst = int(np.argmax(np.where(bad, np.abs(got_db - ref.db), -1.0)))
            db_detail = (f"entries of db wrong: {_entries(np.flatnonzero(bad))} ({int(bad.sum())} "
                         f"of {bad.size}); entry {worst} is {got_db[worst]:.6g}, the reference "
                         f"{float(ref.db[worst]):.6g}")
    loss = np.asarray(ev["loss"], np.float64)
    ref_loss = np.asarray(ref.loss, np.float64)
    loss_tol = value_tolerance(Terms(rows=ref.dE_terms, k=k), precision,  # type: ignore[arg-type]
                               np.abs(ref_loss) + 1.0 + k)
    ok_loss = loss.shape == ref_loss.shape and bool(np.all(
        np.abs(loss - ref_loss) <= np.asarray(loss_tol.atol) + loss_tol.rtol * np.abs(ref_loss)))
    if ok_dh and ok_dE and ok_db and ok_loss:
        lanes = _lanes_by_lse(args, dt, ref, loss, precision)
        if lanes is not None:
            return [lanes]
        N, d = np.shape(args[0])
        small = N * d * np.shape(args[1])[0] <= BLIND_CHECK_UP_TO
        blind = _blind_to(args, dt, ref, precision, k, loss_tol) \
            if precision in LOW_DTYPES and small else []
        if blind:
            return [failed(_CHECK, _INVARIANT, "no_power",
                           f"the outputs are within the {precision} bound, but so would be "
                           f"those of {', '.join(blind)}: at {precision} this case cannot "
                           "tell them from a correct kernel (the same option's float32 or "
                           "float64 case can)")]
        return [passed(_CHECK, _INVARIANT)]
    dE = np.asarray(returned.dE, np.float64)  # wrong: every explanation below reads it whole
    hard = _hard_coded_ignore_index(args, dt, dh, dE, precision, k)
    if hard is not None:
        return [hard]
    # ignored: the forward too (a right loss with the option-off gradients is the known bug of
    # a backward that drops it, z_loss_missing and the like, tried below)
    named = (None if ok_loss else _option_ignored(args, dt, dh, dE, loss, loss_tol, precision,
                                                  k)) or \
        (None if ok_dh and ok_dE else _padded_lanes(args, dt, dh, dE, precision, k))
    if named is not None:
        return [named]
    if not (ok_dh and ok_dE):
        for name, (label, why) in VARIANTS.items():
            try:
                wrong = linear_ce(*args, variant=name, dtype=dt)
            except ValueError:
                continue
            # the bug must show on this batch: its outputs fail the reference's own bound (the
            # test the kernel failed; the variant's bound can be wider, e.g. with ignored rows)
            if all(_matches(wrong, dh, dE, precision, k)) and not all(
                    _matches(ref, np.asarray(wrong.dh, np.float64),
                             np.asarray(wrong.dE, np.float64), precision, k)):
                return [failed(_CHECK, _INVARIANT, _label(label),
                               f"dh and dE match the known bug: {why}")]
    if ok_dh and not ok_dE:
        return [failed(_CHECK, _INVARIANT, "dE_wrong_dh_right",
                       _overwritten_blocks(args, dt, ref, dE, precision, k)
                       or f"rows of dE wrong: {_rows(dE, np.asarray(ref.dE))}")]
    if ok_dE and not ok_dh:
        return [failed(_CHECK, _INVARIANT, "dh_wrong_dE_right",
                       f"tokens whose dh is wrong: {_rows(dh, ref.dh)}")]
    if ok_dh and ok_dE and not ok_db:
        return [failed(_CHECK, _INVARIANT, "bias_gradient_wrong", db_detail)]
    if ok_dh and ok_dE:
        return [failed(_CHECK, _INVARIANT, "forward_mismatch",
                       f"the loss differs: {float(loss.sum()):.6g} against "
                       f"{float(ref_loss.sum()):.6g}")]
    return [failed(_CHECK, _INVARIANT, "unknown",
                   "dh and dE are both wrong and match no known bug")]


def _nonfinite_detail(names: list[str], arrays: dict[str, Any], args: tuple[Any, ...],
                      precision: str, zmag: float) -> str:
    """Which outputs hold NaN or inf (how many entries, the first tokens or rows), and the
    cause that fits what is finite: a logsumexp overflow only where the logits reach it."""
    parts = []
    for name in names:
        a = np.asarray(arrays[name], np.float64)
        nan, inf = np.isnan(a), np.isinf(a)
        kinds = " and ".join(w for w, m in (("NaN", nan), ("inf", inf)) if m.any())
        where = ""
        if a.ndim == 2:
            rows = np.flatnonzero((nan | inf).any(axis=1))
            where = f" ({'tokens' if name == 'dh' else 'rows'} {_entries(rows)})"
        elif a.ndim == 1 and a.size > 1:
            where = f" (entries {_entries(np.flatnonzero(nan | inf))})"
        parts.append(f"{name} holds {kinds} in {int((nan | inf).sum())} of {a.size} "
                     f"entr{'y' if a.size == 1 else 'ies'}{where}")
    text = "; ".join(parts) + "; the reference is finite"
    grads = [n for n in names if n != "loss"]
    if "loss" not in names:
        text += f". The loss is finite: the backward made the non-finite {', '.join(grads)}"
    opts = args[4]
    if opts.reduction == "mean" and _total_weight(args) == 0:
        text += (". Every token is ignored (or weighs 0): a mean over nothing is 0 (litgpt's "
                 "max(count, 1)) or, PyTorch's 0/0, a NaN loss with zero gradients")
    # exp overflows past ~88 (float32 and below) or ~709 (float64) without the max shift
    if zmag > (709.0 if precision == "float64" else 88.0):
        text += (f". The logits reach |z| ~ {zmag:.3g}: a logsumexp or softmax without the max "
                 "shift overflows there")
    return text


def _hard_coded_ignore_index(args: tuple[Any, ...], dt: str, dh: Array, dE: Array,
                             precision: str, k: float) -> Finding | None:
    """The kernel's dh and dE are the contract's with ignore_index -100 while the case drew
    another: it treats the drawn ignore_index as a class (ignore_index hard-coded)."""
    h, E, y, b, opts, go = args
    drawn = opts.ignore_index
    if drawn == IGNORE_INDEX or not np.any(np.asarray(y) == drawn):
        return None
    fixed = replace(opts, ignore_index=IGNORE_INDEX)
    try:
        wrong = linear_ce(h, E, y, b, fixed, go, dtype=dt)
    except ValueError:  # a drawn ignore_index outside [0, V) would not be a class
        return None
    if not all(_matches(wrong, dh, dE, precision, k)):
        return None
    return failed(_CHECK, _INVARIANT, "ignored_not_zeroed",
                  f"dh and dE are the contract's with ignore_index={IGNORE_INDEX}, not the "
                  f"case's {drawn}: the kernel trains on the tokens whose target is {drawn} "
                  f"(tokens {_entries(np.flatnonzero(np.asarray(y) == drawn))}) as if "
                  f"{drawn} were a class; its ignore_index is hard-coded")


#: Multiply-adds (V d N) up to which a passing low-precision case is asked which known bugs
#: would pass it too (:func:`_blind_to`: a reference per bug, about ten): the standard cases
#: are far below it; a production shape's one reference already costs seconds.
BLIND_CHECK_UP_TO = 1 << 24


def _blind_to(args: tuple[Any, ...], dt: str, ref: CEResult, precision: str, k: float,
              loss_tol: Tolerance) -> list[str]:
    """The known bugs that would pass this case at ``precision``: each one's loss, dh and dE
    (a :data:`VARIANTS` entry, padded lanes for a softcap, an option ignored) differ from the
    reference on this batch but lie within its bound.  At bfloat16 a 5% error can."""
    h, E, y, b, opts, go = args
    wrongs: list[tuple[str, CEResult]] = [
        (label, linear_ce(*args, variant=name, dtype=dt)) for name, (label, _) in VARIANTS.items()]
    V = np.shape(E)[0]
    lanes = (1 << max(4, (V - 1).bit_length())) - V  # past V in Liger's block over V
    bound = lse_bound(args, precision)
    if opts.softcap is not None and lanes:
        padded = linear_ce(*args, dtype=dt, lanes=(lanes, -opts.softcap))
        if not _lse_tells(padded, ref, bound):  # else the lse itself tells it (_lanes_by_lse)
            wrongs.append(("padded_lanes_in_lse", padded))
    wrongs += [(f"option_ignored ({name})",
                linear_ce(h, E, y, b, replace(opts, **{name: off}), go, dtype=dt))
               for name, off in _OFF.items() if getattr(opts, name) != off
               and name != "reduction"]
    ref_loss = np.asarray(ref.loss, np.float64)
    blind = []
    for label, wrong in wrongs:
        dh, dE = np.asarray(wrong.dh, np.float64), np.asarray(wrong.dE, np.float64)
        loss = np.asarray(wrong.loss, np.float64)
        if np.array_equal(dh, ref.dh) and np.array_equal(dE, np.asarray(ref.dE)) and \
                np.array_equal(loss, ref_loss):
            continue  # the bug cannot show on this batch (its option is off)
        if all(_matches(ref, dh, dE, precision, k)) and bool(np.all(
                np.abs(loss - ref_loss) <= np.asarray(loss_tol.atol)
                + loss_tol.rtol * np.abs(ref_loss))) and label not in blind:
            blind.append(label)
    return blind


def _none_summed(args: tuple[Any, ...], loss: Any, ref: CEResult) -> Finding | None:
    """A ``reduction='none'`` call that returned one number for N > 1 tokens (Liger #488: the
    summed scalar): a forward mismatch that names the shapes and what the number is."""
    opts = args[4]
    got = np.asarray(loss, np.float64)
    per_token = np.asarray(ref.loss, np.float64)
    if opts.reduction != "none" or got.size != 1 or per_token.size <= 1:
        return None
    value = float(got.reshape(()))
    total, weight = float(per_token.sum()), _total_weight(args)
    what = ""
    for name, candidate in (("the sum", total),
                            ("the mean", total / weight if weight else float("nan"))):
        if abs(value - candidate) <= 1e-3 * (abs(candidate) + 1e-12):
            what = f": it is {name} of the per-token losses ({candidate:.6g})"
            break
    return failed(_CHECK, _INVARIANT, "forward_mismatch",
                  f"reduction='none' returned a loss of shape {tuple(np.shape(loss))} "
                  f"({value:.6g}) where the per-token losses, shape {per_token.shape}, were "
                  f"expected{what}; its backward then ignores the per-token grad_output")


#: The options whose being ignored is tried, each with its value when off.
_OFF: dict[str, Any] = {"logit_scale": 1.0, "softcap": None, "label_smoothing": 0.0,
                        "lse_square_scale": 0.0, "ce_weight": None, "reduction": "mean"}


def _option_ignored(args: tuple[Any, ...], dt: str, dh: Array, dE: Array, loss: Array,
                    loss_tol: Tolerance, precision: str, k: float) -> Finding | None:
    """An option the case sets that the kernel took and ignored: its loss, dh and dE are
    those of the same call with the option off (Liger 0.2.0's ``label_smoothing``)."""
    h, E, y, b, opts, go = args
    for name, off in _OFF.items():
        if getattr(opts, name) == off:
            continue
        # reduction="sum" ignored is the mean (nn.CrossEntropyLoss's reduction taken and
        # never read: Liger 0.2.0); "none" ignored is a scalar, named by _none_summed
        without = linear_ce(h, E, y, b, replace(opts, **{name: off}),
                            None if name == "reduction" else go, dtype=dt)
        off_loss = np.asarray(without.loss, np.float64)
        if loss.shape == off_loss.shape and bool(np.all(
                np.abs(loss - off_loss) <= np.asarray(loss_tol.atol)
                + loss_tol.rtol * np.abs(off_loss))) and \
                all(_matches(without, dh, dE, precision, k)):
            value = getattr(opts, name)
            shown = f"[{len(value)} class weights]" if name == "ce_weight" else f"={value}"
            return failed(_CHECK, _INVARIANT, "option_ignored",
                          f"{name}{shown} was accepted and ignored: the loss, dh and dE are "
                          f"the ones with {name} off ({off})")
    return None


#: Lane block sizes of real kernels over the vocabulary (Liger's ``BLOCK_SIZE``: the next power
#: of two of V, at most 65536) tried for padded lanes in the logsumexp.
_LANE_BLOCKS = tuple(2 ** i for i in range(4, 17))


def _padded_lanes(args: tuple[Any, ...], dt: str, dh: Array, dE: Array, precision: str,
                  k: float) -> Finding | None:
    """dh and dE of a kernel whose padded vocabulary lanes (past V in its last block of B
    lanes) enter the logsumexp: masked with -inf and then softcapped to -softcap (Liger up to
    0.8.0, Unsloth before PR #10616), or loaded as 0."""
    for lanes, value, sizes in _lane_candidates(args):
        wrong = linear_ce(*args, dtype=dt, lanes=(lanes, value))
        if all(_matches(wrong, dh, dE, precision, k)):
            return failed(_CHECK, _INVARIANT, "padded_lanes_in_lse",
                          f"dh and dE are the contract's with {_lanes_text(args, lanes, value)}"
                          f" (of {' or '.join(map(str, sizes))} lanes)")
    return None


def _lane_candidates(args: tuple[Any, ...]) -> list[tuple[int, float, list[int]]]:
    """(padded lanes, the value each enters the logsumexp with, the block sizes that leave
    that many lanes past V) for every block of :data:`_LANE_BLOCKS`: -softcap (a -inf lane
    softcapped) where the call has a softcap, and 0 (a lane loaded as 0)."""
    opts = args[4]
    V = np.shape(args[1])[0]
    values = ([-opts.softcap] if opts.softcap is not None else []) + [0.0]
    blocks: dict[int, list[int]] = {}  # padded lanes -> the block sizes that leave that many
    for B in _LANE_BLOCKS:
        if -V % B:
            blocks.setdefault(-V % B, []).append(B)
    return [(lanes, value, sizes) for lanes, sizes in blocks.items() for value in values]


def _lanes_text(args: tuple[Any, ...], lanes: int, value: float) -> str:
    V = np.shape(args[1])[0]
    how = "-inf softcapped to -softcap" if value else "0"
    return (f"{lanes} more logits of {value:g} ({how}) in every token's logsumexp: the lanes "
            f"{V}..{V + lanes - 1} past V={V} in the kernel's last block")


def lse_bound(args: tuple[Any, ...], precision: str) -> np.ndarray | None:
    """The most a correct kernel's loss can be off at ``precision`` (a scalar for a mean or a
    sum, per token for ``none``), from its logits and logsumexp alone: far tighter than the
    loss's share of the rows' bound, which counts every reduction of the gradients too.  It
    is what gives a low-precision case power against padded lanes in the logsumexp, which
    shift every token's lse by about log1p(P e^-softcap / Z) and its gradients by a share
    bfloat16's row bound holds.  None with a z-loss (its square scales the lse's error).

    Per token: each logit is d products summed and rounded, then rounded (``(d + 1) u`` of
    its terms' size, at most the largest logit magnitude L), the softcap's tanh and product
    two roundings more of at most the softcap; the lse is 1-Lipschitz in the logits' max
    norm and the target's logit (label smoothing's mean of them) enters again: twice that;
    its sum of V exponentials is rounded at most V times, and the loss (at most
    log V + 2 L) once by the lse and once on return.  SAFETY as the other bounds."""
    h, E, y, b, opts, go = args
    if opts.lse_square_scale:
        return None
    V, d = np.shape(E)
    u = UNIT_ROUNDOFF[precision]  # type: ignore[index]
    L = opts.logit_scale * (float(np.abs(np.asarray(h, np.float64)).max(initial=0.0))
                            * _abs_row_sum_max(E) + (0.0 if b is None else float(
                                np.abs(np.asarray(b, np.float64)).max(initial=0.0))))
    cap = L if opts.softcap is None else min(L, opts.softcap)
    token = SAFETY * u * (2 * (d + 1) * L + 4 * (opts.softcap or 0.0) + V
                          + 2 * (np.log(V) + 2 * cap))
    y = np.asarray(y)
    live = y != opts.ignore_index
    w = np.where(live, 1.0 if opts.ce_weight is None else
                 np.asarray(opts.ce_weight, np.float64)[np.where(live, y, 0)], 0.0)
    if opts.reduction == "none":
        return np.asarray(token * w)
    # a mean is a weighted mean of the tokens' errors: at most the largest
    return np.asarray(token * (float(w.sum()) if opts.reduction == "sum" else 1.0))


def _lse_tells(wrong: CEResult, ref: CEResult, bound: np.ndarray | None) -> bool:
    """Whether ``wrong``'s loss is more than twice the lse bound from the reference's: then
    no loss within the bound of one is within it of the other."""
    if bound is None:
        return False
    gap = np.abs(np.asarray(wrong.loss, np.float64) - np.asarray(ref.loss, np.float64))
    return gap.shape == np.shape(bound) and bool(np.all(gap > 2 * bound))


def _lanes_by_lse(args: tuple[Any, ...], dt: str, ref: CEResult, loss: Array,
                  precision: str) -> Finding | None:
    """Padded lanes named by the lse itself (see :func:`lse_bound`), where the gradients'
    bound holds them (bfloat16): the kernel's loss within the bound of the loss such lanes
    give, that one beyond twice the bound from the contract's."""
    if args[4].softcap is None or precision not in LOW_DTYPES:
        return None
    bound = lse_bound(args, precision)
    if bound is None:
        return None
    got = np.asarray(loss, np.float64)
    for lanes, value, sizes in _lane_candidates(args):
        wrong = linear_ce(*args, dtype=dt, lanes=(lanes, value))
        wl = np.asarray(wrong.loss, np.float64)
        if _lse_tells(wrong, ref, bound) and got.shape == wl.shape and \
                bool(np.all(np.abs(got - wl) <= bound)):
            shift = float(np.max(np.abs(wl - np.asarray(ref.loss, np.float64))))
            return failed(_CHECK, _INVARIANT, "padded_lanes_in_lse",
                          f"the loss is the contract's with {_lanes_text(args, lanes, value)} "
                          f"(of {' or '.join(map(str, sizes))} lanes): off by {shift:.3g}, "
                          f"where a correct kernel's loss is within "
                          f"{float(np.max(bound)):.3g} at {precision} (the lse itself; dh "
                          "and dE are within their bound either way)")
    return None


#: Block sizes of real kernels (Liger, torchtune, litgpt chunks, CCE tiles) tried when dE is
#: wrong and dh right: is dE one block's contribution alone?
BLOCK_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


def _overwritten_blocks(args: tuple[Any, ...], dt: str, ref: CEResult, dE: Array,
                        precision: str, k: float) -> str:
    """'' or the block size B for which the kernel's dE is the last block's contribution
    alone: each block assigned ``dE = block_dE`` where ``dE += block_dE`` was meant."""
    h = np.asarray(args[0], dtype=dt)
    N = h.shape[0]
    tol = row_tolerance(Terms(rows=ref.dE_terms, k=k), precision)  # type: ignore[arg-type]
    for B in BLOCK_SIZES:
        if B >= N:
            break
        last = B * ((N - 1) // B)
        alone = np.asarray(ref.dz[last:].T @ h[last:], np.float64)
        if bool(tol.close(dE, alone).all()):
            return (f"dE is the contribution of tokens [{last}, {N}) alone, the last block of "
                    f"{B}: each block of {B} tokens overwrote dE (`dE = block_dE` where "
                    f"`dE += block_dE` was meant); right whenever N <= {B}")
    return ""


def _label(name: str) -> Label:
    return name  # type: ignore[return-value]


def _entries(idx: Any, limit: int = 8) -> str:
    idx = [int(i) for i in idx]
    return "[" + ", ".join(map(str, idx[:limit])) + (", ..." if len(idx) > limit else "") + "]"


def _rows(a: Array, e: Array, limit: int = 8) -> str:
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64)).max(axis=1)
    scale = np.abs(np.asarray(e, np.float64)).max(initial=0.0)
    return _entries(np.flatnonzero(diff > 1e-6 * (scale + 1e-300)), limit)


#: The low precisions a kernel is run in (a torch class: see ``adapter.supported``).
LOW_DTYPES = ("bfloat16", "float16")
#: The cases of an option, run again in each low precision (``ce-softcap-bfloat16``): an
#: option is a kernel's code in every dtype branch.
OPTION_CASES = ("ce-bias", "ce-logit-scale", "ce-softcap", "ce-label-smoothing", "ce-z-loss",
                "ce-ignore-index", "ce-class-weights", "ce-sum", "ce-none")

#: Option values the low-precision cases take instead of the float64 cases' own: at the
#: latter a bug's error can lie inside the bfloat16 bound, at these it does not (measured on
#: the cases' own batches with the zoo's torch kernel: at 60% ignored a mean counting them, at
#: a z-loss of 0.05 the z-loss missing, at label_smoothing=0.1 its misweighting, each passed
#: bfloat16's bound).  For the softcap see :data:`LOW_SHAPES`.
LOW_VALUES = {"ignored": "0.75", "lse_square_scale": "1.0", "label_smoothing": "0.5",
              "softcap": "0.15"}
#: Shapes the low-precision cases of an option take instead of the float64 case's own.  Padded
#: lanes in the logsumexp (:func:`lse_bound`) add P e^-c to each token's Z: at softcap 2 and
#: V = 37 (27 lanes) that shifted the lse by 0.04 and the gradients by a share that both
#: bfloat16's and float16's bounds held, so a correct kernel's softcap cases were no_power.
#: At V = 9 (7 lanes past it in a block of 16: P/V is near its largest for a block of 16),
#: softcap 0.15 and logits about twice the softcap (on tanh's curved part, where a softcap
#: bug shows), the shift is about 0.5: over seeds 0-5 at least 2.4x the lse bound at bfloat16
#: (so no loss within it of the contract's is within it of the padded one) and 21x at
#: float16, where the zoo's correct torch kernel's loss used at most 7% of it.  8 tokens of 3
#: distinct ones keep the rows' bound (k counts N) narrow enough that a dropped path and a
#: missing softcap derivative still show at bfloat16 (seeds 0-5; at seed 4 a dropped input
#: path does not: no_power, for that, not for the lanes).
LOW_SHAPES: dict[str, dict[str, Any]] = {
    "ce-softcap": {"V": 9, "d": 3, "N": 8, "e_scale": 0.3, "distinct": 3},
}


def _low(ce: str) -> str:
    """A ``ce`` string with the :data:`LOW_VALUES` of a low-precision case."""
    return ",".join(f"{k}={LOW_VALUES.get(k, v)}" for k, v in ce_options(ce).items())


#: Tokens in the long case: 4096 + 2048 + 1024 + 512 + 256 + 128 + 37, past two blocks of
#: every common size up to 4096, each of which (and 7) leaves a partial last block starting
#: at a token of its own, so a dE that is one block's alone names its block size.  With V and
#: d small it costs milliseconds of reference.
LONG_N = 8101


#: The long case's block floor under the Triton interpreter: past two blocks of every size up
#: to this one, whatever block the kernel's launches showed (each interpreted token costs a
#: program or more: N = 8101 took 51 s a call of Liger's fused kernel on this VM).
INTERPRETED_BLOCK = 128


def long_n(block: int) -> int:
    """Tokens past two blocks of ``block`` (the kernel's own) and of each power of two from
    16 below it, each leaving a partial last block that starts at a token of its own, and a
    partial last chunk of :data:`CHUNK` (``LONG_N``'s pattern, for any block)."""
    n = block + sum(1 << i for i in range(4, max(block - 1, 1).bit_length()))
    r = 1
    while (n + r) % CHUNK == 0 or (n + r) % 16 == 0:
        r += 1
    return n + r


def shape_ce_cases(spec: str, described: dict[str, Any],
                   cases: list[Case]) -> tuple[list[Case], list[str]]:
    """The cases fitted to the kernel: ``ce-long`` past two of the kernel's own blocks, where
    it declares them (``tyingspec_block``) or runs under the Triton interpreter (the largest
    block its launches used; at least :data:`INTERPRETED_BLOCK`), not 8101 interpreted
    tokens."""
    declared, seen = described.get("block_declared"), described.get("block_seen")
    interpreted = described.get("interpreted")
    if declared is None and not interpreted:
        return cases, []
    block = int(declared) if declared is not None else max(int(seen or 0), INTERPRETED_BLOCK)
    out, notes = [], []
    for c in cases:
        if c.name in LENGTH_CASES and c.tokens is None:
            n = long_n(block)
            why = (f"the block it declares (tyingspec_block = {declared})" if declared is not None
                   else f"its launches under the Triton interpreter of triton {interpreted} "
                        f"used blocks of at most {seen or 0}, and at least "
                        f"{INTERPRETED_BLOCK} are spanned")
            notes.append(f"{c.name}: N={n}, past two blocks of {block} ({why})")
            c = replace(c, N=n)
        out.append(c)
    return out, notes


def standard_ce_cases(seed: int) -> list[Case]:
    """The seeded set ``tyingspec check --kind linear-ce`` runs: each option, and the shapes
    that break chunked kernels (N and V not multiples of a block, an all-ignored chunk, every
    token ignored, one target everywhere, logits near 1e4 in float32, N past two blocks of
    2048, inputs in bfloat16).

    Without a bias, as most real kernels are (cut-cross-entropy, torchtune, litgpt); ``ce-bias``
    has one (with ignored tokens, whose db a kernel may forget to mask).  ``ce-ignore-index``
    ignores a class of the vocabulary (a pad token id) instead of -100."""
    base = dict(V=37, d=6, N=23, composition="repeats", distinct=9, e_scale=0.5, bias=False)
    specs: list[tuple[str, dict[str, Any]]] = [
        ("ce-plain", {}),
        ("ce-bias", {"bias": True, "ce": "ignored=0.3,ignore_index=-100"}),
        ("ce-logit-scale", {"ce": "logit_scale=0.0625", "e_scale": 2.0}),
        ("ce-softcap", {"ce": "softcap=2.0", "e_scale": 1.2}),
        ("ce-label-smoothing", {"ce": "label_smoothing=0.1"}),
        ("ce-z-loss", {"ce": "lse_square_scale=0.01"}),
        ("ce-ignored", {"ce": "ignored=0.3,ignore_index=-100"}),
        ("ce-ignore-index", {"ce": "ignored=0.3,ignore_index=vocab"}),
        ("ce-all-ignored", {"ce": "ignored=1,ignore_index=-100"}),
        ("ce-class-weights", {"ce": "ce_weight=drawn"}),
        ("ce-sum", {"ce": "reduction=sum"}),
        ("ce-none", {"ce": "reduction=none"}),
        ("ce-one-target", {"ce": "target=same"}),
        # h = x + tanh(x W) ~ E's rows, so logits ~ d * 40^2 ~ 1e4
        ("ce-large-logits", {"ce": "logits=1e4", "dtype": "float32", "e_scale": 40.0}),
        # a kernel right up to one block (`dE = block_dE` for `+=`) is wrong only past it
        ("ce-long", {"N": LONG_N, "V": 11, "d": 4, "composition": "random",
                     "distinct": None}),
        # a kernel's half-precision branch is its own code: reached only by such inputs
        ("ce-bfloat16", {"ce": "ignored=0.6,ignore_index=-100", "dtype": "bfloat16"}),
        ("ce-float16", {"ce": "ignored=0.6,ignore_index=-100", "dtype": "float16"}),
    ]
    # ...and every option of it too (a bfloat16 branch that drops the logit scale passed
    # when only the option-free low-precision case ran), with the values that keep power there
    own = dict(specs)
    specs += [(f"{name}-{dtype}", own[name] | {"dtype": dtype, "ce": _low(own[name]["ce"])}
               | LOW_SHAPES.get(name, {})) for dtype in LOW_DTYPES for name in OPTION_CASES]
    return [_with_logits(Case(name=name, seed=case_seed(seed, name),
                              **(base | kw))) for name, kw in specs]  # type: ignore[arg-type]


def _with_logits(case: Case) -> Case:
    """``case`` naming the spread of logits it is drawn for (``logits=``, about
    ``d * e_scale**2``; see ``kinds.linear_ce.draws.ce_e_scale``), so that ``--shape`` keeps it."""
    if "logits" in ce_options(case.ce):
        return case
    spread = f"logits={case.d * case.e_scale ** 2:g}"
    return replace(case, ce=f"{case.ce},{spread}" if case.ce else spread)
