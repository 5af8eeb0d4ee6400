"""The package's small C++ modules (``csrc/``), built once per machine at first use.

Six exist: ``csrc/fp16_linear.cpp`` (fbgemm's fp16 product on all threads: ``cpu_linear.fp16_extension``),
``csrc/bf16_linear.cpp`` (a bf16 product with AVX512-BF16 dot products: ``cpu_linear.bf16_extension``),
``csrc/bf16_linear_avx2.cpp`` (the same product with AVX2 and FMA: ``cpu_linear.bf16_avx2_extension``),
``csrc/dropmatch_contest.cpp`` (DropMatch's contest in one call: ``dropmatch.contest_extension``),
``csrc/round_ops.cpp`` (the KV cache's compaction, the first argmax and the verifier, each in one call:
``round_ops``) and ``csrc/draft_ops.cpp`` (the head's RMSNorm, the tree search's top-k log-probabilities and
its tree selection, each in one call: ``draft_ops``). Each is compiled by torch's C++ extension loader into a
folder of its own under the package's cache (``resources.cache_dir() / "extensions"``, a folder per torch and
Python version) and loaded from there after.
Each is checked against the Python or torch code it replaces on a small case before it is used (``draft_ops``'s
norm and log-probabilities within rounding: they only serve the drafter, whose proposals the target
verifies). Where one is switched off (an environment variable), cannot be built (no C++ compiler, no ninja, a
missing header) or fails its check, its caller runs that code instead, and one line on stderr says why (but
not for the switch). Nothing here reaches the network.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SOURCES = Path(__file__).with_name("csrc")
STALE_BUILD_LOCK_S = 600  # a build takes about a minute; an older lock file belongs to an interrupted one


def build_dir(name: str) -> Path:
    """The folder ``name`` is built in: one per module, torch version and Python version."""
    from .resources import cache_dir
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / "extensions" / f"torch-{torch.__version__.replace('+', '-')}-{python}" / name


VECTOR_FLAGS = {  # torch's CPU capability -> compiler flags for loops that the compiler vectorizes
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
    "AVX512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
}


def vector_flags() -> tuple[str, tuple[str, ...]]:
    """(a name for, and the compiler flags of) the vector instructions this CPU runs, as torch detects them
    (``torch.backends.cpu.get_cpu_capability``: AVX512 or AVX2 on x86; anything else: the compiler's
    default). The name goes into the build folder's, so a cache shared with a different CPU builds its own."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = VECTOR_FLAGS.get(capability, ())
    return (capability.lower() if flags else "default"), flags


def load_extension(name: str, source: str, what: str, instead: str, extra_cflags: tuple[str, ...] = ("-O3",),
                   extra_ldflags: tuple[str, ...] = (), vectorized: bool = False, switch: str | None = None,
                   check: Callable[[object], bool] | None = None, reference: str = "its reference"):
    """Build (once) and import the module ``name`` from ``csrc/<source>``, or None where it is switched off,
    cannot be built, or fails its check (one line on stderr says which, but not for the switch).

    Args:
        name: the module's name (and its build folder's).
        source: the C++ file under ``csrc/``.
        what: what it is, for the lines on stderr ("the multi-threaded fp16 kernel").
        instead: what runs where it is not used ("fp16 layers use torch's one-thread binding, ...").
        extra_cflags, extra_ldflags: compiler and linker flags.
        vectorized: also compile for this CPU's vector instructions (``vector_flags``), in a folder of its own.
        switch: an environment variable that turns the module off when set to 0.
        check: module -> whether it computes what ``reference`` computes on a check case.
        reference: what ``check`` compares it with, for the line on stderr ("torch's binding").
    """
    if switch is not None and os.environ.get(switch, "1") == "0":
        return None
    module = build_and_import(name, source, what, instead, extra_cflags, extra_ldflags, vectorized)
    if module is not None and check is not None and not check(module):
        print(f"eagle_dropmatch: {what} differs from {reference} here; {instead}", file=sys.stderr, flush=True)
        return None
    return module


def build_and_import(name: str, source: str, what: str, instead: str, extra_cflags: tuple[str, ...],
                     extra_ldflags: tuple[str, ...], vectorized: bool):
    """``load_extension``'s build: torch's loader, which rebuilds where the source changed; None where it fails."""
    folder = build_dir(name)
    if vectorized:
        isa, flags = vector_flags()
        folder, extra_cflags = folder.with_name(f"{name}-{isa}"), (*extra_cflags, *flags)
    try:
        from torch.utils import cpp_extension
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"  # torch's loader waits while it exists; a build interrupted long ago left it
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
            lock.unlink(missing_ok=True)
        built = folder / f"{name}.so"
        if not built.exists() or built.stat().st_mtime < (SOURCES / source).stat().st_mtime:
            print(f"eagle_dropmatch: building {what} (once per machine, about a minute)", file=sys.stderr, flush=True)
        return cpp_extension.load(name, [str(SOURCES / source)], extra_include_paths=[str(SOURCES)],
                                  extra_cflags=list(extra_cflags), extra_ldflags=list(extra_ldflags),
                                  build_directory=str(folder), verbose=False)
    except Exception as error:  # a missing compiler, ninja or header, a failed build: the caller's fallback
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        print(f"eagle_dropmatch: {what} is unavailable ({reason}); {instead}", file=sys.stderr, flush=True)
        return None


