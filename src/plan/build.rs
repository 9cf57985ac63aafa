//! Building a plan (steps 3–4 of Algorithm 1): placement order, LPT or hash placement over
//! the live destinations, the dispatch index; timed by a clock the caller passes.

use super::*;

/// Admitted keys are placed in decreasing (true) rate order, ties by key hash (LPT).
pub(super) fn placement_order(entries: &mut [PlanEntry]) {
    entries.sort_unstable_by(|a, b| b.rate.total_cmp(&a.rate).then(a.key.cmp(&b.key)));
}

pub(super) fn live_mask(r: usize, down: Option<&[bool]>) -> Vec<bool> {
    (0..r)
        .map(|d| down.and_then(|m| m.get(d).copied()).unwrap_or(false))
        .collect()
}

/// Hash placement for the ablation: k distinct destinations starting at the key's hash
/// position among the live destinations `live` (in index order).
pub(super) fn hash_dests(key: u64, k: usize, live: &[u16], out: &mut Vec<u16>) {
    let start = (crate::rng::mix64(key) % live.len() as u64) as usize;
    for j in 0..k {
        out.push(live[(start + j) % live.len()]);
    }
}

/// [`Plan::starts`] for entries with these destination counts (empty when all are 1), and
/// their sum.
pub(super) fn starts_of(ks: impl Iterator<Item = usize> + Clone) -> (Vec<u32>, usize) {
    if ks.clone().all(|k| k == 1) {
        return (Vec::new(), ks.count());
    }
    let mut total = 0usize;
    let starts = ks
        .map(|k| {
            let s = total as u32;
            total += k;
            s
        })
        .collect();
    (starts, total)
}

/// Build a fresh plan (Algorithm 1). `down` marks destinations to leave out.
pub fn build(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    down: Option<&[bool]>,
) -> Result<Plan, PlanError> {
    build_with(cfg, keys, down, Incumbents::NONE)
}

pub(super) fn build_with(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    down: Option<&[bool]>,
    inc: Incumbents,
) -> Result<Plan, PlanError> {
    cfg.validate()?;
    if keys.len() >= PARALLEL_MIN {
        // The helper thread comes up while the input is validated.
        pair::start();
    }
    let r = cfg.destinations;
    let down = live_mask(r, down);
    let r_live = down.iter().filter(|d| !**d).count();
    if r_live == 0 {
        // A bad rate is reported first, as when there are live destinations.
        scan_keys(keys)?;
        return Err(PlanError::NoDestination);
    }
    let adm = admit(cfg, keys, r_live, inc)?;
    let cold = adm.total_rate - adm.admitted_rate;
    // +0 when nothing is left (never −0: placement compares loads as IEEE numbers).
    let cold = if cold > 0.0 { cold } else { 0.0 };
    let cold_per = cold / r_live as f64;
    let mut loads: Vec<f64> = down
        .iter()
        .map(|&d| if d { 0.0 } else { cold_per })
        .collect();
    let entries = adm.entries;
    // Slots are Σ k_b without byte-aware admission: as many as entries means every k_b = 1.
    let (starts, total_k) = if !cfg.byte_aware && adm.slots_used == entries.len() as u64 {
        (Vec::new(), entries.len())
    } else {
        starts_of(entries.iter().map(|e| e.k as usize))
    };
    let mut dests: Vec<u16> = Vec::with_capacity(total_k);
    let mut place = |entries: &[PlanEntry]| match cfg.placement {
        Placement::Lpt => {
            // Every load stays below this bound (the total rate, cold tail included).
            let bound = adm.total_rate + cold_per;
            lpt::place(entries, &mut dests, &mut loads, &down, bound);
        }
        Placement::Hash => {
            let live: Vec<u16> = (0..r as u16).filter(|&d| !down[d as usize]).collect();
            for e in entries {
                let share = e.rate / e.k as f64;
                let first = dests.len();
                hash_dests(e.key, e.k as usize, &live, &mut dests);
                for &d in &dests[first..] {
                    loads[d as usize] += share;
                }
            }
        }
    };
    // The dispatch index needs only the keys: on a large plan it is built on a second thread
    // while this one places (the plan is the same either way).
    let table = if entries.len() >= PARALLEL_MIN {
        let mut table = None;
        pair::join(
            || table = Some(PlanTable::new_in(&entries, adm.scratch)),
            || place(&entries),
        );
        table.expect("the index was built")
    } else {
        place(&entries);
        PlanTable::new_in(&entries, adm.scratch)
    };
    Ok(Plan {
        destinations: r,
        entries,
        dests,
        starts,
        loads,
        cold_tail_per_dest: cold_per,
        cold_tail_rate: cold,
        total_rate: adm.total_rate,
        slots_used: adm.slots_used,
        slot_budget: cfg.warm_slots.saturating_mul(r_live as u64),
        churn: None,
        down,
        fell_back_to_fresh: false,
        build_ms: 0.0,
        table,
    })
}

/// [`build`], recording construction time with the caller's clock (milliseconds).
pub fn build_timed(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    down: Option<&[bool]>,
    clock_ms: &mut dyn FnMut() -> f64,
) -> Result<Plan, PlanError> {
    let t0 = clock_ms();
    let mut p = build(cfg, keys, down)?;
    p.build_ms = clock_ms() - t0;
    Ok(p)
}
