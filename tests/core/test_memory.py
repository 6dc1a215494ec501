"""What a check keeps in memory at production shapes (issue 23 §3), asserted as structure at small
shapes: which arrays exist and what they hold, never how many bytes a run took (the figures are
benchmarks/bench_memory.py's)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tyingspec._src.core import cases, memory, threads
from tyingspec._src.core.cases import Case, build, memory_problem, model_bytes, released
from tyingspec._src.engine import observe as ob
from tyingspec._src.kinds.probe.spec import KERNEL
from tyingspec._src.kinds.table import KINDS

LLAMA3 = (128256, 4096, 1024)


def bytes_needed(V: int, d: int, N: int, precision: str = "float64", kind: str = "model") -> int:
    """The peak a check of ``kind`` holds, by its spec's estimate."""
    return KINDS[kind].peak_bytes(V, d, N, precision)


def _case(**kw: object) -> Case:
    base: dict[str, object] = dict(name="m", V=300, d=16, N=40, seed=7, composition="repeats",
                                   distinct=9, dtype="float32", e_scale=0.02)
    return Case(**(base | kw))  # type: ignore[arg-type]


# --- the estimate -------------------------------------------------------------------------------

def test_the_estimate_defaults_to_the_float64_model_fit() -> None:
    V, d, N = 50257, 768, 1024
    assert model_bytes(V, d, N) == 8 * (7 * V * d + 5 * N * V // 2 + N * d)
    assert bytes_needed(V, d, N) == model_bytes(V, d, N)
    assert bytes_needed(V, d, N) == bytes_needed(V, d, N, "float64", "model")


def test_the_kernel_estimate_follows_the_precision() -> None:
    f64, f32, bf16 = (bytes_needed(*LLAMA3, p, "kernel") for p in ("float64", "float32",
                                                                   "bfloat16"))
    assert f64 > f32 > 0
    # a bfloat16 E is half a float32 one, but its forward and dE are float32
    assert f32 // 2 < bf16 <= f32 + LLAMA3[0] * LLAMA3[1] * 2
    assert bytes_needed(*LLAMA3, "auto", "kernel") == f64  # auto builds float64


def test_the_kernel_estimate_is_below_the_model_fit_and_linear_ce_above_it() -> None:
    kernel = bytes_needed(*LLAMA3, "float32", "kernel")
    assert kernel < bytes_needed(*LLAMA3, "float32", "model")
    assert kernel < bytes_needed(*LLAMA3, "float32", "linear-ce")
    # Llama-3's head in float32 fits a 24 GiB machine as a kernel check
    assert memory_problem(*LLAMA3, 20 << 30, "float32", KINDS["kernel"]) is None


def test_the_refusal_names_the_precision_and_the_kind() -> None:
    problem = memory_problem(*LLAMA3, 1 << 30, "bfloat16", KINDS["kernel"])
    assert problem is not None
    assert "bfloat16" in problem and "kernel" in problem and "V=128256" in problem
    auto = memory_problem(*LLAMA3, 1 << 30, "auto", KINDS["linear-ce"])
    assert auto is not None and "float64" in auto and "linear-ce" in auto
    # unknown: nothing refused
    assert memory_problem(*LLAMA3, None, "float32", KINDS["kernel"]) is None


def test_the_cli_refusal_names_the_precision(capsys: pytest.CaptureFixture[str]) -> None:
    from tyingspec._src.front.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["check", "tied", "--kind", "kernel", "--shape", "1000000000,4096,1024",
              "--precision", "bfloat16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "in bfloat16 needs about" in err and "kernel check" in err


# --- a kernel case lets its E go -----------------------------------------------------------------

def test_kernel_inputs_do_not_keep_E_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cases, "RELEASE_ABOVE", 0)
    batch = build(_case())
    E = weakref.ref(batch.E)
    inputs = KERNEL.inputs(batch)
    assert not any(v is batch.E for v in inputs.values())
    light = released(batch, inputs)
    del batch
    gc.collect()
    assert E() is None, "something the kernel kind keeps still holds E"
    # the inputs are the memo, the same arrays; E's place holds NaN and owns no memory
    again = KERNEL.inputs(light)
    assert all(again[k] is inputs[k] for k in inputs)
    assert light.E.shape == (300, 16) and light.E.strides == (0, 0)
    assert not light.E.flags.writeable and np.isnan(light.E[0, 0])


def test_a_released_batch_refuses_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cases, "RELEASE_ABOVE", 0)
    batch = build(_case())
    light = released(batch, KERNEL.inputs(batch))
    with pytest.raises(ValueError, match="let its E go"):
        KERNEL.inputs(replace(light, tokens=light.tokens[:5].copy()))


def test_a_small_batch_keeps_its_E() -> None:
    batch = build(_case())
    assert released(batch, KERNEL.inputs(batch)) is batch


@pytest.mark.parametrize(("name", "label"), [("tied", "correct"),
                                             ("output-path-only", "input_path_missing"),
                                             ("duplicates-buffered",
                                              "duplicates_not_accumulated"),
                                             ("grad-not-zeroed", "gradient_not_zeroed")])
