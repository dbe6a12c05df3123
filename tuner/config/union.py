"""A union of methods as one study's method: the config a cross-method study (``method=auto``)
measures, and how a point of it splits back into one member's method and parameters.

A union's method config holds every member's own config (``members``: {name: the member's
``method`` mapping, as its YAML composes}) and one search space, the members' spaces side by
side under the parameter ``method`` (a categorical of the members' names):

    method                       the member a point builds
    <member>.<parameter>         that member's parameter, active where method is <member> (and
                                 where its own ``active_when`` holds, renamed alike)

Names are namespaced because two members may search one name over different ranges (γ of
speculative and of block) and Optuna keeps one distribution per name in a study. A point holds
``method`` and its member's parameters only (``point_space``): nothing of another member is
suggested, stored or shown. Nothing here loads or measures.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

METHOD = "method"          # the union's parameter naming the member
SEP = "."                  # <member>.<parameter>


def is_union(method: Mapping[str, Any]) -> bool:
    """Whether ``method`` (a study's method config) is a union of methods (its members' configs
    by name; ``method=auto``'s own YAML, which names them, is not one yet)."""
    return isinstance(method.get("members"), Mapping)


def namespaced(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """A member's parameters under its name: ``{"<name>.<parameter>": value}``."""
    return {f"{name}{SEP}{key}": value for key, value in params.items()}


def member_space(name: str, space: Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
    """A member's space under its name, each parameter active for that member only."""
    out = {}
    for key, spec in space.items():
        spec = dict(spec)
        conditions = {f"{name}{SEP}{other}": list(values)
                      for other, values in (spec.get("active_when") or {}).items()}
        spec["active_when"] = {METHOD: [name], **conditions}
        out[f"{name}{SEP}{key}"] = spec
    return out


def union_method(members: Mapping[str, Mapping[str, Any]], unpriced: Sequence[str] = ()
                 ) -> dict[str, Any]:
    """The union's method config of ``members`` ({name: its method config}, the first is
    trial 0's): lossless where every member is, a draft model loaded where any needs one.
    ``unpriced``: members no hardware profile prices (measured at their heuristic start point,
    never ranked)."""
    if not members:
        raise ValueError("a union of methods needs at least one member")
    names = list(members)
    space: dict[str, dict] = {METHOD: {"type": "categorical", "choices": names}}
    for name, method in members.items():
        space.update(member_space(name, method.get("space") or {}))
    first = names[0]
    return {"kind": "auto", "_target_": f"auto: {', '.join(names)}",    # what reports show
            "members": {n: dict(m) for n, m in members.items()},
            "unpriced": [n for n in names if n in set(unpriced)],
            "lossless": all(bool(m.get("lossless", True)) for m in members.values()),
            "needs_draft": any(bool(m.get("needs_draft")) for m in members.values()),
            "params": {METHOD: first, **namespaced(first, members[first].get("params") or {})},
            "space": space}


def member_of(method: Mapping[str, Any], params: Mapping[str, Any]
              ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(member name, its method config, its parameters: its defaults with the point's values) of
    a union's point ``params``; a union's parameters of other members are ignored."""
    name = str(params[METHOD])
    members = method["members"]
    if name not in members:
        raise ValueError(f"method={name!r} is not a member of this study: allowed are "
                         f"{list(members)}")
    member = dict(members[name])
    prefix = f"{name}{SEP}"
    own = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
    return name, member, {**(member.get("params") or {}), **own}


def member_default(method: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Every parameter of member ``name``'s default, as a point of the union."""
    return {METHOD: name, **namespaced(name, method["members"][name].get("params") or {})}


def params_at(method: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter that builds the point ``values`` (searched ones; fixed ones at their
    default): the method's defaults under them, a union's member's defaults for a union."""
    if is_union(method) and METHOD in values:
        return {**member_default(method, str(values[METHOD])), **values}
    return {**dict(method.get("params") or {}), **values}


def point_space(method: Mapping[str, Any], point: Mapping[str, Any]
                ) -> dict[str, Mapping[str, Any]]:
    """The parameters a union's ``point`` suggests: ``method`` and its member's space (a plain
    method's whole space: unchanged)."""
    space = dict(method.get("space") or {})
    if not is_union(method) or METHOD not in point:
        return space
    prefix = f"{point[METHOD]}{SEP}"
    return {k: v for k, v in space.items() if k == METHOD or k.startswith(prefix)}


def member_points(name: str, points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A member's points (its own parameter names) as points of the union."""
    return [{METHOD: name, **namespaced(name, p)} for p in points]
