//! The study summary printed on the terminal after a run (the report files are written by
//! [`super::render`]).

use super::StudyData;

/// A compact per-SLO table for the terminal: capacities written as the report writes them
/// (a censored capacity is a bound), imbalance at the capacity step.
pub fn terminal_summary(data: &StudyData) -> String {
    let s = super::analyse(data);
    let mut out = String::new();
    for (i, slo) in data.slos.iter().enumerate() {
        out.push_str(&format!("SLO {}:\n", slo.label()));
        out.push_str(&format!(
            "  {:<34} {:<34} {:>10} {:>12}\n",
            "policy", "capacity (req/s)", "served hit", "imb. at cap."
        ));
        for arm in &s.arms {
            let c = &arm.capacity_qps[i];
            let mut cap = super::capacity_cell(c, &data.ladder_qps);
            let partial = c.left_censored_seeds + c.right_censored_seeds;
            if partial > 0 && partial < c.n {
                cap.push_str(&format!(" ({})", super::censor_cell(c)));
            }
            let imb = arm
                .imbalance_at_capacity
                .get(i)
                .map(|x| x.requests.mean)
                .unwrap_or(f64::NAN);
            out.push_str(&format!(
                "  {:<34} {:<34} {:>9.1}% {:>12.2}\n",
                arm.label,
                cap,
                100.0 * arm.served_kv_hit.mean,
                imb
            ));
        }
    }
    out
}
