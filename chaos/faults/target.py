"""Faults on the echo targets: hold their answers past the HTTP timeout, or crash them.

Both act only through `NemesisContext.targets()` and choose their targets with the fault's
seeded `rng`, from the targets sorted by name, so a schedule replays the same choices.

- `hang_target`: open a hang window of `planned.duration` seconds on `count` targets. A
  delivery arriving in it is held unanswered until it closes, then follows its script: the
  worker times out, the target may still record a 2xx, and the job is delivered again.
- `kill_target`: SIGKILL `count` targets; heal restarts them on the same address, resuming
  each job's script from the log. A delivery being answered at the kill may be recorded
  2xx by the target and never reach the worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from skiplock.chaos.nemesis import (
    Fault,
    FaultSkipped,
    NemesisContext,
    PlannedFault,
    TargetHandle,
    register,
)


def _choose(fault: Fault) -> list[TargetHandle]:
    """`count` targets (all if fewer), chosen with the fault's rng; FaultSkipped if none."""
    targets: Sequence[TargetHandle] = sorted(fault.ctx.targets(), key=lambda t: t.name)
    if not targets:
        raise FaultSkipped("no echo target is running")
    return fault.rng.sample(list(targets), min(fault.planned.count, len(targets)))


@register
class HangTarget(Fault):
    """Hold every delivery arriving at the chosen targets for `planned.duration` seconds.
    The window closes by itself; heal closes it at once if it is still open (a run that
    ends early), so a held delivery never outlives the fault's recorded window."""

    kind = "hang_target"

    def __init__(self, ctx: NemesisContext, planned: PlannedFault) -> None:
        super().__init__(ctx, planned)
        self._hung: list[TargetHandle] = []
        self._until = 0.0  # monotonic; the windows close by themselves after this

    def apply(self) -> list[str | None]:
        seconds = self.planned.duration
        if seconds <= 0:
            raise FaultSkipped("hang_target needs a duration above 0")
        self.data["seconds"] = seconds
        chosen = _choose(self)
        unreachable: dict[str, str] = {}
        for target in chosen:
            # Taken before the call: the target's own window ends a little after this.
            self._until = time.monotonic() + seconds
            try:
                target.hang(seconds)
            except OSError as exc:  # a target down (killed by another fault) holds nothing
                unreachable[target.name] = f"{type(exc).__name__}: {exc}"
                continue
            self._hung.append(target)
        if unreachable:
            self.data["unreachable"] = unreachable
        if not self._hung:
            raise FaultSkipped(f"no chosen target answered: {unreachable}")
        return [t.name for t in self._hung]

    def heal(self) -> None:
        # Only when early: once the window has ended, another fault's window may be open on
        # the same target, and closing it would cut that one short.
        if time.monotonic() >= self._until:
            return
        errors: dict[str, str] = {}
        for target in self._hung:
            try:
                target.hang(0)
            except OSError as exc:  # down: nothing is held any more
                errors[target.name] = f"{type(exc).__name__}: {exc}"
        if errors:
            self.data["heal_errors"] = errors


@register
class KillTarget(Fault):
    """SIGKILL the chosen targets; heal restarts each on its address. Deliveries in flight
    at the kill are lost unrecorded (the worker sees a connection error); those answered
    before it stay in the log."""

    kind = "kill_target"

    def __init__(self, ctx: NemesisContext, planned: PlannedFault) -> None:
        super().__init__(ctx, planned)
        self._killed: list[TargetHandle] = []
        self._killed_at = 0.0

    def apply(self) -> list[str | None]:
        chosen = _choose(self)
        self.data["signal"] = "SIGKILL"
        self.data["seconds"] = self.planned.duration
        self._killed_at = time.monotonic()
        for target in chosen:
            target.kill()
            self._killed.append(target)
        return [t.name for t in self._killed]

    def heal(self) -> None:
        errors: dict[str, str] = {}
        for target in self._killed:
            try:
                target.restart()
            except Exception as exc:  # recorded with the event, then raised
                errors[target.name] = f"{type(exc).__name__}: {exc}"
        if self._killed:
            self.data["down_seconds"] = round(time.monotonic() - self._killed_at, 3)
        if errors:
            self.data["restart_errors"] = errors
            raise RuntimeError(f"kill_target could not restart {', '.join(errors)}: {errors}")
