"""AOTAutograd: its config, its compiled node's saved state, and the tracing context's grad node.
No version shim: each private name below (none has a public API) is alike on 2.11-2.14 (2.11.0-2.14.1
sources); a ``getattr`` default only guards a later torch."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


__all__ = ["aot_autograd_cache", "aot_cached_backward", "aot_serializes_backward_graphs_with", "record_cache_artifact", "register_cache_artifact", "GRAD_NODE_META", "aot_autograd", "aot_backward_graph", "aot_config_patch",
           "aot_mutated_inputs", "aot_mutates_differentiable_input",
           "aot_records_no_donated_buffers", "aot_saved_for_backward", "current_grad_node_name",
           "make_boxed_func"]


def aot_autograd(**kwargs: Any) -> Callable:
    from torch._dynamo.backends.common import aot_autograd as _aot_autograd

    return _aot_autograd(**kwargs)


def make_boxed_func(fn: Callable) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func as _make_boxed_func

    return _make_boxed_func(fn)


def aot_config_patch(**settings: Any) -> Any:
    """AOTAutograd config for one compile; settings a torch lacks are skipped (the two passed,
    ``donated_buffer`` and ``enable_autograd_cache``, are on 2.11-2.14)."""
    import torch._functorch.config as aot_config

    return aot_config.patch(**{k: v for k, v in settings.items() if hasattr(aot_config, k)})


def aot_records_no_donated_buffers() -> None:
    """While AOTAutograd compiles a graph with ``donated_buffer=False``: its metadata's
    ``bw_donated_idxs`` None -> [] (no donated buffers).  Its backward refuses ``retain_graph``
    and ``create_graph`` unless [] while the global flag is on, read (from 2.12, ContextVar
    config) in the context the engine copied at backward's start, which no toggle in a region's
    backward reaches.  A lazy backward first run with ``retain_graph`` sets [] itself."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is not None and getattr(meta, "bw_donated_idxs", ()) is None:
        meta.bw_donated_idxs = []


def aot_mutates_differentiable_input() -> bool:
    """While AOTAutograd compiles a graph: does it write in place to an input that
    requires grad?  Unknown metadata answers True (the cautious answer)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    infos = getattr(meta, "input_info", None)
    if infos is None:
        return True
    return any(i.requires_grad and (i.mutates_data or i.mutates_metadata) for i in infos)


def aot_cached_backward(forward_cls: type) -> Any:
    """On a class loaded from AOTAutograd's cache: the object its lazy backward is deserialized
    from (``SerializedGraphModule``, whose ``deserialize`` the class's
    ``CachedAutogradLazyBackwardCompileInfo.bw_module_fn`` is, 2.11-2.14); else None."""
    info = getattr(forward_cls, "_lazy_backward_info", None)
    return getattr(getattr(info, "bw_module_fn", None), "__self__", None)


def aot_backward_graph(forward_cls: type) -> Any:
    """The aten backward graph of an AOTAutograd ``CompiledFunction`` class, as traced: kept for
    its lazy compile (``_lazy_backward_info.bw_module``), compiled or not; None where not kept
    (a graph from AOTAutograd's cache keeps it serialized, without the sizes of its trace)."""
    graph = getattr(getattr(forward_cls, "_lazy_backward_info", None), "bw_module", None)
    return graph if isinstance(graph, torch.fx.GraphModule) else None


def aot_saved_for_backward(ctx: Any) -> tuple[list, list, list]:
    """(SymInts, tensors, opaque objects) an AOTAutograd node's forward saved, in its backward
    graph's order (2.11-2.14 keep tensors saved without a version check, and opaques, apart)."""
    return (list(ctx.symints), [*ctx.saved_tensors, *getattr(ctx, "_tensors_no_vc_check", ())],
            list(getattr(ctx, "opaque_objects", ())))


def aot_mutated_inputs() -> tuple[int, ...]:
    """While AOTAutograd compiles a graph: the positions of the inputs it writes in place
    (a BatchNorm's running statistics in training mode), by its metadata."""
    context = torch._guards.TracingContext.try_get()
    infos = getattr(getattr(context, "fw_metadata", None), "input_info", None) or ()
    return tuple(i for i, info in enumerate(infos) if info.mutates_data or info.mutates_metadata)


GRAD_NODE_META = "dynbatch_grad"  # node.meta key: the Dynamo grad node a batched_grad call came from


def current_grad_node_name() -> str | None:
    """The Dynamo grad node AOTAutograd is tracing now (it replays node meta while it traces;
    ``torch.fx.traceback``'s meta functions, public names, alike on 2.11-2.14)."""
    meta = torch.fx.traceback.get_current_meta() if torch.fx.traceback.has_preserved_node_meta() else None
    return (meta or {}).get(GRAD_NODE_META)


def aot_autograd_cache() -> type:
    """AOTAutograd's cache class, whose static ``_lookup(key, ...)`` finds an entry by its key
    (private; ``key`` first on 2.11-2.14)."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    return AOTAutogradCache


def record_cache_artifact(artifact_type: str, key: str, content: bytes) -> None:
    """Put an artifact in what ``torch.compiler.save_cache_artifacts()`` saves (private manager
    behind the public mega-cache API; same on 2.11-2.14)."""
    from torch.compiler._cache import CacheArtifactManager

    CacheArtifactManager.record_artifact(artifact_type, key, content)


def register_cache_artifact(artifact_type: str, populate: Callable[[str, bytes], None]) -> None:
    """Teach ``torch.compiler.load_cache_artifacts()`` an artifact type: ``populate(key, content)``
    writes one where its cache reads it (private factory; same on 2.11-2.14).  Idempotent."""
    from torch.compiler._cache import CacheArtifact, CacheArtifactFactory

    if artifact_type in CacheArtifactFactory._artifact_types:
        return

    class Artifact(CacheArtifact):
        def populate_cache(self) -> None:
            populate(self.key, self.content)

        @staticmethod
        def type() -> str:
            return artifact_type

    Artifact.__name__ = Artifact.__qualname__ = f"{artifact_type}_artifact"
    CacheArtifactFactory.register(dataclasses.dataclass(frozen=True)(Artifact))


def aot_serializes_backward_graphs_with(wrap: Callable[[Callable], Callable]) -> None:
    """Wrap the function AOTAutograd's cache serializes a lazy backward graph with
    (``graph_compile.serialize_graph_module``, which clears its node meta in place;
    private, imported by name into graph_compile on 2.11-2.14).  Idempotent."""
    from torch._functorch._aot_autograd import graph_compile

    original = graph_compile.serialize_graph_module
    if getattr(original, "_dynbatch_original", None) is None:
        wrapped = wrap(original)
        wrapped._dynbatch_original = original
        graph_compile.serialize_graph_module = wrapped
