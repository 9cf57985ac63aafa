//! An early verdict inside a step: the moment a step is certain to fail every SLO of its study,
//! whatever its remaining requests do, it can be ended (docs/studies.md). Pure: the caller
//! passes the step's request records as they stand at model time `now`.
//!
//! The pass rule (`analysis::capacity`) counts the window's N requests (scheduled inside it):
//! a step fails an SLO when its p99 exceeds the bound, or more than 1% of the N failed. Let
//! A = ⌊0.01 N⌋. With C requests completed, the p99 (rank ⌈0.99 C⌉, reported at or above the
//! exact value) exceeds the bound as soon as more than C − ⌈0.99 C⌉ = ⌊0.01 C⌋ ≤ A of them did.
//! At time `now`, for one SLO:
//! - V: window requests completed with a latency above the bound (by more than a microsecond,
//!   the histograms' resolution: a value rounded onto the bound is not counted);
//! - E: window requests that ended in an error;
//! - F: window requests still running that are already past the bound (e2e: running longer
//!   than it; TTFT: no first token within it, or a late one): each will complete late or fail.
//!
//! The step can still pass only if some split of F into late completions (x) and errors
//! (F − x) keeps V + x ≤ A and E + F − x ≤ A: possible exactly when V ≤ A, E ≤ A and
//! V + E + F ≤ 2A. So the step is **certain to fail** the SLO when V > A, or E > A, or
//! V + E + F > 2A; it is cut when that holds for every SLO. Requests still to arrive only add
//! to N's completions, never to V, E or F, and N is the window's whole count, known before
//! the step runs (an open-loop schedule). The rate rule (achieved ≥ 95% of offered) decides
//! nothing early: every request of the window might still finish inside it.
//!
//! A step is never passed early: until the window closes, any request may still fail.

use super::model::{Cut, Slo, SloMetric};
use super::record::{RequestRecord, Status};
use super::step::Window;

/// Above a bound by more than the histograms' resolution (one microsecond).
const RESOLUTION_S: f64 = 1e-6;

/// Watches one step's records and says when it is certain to fail every SLO.
#[derive(Debug, Clone)]
pub struct EarlyVerdict {
    slos: Vec<Slo>,
    window: Window,
    window_requests: u64,
    /// ⌊0.01 N⌋.
    allowance: u64,
    /// Whether a running request's first token is known when it has come (the simulator);
    /// without it (a live client that learns of it only at the end), a running request counts
    /// towards F for TTFT only once past the bound, which may overcount — so TTFT's F is left
    /// at 0 then.
    first_tokens_known: bool,
    /// Records before this index have been looked at.
    seen: usize,
    /// Window requests seen running, by index.
    running: Vec<usize>,
    /// Per SLO, V.
    late: Vec<u64>,
    errors: u64,
}

impl EarlyVerdict {
    /// A watch over a step whose window holds `window_requests` requests, against `slos`.
    pub fn new(
        slos: &[Slo],
        window: Window,
        window_requests: u64,
        first_tokens_known: bool,
    ) -> Self {
        Self {
            slos: slos.to_vec(),
            window,
            window_requests,
            allowance: (crate::analysis::capacity::MAX_ERROR_RATE * window_requests as f64 + 1e-9)
                .floor() as u64,
            first_tokens_known,
            seen: 0,
            running: Vec::new(),
            late: vec![0; slos.len()],
            errors: 0,
        }
    }

    /// The step's records at model time `now`, in schedule order (records may grow between
    /// calls; a record's outcome is filled in place when it ends; those scheduled after `now`
    /// are ignored). Some(cut) when the step is certain to fail every SLO.
    pub fn check(&mut self, now: f64, records: &[RequestRecord]) -> Option<Cut> {
        while let Some(r) = records.get(self.seen) {
            if r.scheduled_s > now {
                break;
            }
            if self.window.contains(r.scheduled_s) {
                if ended(r) {
                    self.count(r);
                } else {
                    self.running.push(self.seen);
                }
            }
            self.seen += 1;
        }
        let mut still = std::mem::take(&mut self.running);
        still.retain(|&i| {
            let r = &records[i];
            if ended(r) {
                self.count(r);
                false
            } else {
                true
            }
        });
        self.running = still;
        if self.slos.is_empty() {
            return None;
        }
        let a = self.allowance;
        let mut worst_late = 0;
        for (s, slo) in self.slos.iter().enumerate() {
            let past = self
                .running
                .iter()
                .filter(|&&i| self.past_bound(&records[i], slo, now))
                .count() as u64;
            let v = self.late[s];
            let certain = v > a || self.errors > a || v + self.errors + past > 2 * a;
            if !certain {
                return None;
            }
            worst_late = worst_late.max(v + past);
        }
        Some(Cut {
            fails: self.slos.clone(),
            at_s: now,
            violations: worst_late,
            errors: self.errors,
            window_requests: self.window_requests,
        })
    }

