"""The devnet's live terminal view (rich)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

if TYPE_CHECKING:
    from node.devnet.orchestrator import Devnet


def render(dn: Devnet) -> Any:
    """One frame: run progress, learning, nodes by role and state, verdicts, bans, transfers."""
    st = dn.status
    wall = time.monotonic() - dn.started
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[b]policy step[/b] {st.get('trainer_step', '-')}/{dn.o.steps}",
        f"[b]published[/b] {st.get('published_step', '-')}",
        f"[b]held-out pass[/b] start {_fmt(st.get('heldout_start'))} latest {_latest(st.get('heldout_latest'))}",
        f"[b]utilization[/b] {_fmt(st.get('utilization'))}",
        f"[b]wall[/b] {wall:.0f} s",
    )
    last = st.get("last_step") or {}
    tokens_s = sum(float(s.get("tokens_per_s", 0) or 0) for n, s in dn.node_status.items() if n.startswith(("worker", "adversary")))
    learn = Table.grid(padding=(0, 2))
    learn.add_row(
        f"[b]reward[/b] {_fmt(last.get('reward_mean'))}",
        f"[b]pass rate[/b] {_fmt(last.get('pass_rate'))}",
        f"[b]worker tokens/s[/b] {tokens_s:.0f}",
        f"[b]staleness[/b] {last.get('staleness', '-')}",
        f"[b]mismatch KL[/b] {_fmt(last.get('mismatch_kl'), 4)}",
        f"[b]ratio[/b] {_fmt(last.get('is_ratio_min'), 2)}–{_fmt(last.get('is_ratio_max'), 2)}",
        f"[b]clipped[/b] {_fmt(last.get('clipped_frac'))}",
        f"[b]state[/b] {str(st.get('state', 'starting'))[:70]}",
    )
    nodes = Table(title="nodes", expand=True)
    for col in ("name", "role", "process", "state"):
        nodes.add_column(col)
    for p in dn.group.procs:
        s = dn.node_status.get(p.name, {})
        state = s.get("state") or (f"holds {s.get('held_steps')}" if "held_steps" in s else "")
        nodes.add_row(p.name, p.role, "[green]up[/green]" if p.alive else "[red]down[/red]", str(state)[:60])
    verdicts = ", ".join(f"{k}: {v}" for k, v in sorted((st.get("verdicts_by_reason") or {}).items())) or "-"
    bans = ", ".join(f"{b['peer_id'][-8:]} ({b['reason']})" for b in st.get("banned") or []) or "none"
    peers = ", ".join(f"{k}: {v}" for k, v in sorted((st.get("peers_by_role") or {}).items())) or "-"
    bcast = ", ".join(f"{k}: {v:.2f}s" for k, v in (st.get("broadcast_s") or {}).items()) or "-"
    info = Table.grid(padding=(0, 2))
    info.add_row("[b]run page[/b]", f"{dn.coord_url}/")
    info.add_row("[b]gossip peers[/b]", peers)
    info.add_row("[b]verdicts[/b]", verdicts)
    info.add_row("[b]banned[/b]", bans)
    info.add_row("[b]publish time per step[/b]", bcast)
    for e in dn.events[-4:]:
        info.add_row("[dim]event[/dim]", e)
    return Panel(Group(head, learn, nodes, info), title="intellect-node devnet", border_style="cyan")


def _fmt(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def _latest(e: Any) -> str:
    """The latest held-out evaluation: ``pass rate [95 % interval] @ step``."""
    if not isinstance(e, dict) or not isinstance(e.get("heldout_pass_rate"), (int, float)):
        return "-"
    return f"{e['heldout_pass_rate']:.3f} [{_fmt(e.get('heldout_ci_low'))}–{_fmt(e.get('heldout_ci_high'))}] @ step {e.get('step')}"
