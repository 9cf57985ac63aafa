//! Churn-aware replanning: keep each key's previous set where the balance allows, and the
//! churn between two plans.

use super::*;

/// Fraction of `new`'s admitted keys whose destination set differs from `old`'s (a key not
/// admitted before counts as changed).
pub fn churn(old: &KeyMap<Vec<u16>>, new: &Plan) -> f64 {
    if new.entries.is_empty() {
        return 0.0;
    }
    let mut changed = 0usize;
    let mut buf: Vec<u16> = Vec::new();
    for i in 0..new.entries.len() {
        buf.clear();
        buf.extend_from_slice(new.dests_of(i));
        buf.sort_unstable();
        match old.get(&new.entries[i].key) {
            Some(prev) if *prev == buf => {}
            _ => changed += 1,
        }
    }
    changed as f64 / new.entries.len() as f64
}

/// Churn-aware replanning. Admission is the budget rule with previously admitted keys ordered
/// as if their rate were × (1 + `admission_hysteresis`) (0 = exactly a fresh plan's); placement keeps each key's
/// previous destinations where it can (adding or dropping replicas when k_b changed, the
/// least-loaded first), places new keys by LPT, and then moves as few keys as possible until
/// max/mean expected load is within `cfg.max_imbalance` × the fresh LPT plan's. If no such
/// plan is found, the fresh plan is returned with `fell_back_to_fresh` set. `churn` is set on
/// the result either way.
///
/// The placement and replication of `cfg` are kept: with [`Placement::Hash`] (the ablation
/// rows) a key's destinations are a function of its hash, k_b and the live destinations, so
/// the fresh hash plan (with the same admission hysteresis) already moves only keys whose k_b,
/// admission or live destinations changed, and it is returned as is: repairing it toward LPT
/// balance would turn the ablation row into the full planner. `max_imbalance` applies to LPT
/// placement only. With `replication` off every key keeps k_b = 1.
pub fn replan(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    previous: &KeyMap<Vec<u16>>,
    down: Option<&[bool]>,
) -> Result<Plan, PlanError> {
    let prev_sets = previous;
    let inc = Incumbents {
        keys: Some(previous),
        hysteresis: cfg.admission_hysteresis,
    };
    if cfg.placement == Placement::Hash {
        let mut p = build_with(cfg, keys, down, inc)?;
        p.churn = Some(churn(prev_sets, &p));
        return Ok(p);
    }
    // The reference: a fresh LPT placement of the same admitted set.
    let mut fresh = build_with(cfg, keys, down, inc)?;
    let bound = fresh.imbalance() * cfg.max_imbalance;
    let r = cfg.destinations;
    let down_mask = fresh.down.clone();
    let r_live = down_mask.iter().filter(|d| !**d).count();

    // Per-entry destination sets, starting from the previous plan.
    let n = fresh.entries.len();
    let mut sets: Vec<Vec<u16>> = Vec::with_capacity(n);
    let mut loads: Vec<f64> = down_mask
        .iter()
        .map(|&d| if d { 0.0 } else { fresh.cold_tail_per_dest })
        .collect();
    let mut pending: Vec<usize> = Vec::new();
    for (i, e) in fresh.entries.iter().enumerate() {
        let share = e.rate / e.k as f64;
        let mut set: Vec<u16> = prev_sets
            .get(&e.key)
            .map(|s| {
                s.iter()
                    .copied()
                    .filter(|&d| (d as usize) < r && !down_mask[d as usize])
                    .collect()
            })
            .unwrap_or_default();
        if set.len() > e.k as usize {
            // Keep the k least-loaded of the previous destinations.
            set.sort_by(|&a, &b| {
                loads[a as usize]
                    .total_cmp(&loads[b as usize])
                    .then(a.cmp(&b))
            });
            set.truncate(e.k as usize);
        }
        if set.len() == e.k as usize {
            for &d in &set {
                loads[d as usize] += share;
            }
        } else {
            pending.push(i);
        }
        sets.push(set);
    }
    // New or grown keys: fill their missing destinations by LPT, in decreasing rate order.
    for &i in &pending {
        let e = fresh.entries[i];
        let share = e.rate / e.k as f64;
        let set = &mut sets[i];
        for &d in set.iter() {
            loads[d as usize] += share;
        }
        while set.len() < e.k as usize {
            let d = (0..r)
                .filter(|&d| !down_mask[d] && !set.contains(&(d as u16)))
                .min_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)))
                .expect("k ≤ live destinations");
            set.push(d as u16);
            loads[d] += share;
        }
    }
    // Repair: move single replicas from the heaviest destination until within the bound.
    let mean = loads.iter().sum::<f64>() / r_live as f64;
    let mut on_dest: Vec<Vec<u32>> = vec![Vec::new(); r];
    for (i, s) in sets.iter().enumerate() {
        for &d in s {
            on_dest[d as usize].push(i as u32);
        }
    }
    let max_moves = n.saturating_mul(2).max(16);
    let mut moves = 0usize;
    let mut ok = true;
    while mean > 0.0 && max_over_mean(&loads, &down_mask) > bound * (1.0 + 1e-12) {
        if moves >= max_moves {
            ok = false;
            break;
        }
        let heavy = (0..r)
            .filter(|&d| !down_mask[d])
            .max_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(b.cmp(&a)))
            .unwrap();
        // The best move: the replica on `heavy` whose share is closest to half the gap to
        // the lightest destination it may move to.
        let mut best: Option<(f64, usize, usize)> = None; // (score, entry, to)
        for &ei in &on_dest[heavy] {
            let e = fresh.entries[ei as usize];
            let share = e.rate / e.k as f64;
            let set = &sets[ei as usize];
            let to = (0..r)
                .filter(|&d| !down_mask[d] && !set.contains(&(d as u16)))
                .min_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)));
            let Some(to) = to else { continue };
            let gap = loads[heavy] - loads[to];
            if share >= gap {
                continue; // would not lower the pair's maximum
            }
            let score = (share - gap / 2.0).abs();
            if best.is_none_or(|b| score < b.0) {
                best = Some((score, ei as usize, to));
            }
        }
        if let Some((_, ei, to)) = best {
            let e = fresh.entries[ei];
            let share = e.rate / e.k as f64;
            let set = &mut sets[ei];
            let pos = set.iter().position(|&d| d as usize == heavy).unwrap();
            set[pos] = to as u16;
            loads[heavy] -= share;
            loads[to] += share;
            on_dest[heavy].retain(|&x| x as usize != ei);
            on_dest[to].push(ei as u32);
            moves += 1;
            continue;
        }
        // No single move lowers the maximum: try exchanging a replica on the heaviest
        // destination with a smaller one on one of the lightest (two keys move).
        let mut lights: Vec<usize> = (0..r).filter(|&d| !down_mask[d] && d != heavy).collect();
        lights.sort_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)));
        lights.truncate(3);
        let mut swap: Option<(f64, usize, usize, usize)> = None; // (score, a on heavy, b on light, light)
        for &l in &lights {
            let gap = loads[heavy] - loads[l];
            for &ea in &on_dest[heavy] {
                let a = fresh.entries[ea as usize];
                if sets[ea as usize].contains(&(l as u16)) {
                    continue;
                }
                let sa = a.rate / a.k as f64;
                for &eb in &on_dest[l] {
                    let b = fresh.entries[eb as usize];
                    if sets[eb as usize].contains(&(heavy as u16)) {
                        continue;
                    }
                    let delta = sa - b.rate / b.k as f64;
                    if delta <= 0.0 || delta >= gap {
                        continue;
                    }
                    let score = (delta - gap / 2.0).abs();
                    if swap.is_none_or(|s| score < s.0) {
                        swap = Some((score, ea as usize, eb as usize, l));
                    }
                }
            }
        }
        let Some((_, ea, eb, l)) = swap else {
            ok = false;
            break;
        };
        let (a, b) = (fresh.entries[ea], fresh.entries[eb]);
        let (sa, sb) = (a.rate / a.k as f64, b.rate / b.k as f64);
        let pa = sets[ea].iter().position(|&d| d as usize == heavy).unwrap();
        sets[ea][pa] = l as u16;
        let pb = sets[eb].iter().position(|&d| d as usize == l).unwrap();
        sets[eb][pb] = heavy as u16;
        loads[heavy] += sb - sa;
        loads[l] += sa - sb;
        on_dest[heavy].retain(|&x| x as usize != ea);
        on_dest[heavy].push(eb as u32);
        on_dest[l].retain(|&x| x as usize != eb);
        on_dest[l].push(ea as u32);
        moves += 2;
    }
    if !ok {
        fresh.churn = Some(churn(prev_sets, &fresh));
        fresh.fell_back_to_fresh = true;
        return Ok(fresh);
    }
    let mut dests = Vec::with_capacity(fresh.dests.len());
    for set in &sets {
        dests.extend_from_slice(set);
    }
    fresh.starts = starts_of(sets.iter().map(|s| s.len())).0;
    fresh.dests = dests;
    fresh.loads = loads;
    fresh.churn = Some(churn(prev_sets, &fresh));
    Ok(fresh.index())
}
