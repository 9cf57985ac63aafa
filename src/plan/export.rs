//! A plan as the files a user and the router exchange: per-key loads from a rates table, and
//! the `cacheroute plan --out` JSON (key names restored, the table the router installs).
//! Used by the CLI and by the study runner's local backend alike. Pure: values in, JSON out.

use super::{KeyLoad, Placement, Plan, PlannerConfig};
use crate::workload::rates::KeyRate;
use serde_json::{json, Value};

/// Planner input from named rates.
pub fn key_loads(rates: &[KeyRate]) -> Vec<KeyLoad> {
    rates
        .iter()
        .map(|r| KeyLoad {
            key: crate::key_hash(&r.key),
            rate: r.rate,
            prefix_tokens: r.prefix_tokens.unwrap_or(0.0),
        })
        .collect()
}

/// The plan as JSON, with key names restored.
pub fn plan_json(plan: &Plan, rates: &[KeyRate], cfg: &PlannerConfig) -> Value {
    let mut table = serde_json::Map::with_capacity(plan.admitted());
    for i in 0..plan.admitted() {
        let e = plan.entries[i];
        let name = &rates[e.input_index as usize].key;
        table.insert(name.clone(), json!(plan.dests_of(i)));
    }
    let mut v = json!({
        "destinations": plan.destinations,
        "q_cap": cfg.q_cap,
        "warm_slots": cfg.warm_slots,
        "variant": match (cfg.replication, cfg.placement) { (false, _) => "affinity", (true, Placement::Hash) => "replication", _ => "full" },
        "byte_aware": cfg.byte_aware,
        "table": table,
        "loads": plan.loads,
        "down": plan.down,
        "admitted": plan.admitted(),
        "keys": rates.len(),
        "admitted_share": plan.admitted_share(),
        "slots_used": plan.slots_used,
        "slot_budget": plan.slot_budget,
        "cold_tail_per_dest": plan.cold_tail_per_dest,
        "imbalance": plan.imbalance(),
        "build_ms": plan.build_ms,
    });
    if let Some(c) = plan.churn {
        v["churn"] = json!(c);
        v["fell_back_to_fresh"] = json!(plan.fell_back_to_fresh);
    }
    v
}