ROUND_OPS_NAME = "eagle_dropmatch_round_ops"


@functools.cache
def round_ops():
    """The compiled module (``csrc/round_ops.cpp``) whose ``compact`` runs ``verify.compact_cache``'s moves and
    cuts for all layers of a CPU cache in one call (each tensor cut in place), whose ``first_argmax`` runs
    ``acceptance.first_argmax`` on CPU logits in one call and whose ``accepted_path`` and ``accepted_length``
    run the verifier (``acceptance.longest_accepted_path``, ``accepted_length``) in one call each; or None where
    it cannot be built, the environment sets ``EAGLE_DROPMATCH_ROUND_OPS_EXTENSION=0``, or it does not compute
    a check case as the Python code does (one line on stderr says which). Built once per machine
    (``load_extension``)."""
    return load_extension(ROUND_OPS_NAME, "round_ops.cpp", "the compiled round-ops module",
                          "using the Python ones", ("-O3", "-fopenmp"), ("-fopenmp",), vectorized=True,
                          switch="EAGLE_DROPMATCH_ROUND_OPS_EXTENSION", check=round_ops_match_reference,
                          reference="the Python ones")


def round_ops_match_reference(module) -> bool:
    """Whether ``module`` compacts random caches (two prefix lengths per layer pair, bf16 and fp32, paths that
    only cut and paths that move) to the Python code's entries and lengths, finds the index
    ``max(dim=-1).indices`` finds in random fp32, bf16 and fp16 rows, with ties, infinities and NaNs, and
    verifies random trees as the Python verifier does (``verifier_matches_reference``)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for nodes in ([0], [0, 1], [0, 2], [0, 1, 4, 6], [0, 3, 5, 6, 9]):
            tensors = [torch.randn(2, 3, 24, 8, generator=generator).to(dtype) for _ in range(4)]
            held = [12, 12, 10, 10]
            cut = [t.clone() for t in tensors]
            if not module.compact(cut, held, nodes):
                return False
            for tensor, start, ours in zip(tensors, held, cut):
                expected = torch.cat([tensor[:, :, :start], tensor[:, :, [start + node for node in nodes]]], dim=2)
                if not torch.equal(ours, expected):
                    return False
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for v in (1, 7, 256, 1000, 4099):
            rows = (torch.randn(6, v, generator=generator) * 4).round().to(dtype)  # many ties
            rows[1] = float("-inf")
            rows[2, v // 2] = float("inf")
            rows[3, v - 1] = float("nan")
            rows[4, v // 3] = float("nan")
            if not torch.equal(module.first_argmax(rows), rows.max(dim=-1).indices):
                return False
    return verifier_matches_reference(module, generator)


def verifier_matches_reference(module, generator: torch.Generator, trees: int = 40) -> bool:
    """Whether ``module``'s ``accepted_path`` and ``accepted_length`` give ``acceptance``'s Python verifier's
    path and length on random depth-major trees whose accepted sets hold many of their children's tokens."""
    from .acceptance import accepted_length, longest_accepted_path
    from .tree import DraftTree
    for _ in range(trees):
        n = int(torch.randint(1, 12, (1,), generator=generator))
        parents = torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, n)])
        tree = DraftTree.from_parents(torch.randint(0, 4, (n,), generator=generator), parents)
        sets = torch.randint(-1, 4, (n, 3), generator=generator)
        for accept in (sets, sets[:, :1]):
            args = (tree.tokens, tree.parents, tree.depths, accept)
            path = longest_accepted_path(*args[:3], tree.ancestors, accept, compiled=False)
            if not torch.equal(module.accepted_path(*args), path):
                return False
            if int(module.accepted_length(*args)) != path.shape[0]:
                return False
            if int(accepted_length(*args[:3], tree.ancestors, accept, compiled=False)) != path.shape[0]:
                return False
    return True


DRAFT_OPS_NAME = "eagle_dropmatch_draft_ops"


# The floats per vector of torch's CPU sum: on x86 its sum kernel runs 8-float vectors even where torch runs AVX512
# code elsewhere (measured). ``draft_ops``'s ``rms_norm`` sums a row's squares in that order (``cpu_norm``);
# where torch sums otherwise, the norms' check against torch finds it.
TORCH_SUM_LANES = 8


