"""Options of the dynbatch backend, parsed from ``torch.compile(mode=, options=)``.

Keys that start with ``dynbatch.`` are dynbatch's; every other key, and
``mode``, go to Inductor unchanged (and are validated by Inductor's rules).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from . import _compat

PREFIX = "dynbatch."
INNER_COMPILERS = ("inductor", "aot_eager")
ON_UNSUPPORTED = ("fallback", "error")


@dataclasses.dataclass(frozen=True)
class Options:
    # Who lowers the batched graph: Inductor (C++/Triton) or AOTAutograd with
    # eager kernels, which skips codegen and suits large test sweeps.
    inner_compiler: str = "inductor"
    # What to do with a graph the pass cannot batch: run it eagerly (with a
    # logged reason) or raise dynbatch.UnsupportedGraph.
    on_unsupported: str = "fallback"
    # Keep text snapshots of each compiled graph in dynbatch.compile_records().
    record_graphs: bool = True
    # Inductor config patches derived from mode= and non-dynbatch options=.
    inductor_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def known_names(cls) -> list[str]:
        return [PREFIX + f.name for f in dataclasses.fields(cls) if f.name != "inductor_config"]

    @classmethod
    def from_compile_args(cls, mode: str | None = None, options: Mapping[str, Any] | None = None) -> "Options":
        ours, inductor_options = {}, {}
        for key, value in (options or {}).items():
            if key.startswith(PREFIX):
                ours[key[len(PREFIX):]] = value
            else:
                inductor_options[key] = value
        unknown = sorted(PREFIX + k for k in ours if PREFIX + k not in cls.known_names())
        if unknown:
            raise ValueError(
                f"dynbatch: unknown option(s) {unknown}; known dynbatch options are {cls.known_names()}"
            )
        _check_choice("inner_compiler", ours.get("inner_compiler", "inductor"), INNER_COMPILERS)
        _check_choice("on_unsupported", ours.get("on_unsupported", "fallback"), ON_UNSUPPORTED)
        if "record_graphs" in ours and not isinstance(ours["record_graphs"], bool):
            raise ValueError("dynbatch: option dynbatch.record_graphs takes a bool")
        inductor_config = _compat.inductor_config_patches(mode, inductor_options)
        return cls(**ours, inductor_config=inductor_config)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"dynbatch: option {PREFIX}{name}={value!r}; choose one of {list(choices)}")
