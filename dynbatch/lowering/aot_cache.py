"""AOTAutograd's cache for dynbatch's graphs, and what a hit must not lose.

NOTE [What a cache hit must not lose]
A warm process loads a graph from AOTAutograd's cache instead of tracing it: the
inner compiler does not run, and with it neither does what dynbatch learns of each
aten graph there (lowering/inductor.py, ``_remember``): the random ops, the inputs
written in place, the node counts and texts.  A region decides from them how a grad
taken outside is computed (a graph with random ops is never re-run for a backward),
so a hit that forgot them would give a wrong gradient.  Each miss therefore writes
what it learnt beside the cache entry, under the entry's own key, and a lookup with
nothing beside it is made a miss: a hit always brings the record of its graph.  The
records travel with torch's mega-cache (``torch.compiler.save_cache_artifacts``) as
artifacts of their own; load them in a process that imported dynbatch.

The cache is on (``dynbatch.aot_cache``, default True) where that record is
the whole story: Inductor lowers the graph, and it holds no batched grad (a batched grad's memory plan is read from the traced
graph and not kept; those graphs, chunk programs and the saved-activations programs
trace as before).  Inductor's own cache of the compiled kernels applies to all.
A hit also loads the compiled programs without the inner compiler that keeps their
large CPU buffers (NOTE [Reused CPU buffers]): ``loaded`` does that for it.  A grad taken
outside a graph from the cache batches its saved activations from the backward graph its
entry kept (NOTE [The backward graph of a hit]).  A miss keeps its graph's meta
(``_meta_kept``): saving an entry strips it in place.  On by default; a graph compiled in
the background (lowering/background.py) skips it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from typing import Any, Callable, Iterator

import torch

from .. import _compat, fail_soft
from ..records import CompileRecord

log = logging.getLogger("dynbatch")

ARTIFACT_TYPE = "dynbatch_record"
# What a graph's record keeps that a hit must bring back (the fields _remember fills).
_FIELDS = ("random_ops", "mutates_differentiable_input", "mutated_inputs", "aten_node_counts", "aten_graphs")


@dataclasses.dataclass
class _Lowering:
    """One lowering that may use the cache, as the hooks below meet it."""

    on_loaded: Callable[[Any], None] | None  # what each program a hit loads needs (kept buffers)
    key: str | None = None  # the AOTAutograd cache key, once looked up
    hit: dict | None = None  # the record a hit brought


_current = threading.local()


@contextlib.contextmanager
def lowering(record: CompileRecord, on_loaded: Callable[[Any], None] | None) -> Iterator[None]:
    """Around one AOTAutograd call with its cache on: a hit fills ``record`` from the record
    its miss wrote; a miss writes ``record`` beside the entry once the call returns."""
    state = _Lowering(on_loaded)
    previous, _current.state = getattr(_current, "state", None), state
    try:
        yield
    finally:
        _current.state = previous
    if state.hit is not None:
        for name in _FIELDS:
            setattr(record, name, type(getattr(record, name))(state.hit[name]))
    elif state.key is not None:
        _write(state.key, {name: getattr(record, name) for name in _FIELDS})


_hooked = False


def install() -> None:
    """Hook AOTAutograd's lookup and Inductor's loaded programs (once).  Where a hook cannot
    go in, the cache stays off for dynbatch's graphs (``available``), as before it existed."""
    global _hooked
    try:
        _install_hooks()
    except Exception as e:  # noqa: BLE001 - an internal moved: graphs are traced, as without the cache
        fail_soft.hook_failed("AOTAutograd's cache for dynbatch's graphs", e)
    else:
        _hooked = True


def available() -> bool:
    return _hooked


def _install_hooks() -> None:
    cache = _compat.aot_autograd_cache()
    if getattr(cache._lookup, "_dynbatch_original", None) is None:
        original = cache._lookup

        def _lookup(key, *args, **kwargs):
            state = getattr(_current, "state", None)
            if state is None:
                return original(key, *args, **kwargs)
            state.key = key
            saved = _read(key)
            if saved is None:
                return None  # nothing beside the entry: a miss, whose compile writes it
            found = original(key, *args, **kwargs)
            if found is not None:
                state.hit = saved
                _compat.record_cache_artifact(ARTIFACT_TYPE, key, _encode(saved))
            return found

        _lookup._dynbatch_original = original
        cache._lookup = staticmethod(_lookup)
    compiled = _compat.inductor_compiled_graph_class()
    if getattr(compiled.post_compile, "_dynbatch_original", None) is None:
        post_compile = compiled.post_compile

        def loaded(self, *args, **kwargs):
            out = post_compile(self, *args, **kwargs)
            state = getattr(_current, "state", None)
            if state is not None and state.key is not None and state.hit is not None and state.on_loaded:
                state.on_loaded(self)
            return out

        loaded._dynbatch_original = post_compile
        compiled.post_compile = loaded
    # Saving an entry strips the backward graph AOTAutograd keeps for its lazy compile of
    # its node meta, in place; the saved activations' path reads the sizes there: serialize
    # it, then give the graph its meta back.
    _compat.aot_serializes_backward_graphs_with(_meta_kept)
    _compat.register_cache_artifact(ARTIFACT_TYPE, _write_encoded)


