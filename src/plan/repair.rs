//! Plan repair when destinations go down: only the keys that held a lost destination move.

use super::*;

/// Plan repair when destinations go down: only keys that held a removed destination move
/// (their lost replicas go to the least-loaded live destinations not already in the set), and
/// the cold tail is spread over the remaining live destinations. Admission is unchanged.
pub fn repair(plan: &Plan, down: &[bool]) -> Result<Plan, PlanError> {
    let r = plan.destinations;
    let down_mask: Vec<bool> = (0..r)
        .map(|d| down.get(d).copied().unwrap_or(false) || plan.down[d])
        .collect();
    let r_live = down_mask.iter().filter(|d| !**d).count();
    if r_live == 0 {
        return Err(PlanError::NoDestination);
    }
    let cold_per = plan.cold_tail_rate / r_live as f64;
    let mut loads: Vec<f64> = down_mask
        .iter()
        .map(|&d| if d { 0.0 } else { cold_per })
        .collect();
    let mut out = plan.clone();
    let mut lost: Vec<usize> = Vec::new();
    for i in 0..out.entries.len() {
        let e = out.entries[i];
        let share = e.rate / e.k as f64;
        let ds = out.dests_of(i);
        if ds.iter().any(|&d| down_mask[d as usize]) {
            lost.push(i);
        }
        for &d in ds {
            if !down_mask[d as usize] {
                loads[d as usize] += share;
            }
        }
    }
    for &i in &lost {
        let e = out.entries[i];
        let share = e.rate / e.k as f64;
        let range = out.start_of(i)..out.start_of(i) + e.k as usize;
        let mut set: Vec<u16> = out.dests[range.clone()]
            .iter()
            .copied()
            .filter(|&d| !down_mask[d as usize])
            .collect();
        let kept = set.len();
        // If fewer live destinations remain than k, the key keeps what it can.
        let want = (e.k as usize).min(r_live);
        while set.len() < want {
            let d = (0..r)
                .filter(|&d| !down_mask[d] && !set.contains(&(d as u16)))
                .min_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)))
                .expect("want ≤ live");
            set.push(d as u16);
        }
        // Charge the new share: rate split over the final set size.
        let new_share = e.rate / set.len() as f64;
        for (j, &d) in set.iter().enumerate() {
            if j < kept {
                loads[d as usize] += new_share - share;
            } else {
                loads[d as usize] += new_share;
            }
        }
        // Keep the flat layout: pad with the first destination when the set shrank.
        for (slot, j) in range.clone().zip(0..) {
            out.dests[slot] = set[j.min(set.len() - 1)];
        }
        out.entries[i].k = set.len() as u16;
    }
    out.loads = loads;
    out.cold_tail_per_dest = cold_per;
    out.down = down_mask;
    out.slot_budget = (plan.slot_budget
        / (plan.down.iter().filter(|d| !**d).count() as u64).max(1))
        * r_live as u64;
    Ok(out)
}
