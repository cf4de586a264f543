"""`pdserve bench router --isolation compare`: what keeping tenants' KV apart costs.

The router simulator (router_sim.py) replays one multi-tenant trace three times:
`none` (one cache for all: today's behaviour without keys), `tenant` (a cache salt per
tenant: nothing shared across tenants, not even a system prompt they all send) and
`shared` (a salt per tenant that starts after the system prompt its group shares:
services/edge/tenant_salt.py). The token contents are the same in each; only the salts
differ. Figures: the prompt-token hit rate overall and per tenant, for pdserve's
placement and for the oracle (true cache contents), and the worst window's load.
"""
from __future__ import annotations

from dataclasses import replace

from .router_sim import SimConfig, make_trace, simulate

MODES = ("none", "tenant", "shared")


def compare_isolation(cfg: SimConfig, policies: tuple[str, ...] = ("pdserve", "oracle")
                      ) -> dict:
    """Each isolation mode's figures, per policy, on one trace's tokens."""
    out: dict = {"tenants": cfg.tenants, "groups": min(cfg.tenants, cfg.system_prompts),
                 "system_tokens": cfg.system_tokens, "modes": {}}
    for mode in MODES:
        c = replace(cfg, isolation=mode)
        trace = make_trace(c)
        out["requests"] = len(trace)
        out["modes"][mode] = {}
        for policy in policies:
            figures, _ = simulate(c, trace, policy)
            out["modes"][mode][policy] = {
                k: figures[k] for k in ("hit_rate", "hit_rate_by_tenant", "max_over_mean_load")}
    return out


def table(result: dict) -> str:
    """The comparison as text: a row per mode and policy, a column per tenant."""
    tenants = sorted(next(iter(next(iter(result["modes"].values())).values()))
                     ["hit_rate_by_tenant"])
    lines = [f"{result['requests']} requests, {result['tenants']} tenants in "
             f"{result['groups']} groups (a {result['system_tokens']}-token system prompt "
             "each); prompt-token hit rate",
             f"{'isolation':<10}{'policy':<9}{'overall':>8}{'max/mean':>9}"
             + "".join(f"{'t' + str(t):>7}" for t in tenants)]
    for mode, policies in result["modes"].items():
        for policy, f in policies.items():
            lines.append(f"{mode:<10}{policy:<9}{f['hit_rate']:>8.3f}"
                         f"{f['max_over_mean_load']:>9.2f}"
                         + "".join(f"{f['hit_rate_by_tenant'][t]:>7.3f}" for t in tenants))
    return "\n".join(lines)