def test_a_check_without_E_reaches_the_same_verdicts(monkeypatch: pytest.MonkeyPatch,
                                                     name: str, label: str) -> None:
    from tyingspec._src.kinds.probe.mutants import reset_state

    reset_state()
    ob._LAST.clear()
    case = _case(V=3000, d=8, N=64)
    kept = ob.observe(ob.load(name, "kernel", "float32"), case)
    reset_state()
    ob._LAST.clear()
    monkeypatch.setattr(cases, "RELEASE_ABOVE", 0)
    light = ob.observe(ob.load(name, "kernel", "float32"), case)
    assert kept.label == light.label == label
    assert kept.batch.E.strides != (0, 0) and light.batch.E.strides == (0, 0)
    reset_state()
    ob._LAST.clear()


# --- the previous dE is kept without a copy only when nothing else can reach it ------------------

def test_unshared_counts_every_other_holder() -> None:
    a = np.ones(8)
    assert memory.unshared(a, holders=1)
    b = a
    assert not memory.unshared(a, holders=1) and memory.unshared(a, holders=2)
    del b
    view = a[2:]
    assert not memory.unshared(a, holders=1)  # the view holds it
    assert not memory.unshared(view, holders=1)  # and a view is never its own buffer
    del view
    ref = weakref.ref(a)
    assert not memory.unshared(a, holders=1)  # a weak reference can reach it later
    del ref
    assert memory.unshared(a, holders=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_array_on_a_mapping_of_its_own_is_unshared_too(dtype: str) -> None:
    # a worker's dE taken from its block, a large core.memory.empty: this process's own (a
    # bfloat16 one through a view of its bytes, which nothing else holds)
    import mmap

    from tyingspec._src.core.tolerance import numpy_dtype

    given: list[object] = []
    a = memory.leased(mmap.mmap(-1, 4096), (32, 32), numpy_dtype(dtype), given.append)
    assert a.dtype == numpy_dtype(dtype) and a.shape == (32, 32)
    assert memory.unshared(a, holders=1)
    view = a[1:]
    assert not memory.unshared(a, holders=1)
    del view
    assert memory.unshared(a, holders=1)
    base = a.base
    assert not memory.unshared(a, holders=1)  # whoever holds its base can reach the memory
    del base
    assert memory.unshared(a, holders=1)
    assert given == []
    del a
    assert len(given) == 1  # the mapping handed back once the array has gone
    # a mapping tyingspec did not make (a user's file, say) is never written into
    foreign = mmap.mmap(-1, 4096)
    b = np.ndarray((32, 32), np.float32, buffer=foreign)
    del foreign
    assert not memory.unshared(b, holders=1)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_a_large_array_is_on_a_private_mapping_with_its_pages_in() -> None:
    # A shared anonymous mapping is shmem, whose pages cost about twice as much to populate
    # (see core.memory.empty); the array must also be usable at once, zeroed like np.zeros.
    a = memory.empty(((memory.POPULATE_ABOVE >> 2) + 1024,), np.float32)
    start = a.__array_interface__["data"][0]
    perms = next(line.split()[1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if int(line.split()[0].split("-")[0], 16) <= start
                 < int(line.split()[0].split("-")[1], 16))
    assert perms == "rw-p", f"the mapping is {perms}, not a private one"
    np.testing.assert_array_equal(a[::4096], 0)
    a[:] = 1.5
    np.testing.assert_allclose(a[-3:], 1.5, rtol=0, atol=0)


# --- a large array's mapping goes with the last array over it -------------------------------

def _mapped(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_a_large_array_is_unmapped_once_every_view_of_it_has_gone() -> None:
    a = memory.empty(((memory.POPULATE_ABOVE >> 3) + 512,), np.float64)
    address = int(a.__array_interface__["data"][0])
    a[:] = 2.5
    view = a[7:]
    del a
    gc.collect()
    assert _mapped(address)  # the view still reads it
    np.testing.assert_array_equal(view[:5], 2.5)
    del view
    gc.collect()
    assert not _mapped(address)


def test_a_fresh_dE_is_kept_without_a_copy() -> None:
    ob._LAST.clear()
    target = ob.load("tied", "kernel", "float32")
    obs = ob._remember(target, ob.first_call(target, _case()))
    kept = [v[0] for k, v in ob._LAST.items() if k[:2] == ("tied", "kernel")]
    assert len(kept) == 1 and kept[0] is obs.returned.dE
    ob._LAST.clear()


_BUFFER_KERNEL = '''
import numpy as np
_BUF = {}

def kernel(tokens, dx, h, g, vocab_size):
    # its own buffer, returned itself (not a copy) and accumulated into, never zeroed
    buf = _BUF.setdefault(vocab_size, np.zeros((vocab_size, dx.shape[1]), dx.dtype))
    buf += g.T @ h
    np.add.at(buf, tokens, dx)
    return buf
'''


def test_a_buffer_the_adapter_keeps_is_still_copied(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "memory_buffer_kernel.py").write_text(_BUFFER_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    ob._LAST.clear()
    target = ob.load("memory_buffer_kernel:kernel", "kernel", "float32", isolate=False)
    first = ob._remember(target, ob.first_call(target, _case()))
    kept = [v[0] for k, v in ob._LAST.items() if k[0] == "memory_buffer_kernel:kernel"]
    assert len(kept) == 1 and kept[0] is not first.returned.dE
    obs = ob.observe(target, _case(seed=8))
    assert obs.label == "gradient_not_zeroed"
    kept = [v[0] for k, v in ob._LAST.items() if k[0] == "memory_buffer_kernel:kernel"]
    assert len(kept) == 1 and kept[0] is not obs.returned.dE
    ob._LAST.clear()


def test_a_large_kept_dE_waits_for_the_next_case_in_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between cases the last dE is held by nothing but the check (2.1 GB at Llama-3's head):
    from ``SPILL_ABOVE`` bytes it waits in a file, mapped, and still names a buffer that is
    never zeroed on the next case's first call."""
    (tmp_path / "memory_buffer_kernel.py").write_text(_BUFFER_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ob, "SPILL_ABOVE", 1)
    ob._LAST.clear()
    target = ob.load("memory_buffer_kernel:kernel", "kernel", "float32", isolate=False)
    first = ob._remember(target, ob.first_call(target, _case()))
    want = np.array(first.returned.dE, copy=True)
    del first
    ob._set_aside()
    kept = [v[0] for k, v in ob._LAST.items() if k[0] == "memory_buffer_kernel:kernel"]
    assert len(kept) == 1 and isinstance(kept[0], np.memmap)
    np.testing.assert_array_equal(kept[0], want)
    del kept
    obs = ob.observe(target, _case(seed=8))
    assert obs.label == "gradient_not_zeroed"
    ob._LAST.clear()


# --- a bfloat16 E is cast a block of rows at a time ----------------------------------------------

def test_a_bfloat16_forward_casts_E_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from tyingspec._src.core import paths

    batch = build(_case(dtype="bfloat16"))
    whole = paths.forward_parts(batch.E, batch.E, batch.W, batch.b, batch.tokens,
                                batch.targets)
    monkeypatch.setattr(paths, "_CAST_BYTES", 4 * 16 * 64)  # 64 rows of E per block
    blocks = paths._cast_blocks(batch.E)
    assert blocks is not None and len(blocks) == 5
    assert paths._cast_blocks(batch.E.astype(np.float32)) is None  # BLAS's own: one product
    part = paths.forward_parts(batch.E, batch.E, batch.W, batch.b, batch.tokens, batch.targets)
    assert part.g.dtype == whole.g.dtype == np.float32
    np.testing.assert_allclose(part.g, whole.g, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(part.dx, whole.dx, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_a_large_E_is_drawn_in_blocks_the_same_on_any_number_of_cores(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the block path, at a size a test can afford: blocks of 64 entries, split from 1024 up
    monkeypatch.setattr(cases, "DRAW_BLOCK", 64)
    monkeypatch.setattr(cases, "DRAW_SPLIT_ABOVE", 1024)
    case = Case("a", V=300, d=7, N=16, seed=11, e_scale=0.5, dtype=dtype)  # type: ignore[arg-type]
    E = np.asarray(build(case).E, np.float64)
    for cores in (1, 3):  # the blocks are the shape's, not the machine's
        monkeypatch.setattr(threads, "cores", lambda n=cores: n)
        again = build(case)
        assert again.E.dtype == build(case).E.dtype
        np.testing.assert_array_equal(np.asarray(again.E, np.float64), E)
    assert build(case).E.dtype.name == dtype
    # the spread of N(0, 1) * e_scale: 2100 draws put the sample's mean and spread well inside
    # these; uniform, so every entry within sqrt(3) * e_scale and the quartiles near +-half of
    # it (a normal draw's are at +-0.67 * 0.5 = +-0.34, not +-0.43: this would fail)
    assert abs(E.mean()) < 0.05 and abs(E.std() - 0.5) < 0.05
    edge = np.sqrt(3) * 0.5
    assert np.abs(E).max() <= edge * (1 + 1e-2)  # bfloat16 rounds to 8 bits
    np.testing.assert_allclose(np.quantile(E, [0.25, 0.75]), [-edge / 2, edge / 2],
                               rtol=0, atol=0.05)
    # every block is its own stream: no two blocks repeat each other's values
    rows = 64 // 7
    assert not np.allclose(E[:rows], E[rows:2 * rows], rtol=0, atol=1e-3)
    # below the threshold, the draw of before: every small case replays its printed batch
    small = replace(case, V=100)
    rng = np.random.default_rng(11)
    if dtype == "float32":
        want = rng.standard_normal((100, 7), dtype=np.float32) * np.float32(0.5)
    else:
        want = rng.normal(size=(100, 7)) * 0.5
    np.testing.assert_array_equal(np.asarray(build(small).E, np.float64),
                                  np.asarray(want.astype(build(small).E.dtype), np.float64))
