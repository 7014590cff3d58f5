"""The engine's per-op timings as a table: time per op type (forward and backward) and the
slowest nodes, averaged per step, so that the next optimisation is chosen from data. Every
engine phase is timed per step (two clock reads per op); `explain(model, profile=True)` prints
this, `reset(model)` starts a new measurement."""
from __future__ import annotations


def _sessions(state) -> list:
    from ortrain.engine.runner import Runner

    runners = list(state.runners.values()) + list(state.loss_runners.values())
    return [r.session for r in runners if isinstance(r, Runner)]


def reset(state) -> None:
    for s in _sessions(state):
        s.reset_profile()


def collect(state) -> dict:
    """{"steps": n, "phases": {phase: ms/step}, "ops": [(phase, op, calls/step, ms/step)],
    "nodes": [(phase, op, name, ms/step)]}, summed over every engine graph of the model."""
    ops: dict = {}
    nodes: list = []
    phases: dict = {}
    for s in _sessions(state):
        rows, ph = s.profile()
        for name, (runs, sec) in ph.items():
            r0, s0 = phases.get(name, (0, 0.0))
            phases[name] = (r0 + runs, s0 + sec)
        for phase, op, node, calls, sec in rows:
            c0, s0 = ops.get((phase, op), (0, 0.0))
            ops[(phase, op)] = (c0 + calls, s0 + sec)
            nodes.append((phase, op, node, sec))
    steps = max((runs for runs, _ in phases.values()), default=0)
    if not steps:
        return {"steps": 0, "phases": {}, "ops": [], "nodes": []}
    per = 1e3 / steps
    return {
        "steps": steps,
        "phases": {k: sec * per for k, (_, sec) in phases.items()},
        "ops": sorted(((p, o, c / steps, sec * per) for (p, o), (c, sec) in ops.items()), key=lambda r: -r[3]),
        "nodes": sorted(((p, o, n, sec * per) for p, o, n, sec in nodes), key=lambda r: -r[3]),
    }


def format_profile(state, top_ops: int = 20, top_nodes: int = 10) -> list[str]:
    p = collect(state)
    if not p["steps"]:
        return ["  profile: no engine step has run yet"]
    total = sum(p["phases"].values())
    phases = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(p["phases"].items()))
    lines = [f"  profile: engine time per step {total:.1f} ms ({phases}), averaged over {p['steps']} steps",
             f"    {'phase':9s} {'op type':30s} {'calls':>6s} {'ms/step':>9s} {'share':>6s}"]
    for phase, op, calls, ms in p["ops"][:top_ops]:
        lines.append(f"    {phase:9s} {op:30s} {calls:6.0f} {ms:9.2f} {100 * ms / total:5.1f}%")
    lines.append("    slowest nodes:")
    for phase, op, node, ms in p["nodes"][:top_nodes]:
        lines.append(f"    {phase:9s} {op:22s} {ms:8.2f} ms  {node}")
    return lines
