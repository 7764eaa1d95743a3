"""Which fields of its case a plugin reads: ``run.spec`` records every field asked of it.

The judge maps a predicted difference on a plugin itself (``session.mapping.on_itself``: it reruns
the plugin with the mapped values of its case, e.g. ``parallel.weighting: by_size``) only where the
plugin reads those values: a program that hard-codes its weighting would rerun the same computation,
and its gap to the other side would be the predicted difference itself. A plugin's run reports what
it read (``Trajectory.meta["case_read"]``), the same way in both frameworks' harnesses.

A field counts as read when it is asked for by name (``spec["parallel"]["weighting"]``,
``par.get("clip")``, ``"clip" in par``: also where the case leaves it out). Nothing else marks a
field: a field read from a copy (``dict(par)``, ``{**par}``, ``copy.deepcopy``, a pickle) or found by
iterating (``par.items()``, ``json.dumps``) is not recorded, so such a plugin is not mapped on itself
and the judge reports its residual as not judged, never a residual made by a value the plugin may not
have read. (A copy's nested mappings are still recorded: ``dict(spec)["parallel"]["weighting"]`` is.)
Reads that the harness makes for the plugin (``run.shard()`` reads ``parallel.shard``) count as the
plugin's: the rows it trains on follow the case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ReadSpec", "paths_read", "reads"]


class ReadSpec(dict):
    """A case (nested dicts) that records the dotted path of every field read into ``seen`` (shared by its parts)."""

    def __init__(self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), path: str = "",
                 seen: set[str] | None = None) -> None:
        super().__init__(data)
        self._path = path
        self._seen: set[str] = set() if seen is None else seen
        for k, v in dict.items(self):
            if isinstance(v, dict) and not isinstance(v, ReadSpec):
                dict.__setitem__(self, k, ReadSpec(v, self._at(k), self._seen))

    def _at(self, k: Any) -> str:
        return f"{self._path}.{k}" if self._path else str(k)

    def __getitem__(self, k: Any) -> Any:
        self._seen.add(self._at(k))
        return dict.__getitem__(self, k)

    def get(self, k: Any, default: Any = None) -> Any:
        self._seen.add(self._at(k))
        return dict.get(self, k, default)

    def __contains__(self, k: object) -> bool:
        self._seen.add(self._at(k))
        return dict.__contains__(self, k)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled or deep-copied as the plain case (its reads are not recorded)
        return dict, ({k: (v.__reduce__()[1][0] if isinstance(v, ReadSpec) else v) for k, v in dict.items(self)},)


def paths_read(spec: Any) -> list[str] | None:
    """The dotted paths ``spec`` (a :class:`ReadSpec`) recorded, sorted; ``None`` for a plain dict (nothing recorded)."""
    return sorted(spec._seen) if isinstance(spec, ReadSpec) else None


def reads(seen: Iterable[str], leaf: str) -> bool:
    """Whether a run that read ``seen`` (:func:`paths_read`) read the field ``leaf`` (``"parallel.clip.where"``) by name."""
    return leaf in set(seen)
