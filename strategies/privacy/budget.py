"""One spent-versus-budget rule with one tolerance, used by every client and by the server's ledger."""

from __future__ import annotations

#: relative tolerance of every ε-versus-budget comparison (float noise of the accountant only)
EPS_SLACK = 1e-9


def exceeds_budget(epsilon: float, budget: float) -> bool:
    """True when ``epsilon`` is above ``budget`` beyond the numerical tolerance."""
    return epsilon > budget * (1 + EPS_SLACK)


def budget_refusal(server_round: int, eps_next: float, budget: float, detail: str = "") -> str | None:
    """The refusal reason when training round ``server_round`` would spend ``eps_next`` > ``budget``."""
    if not exceeds_budget(eps_next, budget):
        return None
    return (f"budget: training round {server_round} would spend epsilon={eps_next:.4f} > budget {budget:.4f}"
            + (f" ({detail})" if detail else ""))