    /// Count an ended window request.
    fn count(&mut self, r: &RequestRecord) {
        if r.status.is_ok() {
            for (s, slo) in self.slos.iter().enumerate() {
                let l = match slo.metric {
                    SloMetric::E2e => r.e2e_s(),
                    SloMetric::Ttft => r.ttft_s(),
                };
                // NaN is recorded as 0 by the histograms: not late.
                if l > slo.p99_s + RESOLUTION_S {
                    self.late[s] += 1;
                }
            }
        } else {
            self.errors += 1;
        }
    }

    /// Whether a running request is already past an SLO's bound at `now`.
    fn past_bound(&self, r: &RequestRecord, slo: &Slo, now: f64) -> bool {
        let bound = slo.p99_s + RESOLUTION_S;
        match slo.metric {
            SloMetric::E2e => now - r.scheduled_s > bound,
            SloMetric::Ttft => match r.first_token_s {
                Some(t) => t - r.scheduled_s > bound,
                None => self.first_tokens_known && now - r.scheduled_s > bound,
            },
        }
    }
}

/// Whether a record has its outcome (the simulator marks a running one `Unfinished`).
fn ended(r: &RequestRecord) -> bool {
    r.status != Status::Unfinished
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slo(metric: SloMetric, p99_s: f64) -> Slo {
        Slo { metric, p99_s }
    }

    /// A record scheduled at `t`; `e2e`: Some(latency) when it completed, None while running.
    fn rec(t: f64, e2e: Option<f64>, status: Status) -> RequestRecord {
        RequestRecord {
            id: 0,
            key: 1,
            destination: Some(0),
            scheduled_s: t,
            sent_s: Some(t),
            first_token_s: e2e.map(|e| t + e / 2.0),
            finish_s: e2e.map(|e| t + e),
            prompt_tokens: 10,
            output_tokens: 1,
            cached_tokens: Some(0),
            preemptions: 0,
            retried: false,
            status,
        }
    }

    const W: Window = Window {
        from_s: 10.0,
        to_s: 110.0,
    };

    /// 1000 window requests: A = 10. Eleven late completions decide an e2e SLO; ten do not.
    #[test]
    fn more_late_requests_than_the_rule_absorbs_decide_a_fail() {
        let slos = [slo(SloMetric::E2e, 2.0)];
        for (late, cut) in [(10, false), (11, true)] {
            let mut v = EarlyVerdict::new(&slos, W, 1000, true);
            let mut rs: Vec<RequestRecord> = (0..late)
                .map(|i| rec(10.0 + i as f64, Some(2.5), Status::Ok))
                .collect();
            rs.push(rec(30.0, Some(0.5), Status::Ok));
            assert_eq!(v.check(40.0, &rs).is_some(), cut, "{late} late");
        }
    }

    /// A request before the window (warm-up) never counts, however late.
    #[test]
    fn warm_up_requests_do_not_count() {
        let slos = [slo(SloMetric::E2e, 2.0)];
        let mut v = EarlyVerdict::new(&slos, W, 100, true);
        let rs: Vec<RequestRecord> = (0..5)
            .map(|i| rec(i as f64, Some(9.0), Status::Ok))
            .collect();
        assert!(v.check(50.0, &rs).is_none());
    }

    /// Running requests past the bound count against both allowances together: with A = 1,
    /// V = 1 and E = 1, one running past the bound (V + E + F = 3 > 2) decides a fail, since it
    /// must end late or failed; with none (2 ≤ 2) the step may still pass.
    #[test]
    fn running_requests_past_the_bound_count_with_both_allowances() {
        let slos = [slo(SloMetric::E2e, 2.0)];
        for (running, cut) in [(0, false), (1, true), (2, true)] {
            let mut v = EarlyVerdict::new(&slos, W, 100, true);
            let mut rs = vec![
                rec(11.0, Some(3.0), Status::Ok),
                rec(12.0, None, Status::Failed),
            ];
            for i in 0..running {
                rs.push(rec(13.0 + i as f64, None, Status::Unfinished));
            }
            assert_eq!(v.check(20.0, &rs).is_some(), cut, "{running} running");
        }
        // The same running requests not yet past the bound count for nothing.
        let mut v = EarlyVerdict::new(&slos, W, 100, true);
        let rs = vec![
            rec(11.0, Some(3.0), Status::Ok),
            rec(12.0, None, Status::Failed),
            rec(19.0, None, Status::Unfinished),
        ];
        assert!(v.check(20.0, &rs).is_none());
    }

    /// Every SLO must be certain to fail: a late e2e with a TTFT that still holds is no cut.
    #[test]
    fn a_step_is_cut_only_when_every_slo_fails() {
        let slos = [slo(SloMetric::E2e, 2.0), slo(SloMetric::Ttft, 5.0)];
        let mut v = EarlyVerdict::new(&slos, W, 100, true);
        // e2e 3 s, TTFT 1.5 s: late for e2e only.
        let rs: Vec<RequestRecord> = (0..5)
            .map(|i| rec(10.0 + i as f64, Some(3.0), Status::Ok))
            .collect();
        assert!(v.check(30.0, &rs).is_none());
        // Errors fail both.
        let mut v = EarlyVerdict::new(&slos, W, 100, true);
        let rs: Vec<RequestRecord> = (0..2)
            .map(|i| rec(10.0 + i as f64, None, Status::Failed))
            .collect();
        let c = v
            .check(30.0, &rs)
            .expect("two errors of 100 fail every SLO");
        assert_eq!((c.errors, c.window_requests, c.at_s), (2, 100, 30.0));
    }

    /// Records that end between checks are counted once, when they end; records scheduled
    /// after `now` are not looked at yet.
    #[test]
    fn records_are_counted_once_as_they_end() {
        let slos = [slo(SloMetric::E2e, 1.0)];
        let mut v = EarlyVerdict::new(&slos, W, 200, true);
        let mut rs = vec![
            rec(10.0, None, Status::Unfinished),
            rec(10.5, None, Status::Unfinished),
            rec(60.0, Some(9.0), Status::Ok),
        ];
        // At 10.6 neither running request is past the bound; the third is in the future.
        assert!(v.check(10.6, &rs).is_none());
        // Both end late: V = 2 > A = 2? No (2 ≤ 2): still no cut, and checking again does not
        // count them twice.
        rs[0] = rec(10.0, Some(5.0), Status::Ok);
        rs[1] = rec(10.5, Some(5.0), Status::Ok);
        assert!(v.check(16.0, &rs).is_none());
        assert!(v.check(17.0, &rs).is_none());
        // The third, once looked at, makes V = 3 > 2.
        assert!(v.check(70.0, &rs).is_some());
    }

    /// Without first tokens known (a live client), a running request is no TTFT violation.
    #[test]
    fn unknown_first_tokens_are_not_counted_late() {
        let slos = [slo(SloMetric::Ttft, 1.0)];
        let rs: Vec<RequestRecord> = (0..5)
            .map(|i| rec(10.0 + i as f64, None, Status::Unfinished))
            .collect();
        assert!(EarlyVerdict::new(&slos, W, 100, false)
            .check(60.0, &rs)
            .is_none());
        assert!(EarlyVerdict::new(&slos, W, 100, true)
            .check(60.0, &rs)
            .is_some());
    }

    /// The rule against brute force: for small windows, a cut is made only when no way the
    /// running requests can end keeps the step passing (each running one completing in time,
    /// late, or failing).
    #[test]
    fn a_cut_is_never_made_while_a_pass_is_possible() {
        use crate::analysis::step::step_metrics;
        let slos = [slo(SloMetric::E2e, 2.0)];
        let n = 120u64; // A = 1
        for late in 0..3u64 {
            for errs in 0..3u64 {
                for running in 0..4u64 {
                    let mut rs = Vec::new();
                    let mut t = 10.0;
                    for _ in 0..late {
                        rs.push(rec(t, Some(3.0), Status::Ok));
                        t += 0.1;
                    }
                    for _ in 0..errs {
                        rs.push(rec(t, None, Status::Failed));
                        t += 0.1;
                    }
                    for _ in 0..running {
                        rs.push(rec(t, None, Status::Unfinished));
                        t += 0.1;
                    }
                    let now = t + 2.5; // every running one is past the bound
                    let cut = EarlyVerdict::new(&slos, W, n, true)
                        .check(now, &rs)
                        .is_some();
                    // Can any completion of the running ones (each late or failed: they are
                    // past the bound), plus the rest of the window on time, pass?
                    let mut can_pass = false;
                    for failing in 0..=running {
                        let mut all = rs.clone();
                        for (j, r) in all
                            .iter_mut()
                            .filter(|r| r.status == Status::Unfinished)
                            .enumerate()
                        {
                            *r = if (j as u64) < failing {
                                rec(r.scheduled_s, None, Status::Failed)
                            } else {
                                rec(r.scheduled_s, Some(now - r.scheduled_s + 1.0), Status::Ok)
                            };
                        }
                        let mut s = t;
                        while (all.len() as u64) < n {
                            all.push(rec(s, Some(0.5), Status::Ok));
                            s += 0.7;
                        }
                        let m = step_metrics(all, &Default::default(), 1, W, 1.0);
                        assert_eq!(m.requests, n);
                        can_pass |= passes_but_rate(&m, &slos[0]);
                    }
                    assert_eq!(
                        cut, !can_pass,
                        "late {late} errors {errs} running {running}"
                    );
                }
            }
        }
    }

    /// The latency and error parts of the pass rule (the rate part is decided only at the end).
    fn passes_but_rate(m: &crate::analysis::model::StepMetrics, s: &Slo) -> bool {
        let v = crate::analysis::capacity::verdict(m, s);
        v.latency_ok && v.errors_ok
    }
}