@functools.cache
def draft_ops():
    """The compiled module (``csrc/draft_ops.cpp``) whose ``rms_norm`` runs ``head.RMSNorm``, whose
    ``topk_log_softmax`` runs ``log_softmax(logits.float()).topk(k)`` for the tree search
    (``tree.top_children``) and whose ``select_tree`` builds ``tree.select_tree``'s tree, each in one call; or
    None where it cannot be built, the environment sets ``EAGLE_DROPMATCH_DRAFT_OPS_EXTENSION=0``, or it does
    not compute a check case as torch does (within rounding; the tree exactly; one line on stderr says which).
    Built once per machine (``load_extension``)."""
    return load_extension(DRAFT_OPS_NAME, "draft_ops.cpp", "the compiled drafting-ops module",
                          "the head drafts with torch's ops", ("-O3", "-fopenmp-simd"), vectorized=True,
                          switch="EAGLE_DROPMATCH_DRAFT_OPS_EXTENSION", check=draft_ops_match_reference,
                          reference="torch's ops")


def draft_ops_match_reference(module) -> bool:
    """Whether ``module``'s ``rms_norm`` gives the Llama RMSNorm (``cpu_norm.llama_rms_norm``) of random bf16 and
    fp32 rows (tiny to large scales, odd widths) within 4 units in the last place of the output's dtype, and its ``topk_log_softmax``
    the indices of ``log_softmax(x.float()).topk(k)`` on rows without ties and its log-probabilities within
    1e-4 (also for rows holding -inf), the lower index first where values tie, and its ``select_tree`` the
    Python's trees exactly (``select_tree_matches_reference``)."""
    from .cpu_norm import llama_rms_norm
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for width in (1, 7, 64, 577):
            weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
            x = (torch.randn(3, 5, width, generator=generator)
                 * torch.tensor([1e-3, 1.0, 40.0])[:, None, None]).to(dtype)
            expected = llama_rms_norm(x, weight, 1e-5)
            ours = module.rms_norm(x, weight, 1e-5)
            ulp = 4 * torch.finfo(dtype).eps * expected.float().abs().clamp(min=torch.finfo(dtype).tiny)
            if ours.dtype != dtype or not bool(((ours.float() - expected.float()).abs() <= ulp).all()):
                return False
        for width, k in ((1, 1), (5, 3), (200, 4)) + (((1000, 4), (8193, 3)) if dtype == torch.float32 else ()):
            logits = torch.randperm(width, generator=generator).float().reshape(1, width)  # exact in bf16
            logits = torch.cat([logits, logits.flip(-1)]).mul(0.125).to(dtype)  # distinct values: no ties
            if width > k:
                logits[1, 0] = float("-inf")
            expected_scores, expected_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
            scores, ids = module.topk_log_softmax(logits, k)
            if not torch.equal(ids, expected_ids) or not torch.allclose(scores, expected_scores, atol=1e-4):
                return False
    _, tied = module.topk_log_softmax(torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0]]), 2)
    return tied.tolist() == [[1, 3]] and select_tree_matches_reference(module, generator)


def random_search_candidates(generator: torch.Generator, k: int, depth: int):
    """The candidates (tokens, scores, parents, each [C]) of a random tree search with k children per frontier
    node over depth levels, scores rounded to one decimal (many ties; children that tie their parents)."""
    frontier, frontier_scores = torch.arange(k), -torch.rand(k, generator=generator).round(decimals=1)
    tokens, scores, parents = [torch.randint(0, 50, (k,), generator=generator)], [frontier_scores], \
        [torch.full((k,), -1)]
    for _ in range(1, depth):
        children = (frontier_scores[:, None] - torch.rand(k, k, generator=generator).round(decimals=1)).flatten()
        best = torch.sort(children, descending=True, stable=True).indices[:k]
        tokens.append(torch.randint(0, 50, (k * k,), generator=generator))
        scores.append(children)
        parents.append(frontier.repeat_interleave(k))
        frontier, frontier_scores = sum(len(t) for t in tokens[:-1]) + best, children[best]
    return torch.cat(tokens), torch.cat(scores), torch.cat(parents)


def select_tree_matches_reference(module, generator: torch.Generator, searches: int = 40) -> bool:
    """Whether ``module``'s ``select_tree`` gives ``tree.select_tree``'s Python tree (every tensor, exactly) for
    the candidates of random tree searches (``random_search_candidates``) and tree sizes."""
    from .tree import select_tree
    names = ("tokens", "parents", "depths", "ancestors", "has_children")
    for _ in range(searches):
        k, depth = (int(torch.randint(1, 5, (1,), generator=generator)) for _ in range(2))
        args = (*random_search_candidates(generator, k, depth), torch.tensor([7]),
                int(torch.randint(1, 12, (1,), generator=generator)))
        expected = select_tree(*args, depth, compiled=False)
        if not all(torch.equal(t, getattr(expected, name)) and t.dtype == getattr(expected, name).dtype
                   for t, name in zip(module.select_tree(*args), names)):
            return False
    return True