def _meta_kept(serialize: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def serialize_keeping_meta(gm: Any) -> Any:
        kept = (gm.meta, [(node, node.meta) for node in gm.graph.nodes])
        portable = _portable(gm)
        try:
            serialized = serialize(gm)  # what it pickles is taken now, without the meta
        finally:
            gm.meta = kept[0]
            for node, meta in kept[1]:
                node.meta = meta
        if portable is not None:
            serialized._dynbatch_backward = portable  # pickled with the entry, mega-cache included
        return serialized

    return serialize_keeping_meta


# NOTE [An entry needs its backward]
# AOTAutograd writes a graph's entry once its backward has compiled, which it does lazily, at
# the first backward.  A graph that is never differentiated, though its inputs require grad,
# is never written, and every process traces it again, stock's included: MACE's calculator
# (parameters frozen, positions requiring grad, forces with create_graph) traced its forces
# for 20-25 s in each warm process.  ``dynbatch.aot_cache="with_backward"`` compiles the
# backward with the forward (AOTAutograd's ``force_non_lazy_backward_lowering``), so the cold
# call writes the entry: a cold compile longer by the backward's, for warm ones that load it.
# Not the default: a process that compiles once would pay for a backward it never runs.

# --- the backward graph a hit brings ---------------------------------------------
# NOTE [The backward graph of a hit]
# A grad taken outside a compiled graph batches AOTAutograd's backward graph over its saved
# activations (region/saved_backward.py).  A hit's own copy of that graph is rebuilt from
# its Python code, which differs from the traced graph (57 nodes against 36 for a slicing
# energy; its batched program failed to lower) and has lost which sizes were symbolic.  So
# each miss pickles the traced graph as it is (GraphPickler, node by node, no meta) with
# the symbolic dims of its placeholders, on the object the entry keeps for the lazy
# backward; a hit's saved-activations path reads that (``backward_graph``) and lowers the
# same program as the cold process.  An entry without it recomputes, as before.

SYMBOLIC_DIMS = "dynbatch_symbolic_dims"  # placeholder meta of a graph a hit brought back


def _portable(gm: Any) -> tuple[bytes, list] | None:
    """The traced backward graph, pickled node by node without meta, and per placeholder
    which of its sizes were symbolic; None where it cannot be pickled (logged)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    symbolic = [symbolic_dims(node.meta.get("val")) for node in gm.graph.find_nodes(op="placeholder")]
    copy = torch.fx.GraphModule(gm, gm.graph)  # the graph and attributes, not the module's meta
    copy.meta = {}
    try:
        data = GraphPickler.dumps(copy, Options(ops_filter=None, node_metadata_key_filter=lambda key: False))
    except Exception as e:  # noqa: BLE001 - a hit of this entry recomputes its outside grads
        log.debug("dynbatch: a backward graph is not kept with its cache entry: %s: %s", type(e).__name__, e)
        return None
    return data, symbolic


def symbolic_dims(value: Any) -> tuple[bool, ...] | bool | None:
    """Which sizes of a traced value are symbolic: per dim for a tensor, a bool for an int."""
    if isinstance(value, torch.Tensor):
        return tuple(_compat.is_symbolic(size) for size in value.shape)
    if isinstance(value, torch.SymInt):
        return _compat.is_symbolic(value)
    return None


def backward_graph(forward_cls: type) -> torch.fx.GraphModule | None:
    """The traced backward graph of a class a cache hit made, each placeholder's symbolic
    sizes in its meta (``SYMBOLIC_DIMS``); None where its entry has none."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    portable = getattr(_compat.aot_cached_backward(forward_cls), "_dynbatch_backward", None)
    if portable is None:
        return None
    data, symbolic = portable
    try:
        gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    except Exception as e:  # noqa: BLE001 - an entry of another torch: its outside grads recompute
        log.info("dynbatch: the backward graph kept with a cache entry did not load: %s: %s", type(e).__name__, e)
        return None
    for node, dims in zip(gm.graph.find_nodes(op="placeholder"), symbolic):
        node.meta[SYMBOLIC_DIMS] = dims
    return gm


# --- the records beside the entries ------------------------------------------------

def _path(key: str) -> str:
    return os.path.join(_compat.inductor_cache_dir(), "dynbatch_records", f"{key}.json")


def _encode(saved: dict) -> bytes:
    return json.dumps(saved, sort_keys=True).encode()


def _read(key: str) -> dict | None:
    try:
        with open(_path(key), "rb") as f:
            saved = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return saved if all(name in saved for name in _FIELDS) else None


def _write(key: str, saved: dict) -> None:
    content = _encode(saved)
    _write_encoded(key, content)
    _compat.record_cache_artifact(ARTIFACT_TYPE, key, content)


def _write_encoded(key: str, content: bytes) -> None:
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            f.write(content)
        os.replace(temporary, path)  # whole or absent: a reader never sees half a record
    except OSError as e:  # a read-only cache: the next process traces the graph again
        log.debug("dynbatch: could not write a graph's record beside its cache entry: %s", e)
