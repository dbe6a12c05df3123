"""The study's verdict on its winner, from the held-out confirmation: what to do, and only as much
as the held-out evidence supports (``recommendation``), judged by the held-out speedup of the
kind the winner was chosen by (``verdict_key``). A setting is recommended only where its
held-out speedup beats vanilla beyond the noise: its one-sided 95 % lower confidence bound
(``held_out_<key>_lcb``, ``tuner.measure.intervals.lower_bound``) above 1 plus the A/A control's
bias (``margin``). ``self_control``: a study of vanilla against itself, which never recommends
vanilla over itself. Engine studies recommend from their per-level decisions
(``tuner.answer.decide``)."""

from __future__ import annotations

from typing import Any, Mapping

from tuner.measure.bounds import credible
from tuner.measure.figures import split_level


def held_out(confirmed: Mapping[str, Any]) -> dict[str, Any]:
    """The held-out confirmation's numbers without their ``held_out_`` prefix."""
    return {k.removeprefix("held_out_"): v for k, v in confirmed.items()
            if k.startswith("held_out_")}


def verdict_key(objective: str, confirmed: Mapping[str, Any]) -> str:
    """Which held-out speedup the verdict reads: the decode phase's where the study was chosen
    by it (``decode_speedup``, at any level) and the confirmation measured it, else the
    end-to-end one. The winner is judged on held-out prompts by what it was chosen by."""
    if split_level(objective)[0] == "decode_speedup" and \
            "held_out_decode_speedup" in confirmed:
        return "decode_speedup"
    return "speedup"


def quality_line(values: Mapping[str, Any]) -> str:
    """E.g. 'perplexity 4.10 vs vanilla 4.32 (ratio 0.949), quality drop +0.000, within the
    bound'."""
    parts = []
    if "perplexity" in values:
        parts.append(f"perplexity {values['perplexity']:.3f} vs vanilla "
                     f"{values['vanilla_perplexity']:.3f} "
                     f"(ratio {values['perplexity_ratio']:.3f})")
    if "quality_drop" in values:
        parts.append(f"quality drop {values['quality_drop']:+.3f}")
    if values.get("feasible") is not None:
        parts.append("within the bound" if values["feasible"] else "BREAKS the bound")
    return ", ".join(parts) or "not scored"


def relative(ratio: float) -> str:
    """1.25 -> '25 % faster than vanilla', 0.84 -> '16 % slower than vanilla'."""
    if abs(ratio - 1.0) < 0.005:
        return "as fast as vanilla"
    return f"{abs(ratio - 1) * 100:.0f} % {'faster' if ratio > 1 else 'slower'} than vanilla"


def recommendation(confirmed: Mapping[str, float], min_held_out: int = 3,
                   objective: str = "speedup", margin: float = 0.0) -> str:
    """What to do, and only as much as the held-out evidence supports; judged by the held-out
    speedup of the kind the winner was chosen by (``verdict_key``), named in the text, beyond
    the noise (module docstring)."""
    if not confirmed:
        return "no held-out prompts: the winner is unconfirmed (task.n_held_out=0)"
    key = verdict_key(objective, confirmed)
    phase = " in the decode phase" if key == "decode_speedup" else ""
    speed = confirmed[f"held_out_{key}"]
    low = confirmed.get(f"held_out_{key}_min", speed)
    high = confirmed.get(f"held_out_{key}_max", speed)
    prompts = int(confirmed.get("held_out_prompts", 0))
    if speed <= 1.0:
        return (f"nothing beat vanilla on the held-out prompts (the winner: {speed:.2f}x"
                f"{phase}, {relative(speed)}): use vanilla decoding on this hardware/model pair")
    if prompts < min_held_out:
        return (f"not enough evidence: the winner ran {speed:.2f}x vanilla{phase} on only "
                f"{prompts} held-out prompt(s) (min {low:.2f}x, max {high:.2f}x), fewer than "
                f"min_held_out_prompts={min_held_out}: keep vanilla decoding, or confirm on more "
                "prompts (task.n_held_out, then +best=<study> to replay)")
    if confirmed.get("held_out_feasible") == 0.0:
        held = held_out(confirmed)
        return (f"the winner ran {speed:.2f}x vanilla{phase} on held-out "
                f"prompts but broke the quality bound there ({quality_line(held)}): prefer "
                "vanilla decoding unless that loss is acceptable")
    lcb = confirmed.get(f"held_out_{key}_lcb")
    length = confirmed.get("held_out_decode_tokens_per_step")
    capped = None if lcb is None else credible(lcb, length)    # what speculation can explain
    if capped is not None and capped < lcb and capped <= 1.0 + margin:
        return (f"not beyond the noise: the winner ran {speed:.2f}x vanilla{phase} on "
                f"{prompts} held-out prompts but accepted {length:.2f} tokens per decode step, "
                "so no gain can come from speculation: keep vanilla decoding")
    if lcb is None or lcb <= 1.0 + margin:
        bound = "no lower bound (one prompt)" if lcb is None else \
            f"its 95 % lower confidence bound is {lcb:.2f}x"
        beyond = f" and the A/A control's bias {100 * margin:.1f} %" if margin else ""
        return (f"not beyond the noise: the winner ran {speed:.2f}x vanilla{phase} on "
                f"{prompts} held-out prompts (min {low:.2f}x, max {high:.2f}x), but {bound}, "
                f"not above 1.00{beyond}: keep vanilla decoding, or confirm on more prompts "
                "(task.n_held_out, then +best=<study> to replay)")
    lossy = ""
    if "held_out_perplexity_ratio" in confirmed:
        lossy = (f" (lossy: perplexity {confirmed['held_out_perplexity_ratio']:.3f}x vanilla's"
                 + (f", quality drop {confirmed['held_out_quality_drop']:+.3f}"
                    if "held_out_quality_drop" in confirmed else "") + ")")
    return (f"use the best parameters: {speed:.2f}x vanilla{phase} ({relative(speed)}) on "
            f"{prompts} held-out prompts, min {low:.2f}x, max {high:.2f}x, 95 % lower bound "
            f"{lcb:.2f}x{lossy}")


def self_control(confirmed: Mapping[str, float], objective: str = "speedup") -> str:
    """A study of method=vanilla: vanilla against itself, an A/A control of its path."""
    if not confirmed:
        return ("use vanilla decoding: this study measured vanilla against itself (an A/A "
                "control of this path; no held-out prompts)")
    key = verdict_key(objective, confirmed)
    speed = confirmed[f"held_out_{key}"]
    lcb = confirmed.get(f"held_out_{key}_lcb")
    shown = "" if lcb is None else f", 95 % lower bound {lcb:.3f}x"
    return (f"use vanilla decoding: this study measured vanilla against itself (an A/A control "
            f"of this path): held out {speed:.3f}x{shown}, the path's own noise, never a gain")
