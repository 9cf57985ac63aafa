//! The engine and GPU telemetry note of a live study: per arm, the served hit from the engines'
//! own prefix-cache counters, mean GPU utilisation, energy per request, and the injected
//! failures, lost replicas and live sessions the runner recorded. The study layer sums the
//! stored samples into [`ArmTelemetry`]; this file only writes them.

use std::collections::BTreeMap;

/// What the engines and GPUs reported for one arm, summed over its runs and steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArmTelemetry {
    /// Engine prefix-cache counters: cached tokens and prompt tokens.
    pub hits: f64,
    pub queries: f64,
    /// GPU utilisation samples: (sum of percentages, count).
    pub util: (f64, u64),
    /// GPU energy over the steps with an energy counter (J), and their requests.
    pub energy: f64,
    pub requests: u64,
    /// Injected failures: (replica, step, model time).
    pub kills: Vec<(String, usize, f64)>,
    /// Replicas of an SSH fleet lost: (replica, step, whether already at the step's start).
    pub lost: Vec<(String, usize, bool)>,
    /// Live sessions, summed over steps: turns sent, late, sessions and turns abandoned;
    /// and the later turns' hit per step.
    pub sessions: Option<[f64; 4]>,
    pub later_hit: Vec<f64>,
    /// What the router received of the engines' KV-cache events, summed over steps (`None`
    /// where it did not subscribe).
    pub kv_events: Option<KvEventCounts>,
    /// Per destination: the router's predicted hit beside the engine's own counters.
    pub per_dest: BTreeMap<usize, DestHit>,
}

/// The router's KV-event counters (`/metrics`), summed over destinations and steps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvEventCounts {
    pub batches: f64,
    pub gaps: f64,
    pub replayed: f64,
    pub resyncs: f64,
    pub undecodable: f64,
    pub mapped_blocks: f64,
    pub unmapped_blocks: f64,
}

/// One destination's prompt tokens as the router predicted them and as its engine served them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DestHit {
    /// Prompt tokens the router routed there, and those its exact index held there then.
    pub routed: f64,
    pub predicted: f64,
    /// The engine's prefix-cache counters: cached tokens and prompt tokens.
    pub hits: f64,
    pub queries: f64,
}

/// How far predicted and served hit may part, in percentage points, before the report flags
/// a destination: the prediction is made at the decision and the engine looks up at
/// admission, so blocks stored by a request still in flight (served, not predicted) or evicted
/// in between (predicted, not served) make them differ a little under load, and with only
/// tens of requests a destination one late event moves it by several points; over hundreds,
/// more means the index does not match the engines' caches (a wrong mapping, lost events).
pub const PREDICTION_TOLERANCE_PT: f64 = 5.0;

impl DestHit {
    /// Predicted and served hit (fractions), where there were tokens.
    pub fn rates(&self) -> (Option<f64>, Option<f64>) {
        let r = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        (r(self.predicted, self.routed), r(self.hits, self.queries))
    }

    /// Whether predicted and served hit agree within [`PREDICTION_TOLERANCE_PT`].
    pub fn agrees(&self) -> Option<bool> {
        match self.rates() {
            (Some(p), Some(s)) => Some((p - s).abs() * 100.0 <= PREDICTION_TOLERANCE_PT),
            _ => None,
        }
    }
}

/// A markdown table of what the engines and GPUs reported, per arm (live backends only): served
/// hit from the engines' own prefix-cache counters, mean GPU utilisation, and energy per request
/// from the GPUs' cumulative energy counters; then the sessions, failures and lost replicas.
pub fn telemetry_note(by_arm: &BTreeMap<String, ArmTelemetry>) -> String {
    let mut t = String::from("Engine and GPU telemetry (live backends): served hit from the engines' own prefix-cache counters (vLLM `prefix_cache_*`, SGLang `cached_tokens`/`prompt_tokens`) over whole steps; GPU utilisation and energy from `cacheroute agent` where it ran.\n\n| policy | engine-counter served hit | mean GPU utilisation | energy per request |\n| --- | --- | --- | --- |\n");
    for (arm, a) in by_arm {
        let hit = if a.queries > 0.0 {
            format!("{:.1}%", 100.0 * a.hits / a.queries)
        } else {
            "—".into()
        };
        let util = if a.util.1 > 0 {
            format!("{:.0}%", a.util.0 / a.util.1 as f64)
        } else {
            "—".into()
        };
        let energy = if a.requests > 0 && a.energy > 0.0 {
            format!("{:.1} J", a.energy / a.requests as f64)
        } else {
            "—".into()
        };
        t.push_str(&format!("| {arm} | {hit} | {util} | {energy} |\n"));
    }
    let kills: Vec<String> = by_arm
        .iter()
        .flat_map(|(arm, a)| {
            a.kills.iter().map(move |(replica, step, at)| {
                format!("{arm}: replica {replica} killed at {at:.0} s of step {step}")
            })
        })
        .collect();
    let sessions: Vec<String> = by_arm
        .iter()
        .filter_map(|(arm, a)| {
            let [sent, late, sessions, turns] = a.sessions?;
            let hit = if a.later_hit.is_empty() {
                String::new()
            } else {
                format!(
                    "; later turns' hit {:.1}% (answers' `cached_tokens`)",
                    100.0 * a.later_hit.iter().sum::<f64>() / a.later_hit.len() as f64
                )
            };
            Some(format!(
                "{arm}: {sent:.0} turns sent, {late:.0} late, {sessions:.0} sessions abandoned ({turns:.0} turns){hit}"
            ))
        })
        .collect();
    if !sessions.is_empty() {
        t.push_str(&format!(
            "\nLive sessions (each turn after the previous answer, carrying it; docs/replayer.md), over whole steps: {}.\n",
            sessions.join("; ")
        ));
    }
    if !kills.is_empty() {
        t.push_str(&format!(
            "\nInjected failures (the router failed over; requests in flight on the replica are counted as errors): {}.\n",
            kills.join("; ")
        ));
    }
    kv_notes(&mut t, by_arm);
    let lost: Vec<String> = by_arm
        .iter()
        .flat_map(|(arm, a)| {
            a.lost.iter().map(move |(replica, step, at_start)| {
                if *at_start {
                    format!("{arm}: replica {replica} unreachable for all of step {step}")
                } else {
                    format!("{arm}: replica {replica} lost during step {step}")
                }
            })
        })
        .collect();
    if !lost.is_empty() {
        t.push_str(&format!(
            "\nLost replicas (stopped answering; the router excluded them, requests in flight on them are counted as errors): {}.\n",
            lost.join("; ")
        ));
    }
    t
}

/// The router's KV-event counters per arm (so a reader sees whether events were lost), then
/// predicted against served hit per destination.
fn kv_notes(t: &mut String, by_arm: &BTreeMap<String, ArmTelemetry>) {
    let with = || {
        by_arm
            .iter()
            .filter_map(|(arm, a)| a.kv_events.map(|k| (arm, k)))
    };
    if with().next().is_none() {
        return;
    }
    t.push_str("\nThe engines' KV-cache events as the router received them (its `/metrics`, summed over destinations and steps; gaps a replay filled are counted in both gaps and replayed, a resync is a destination's view dropped and rebuilt):\n\n| policy | batches | gaps | replayed | resyncs | undecodable | blocks mapped | blocks unmapped |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (arm, k) in with() {
        t.push_str(&format!(
            "| {arm} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
            k.batches,
            k.gaps,
            k.replayed,
            k.resyncs,
            k.undecodable,
            k.mapped_blocks,
            k.unmapped_blocks
        ));
    }
    t.push_str(&format!("\nPredicted against served hit per destination: predicted, the prompt tokens the router's exact index (the engines' events) held at the destination when it chose it, over the prompt tokens it sent there; served, the engine's own prefix-cache counters. With hundreds of requests a destination they should agree within {PREDICTION_TOLERANCE_PT} points (the index is read at the decision, the cache at admission; with tens, one late event moves a row by several); a row marked ✗ does not.\n\n| policy | destination | predicted hit | served hit (engine counters) | agree |\n| --- | --- | --- | --- | --- |\n"));
    let pct = |x: Option<f64>| x.map_or("—".to_string(), |x| format!("{:.1}%", 100.0 * x));
    for (arm, a) in by_arm.iter().filter(|(_, a)| a.kv_events.is_some()) {
        for (d, h) in &a.per_dest {
            let (p, s) = h.rates();
            let ok = match h.agrees() {
                Some(true) => "✓",
                Some(false) => "✗",
                None => "—",
            };
            t.push_str(&format!(
                "| {arm} | {d} | {} | {} | {ok} |\n",
                pct(p),
                pct(s)
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The note as the study layer's sums give it: a row per arm ("—" where nothing was
    /// counted), then the sessions, injected failures and lost replicas in words.
    #[test]
    fn the_note_has_a_row_per_arm_and_says_what_failed() {
        let mut by_arm = BTreeMap::new();
        by_arm.insert(
            "cacheroute".to_string(),
            ArmTelemetry {
                hits: 750.0,
                queries: 1000.0,
                util: (170.0, 2),
                energy: 500.0,
                requests: 100,
                kills: vec![("1".into(), 2, 30.0)],
                lost: vec![("3".into(), 4, true), ("5".into(), 6, false)],
                sessions: Some([40.0, 2.0, 1.0, 3.0]),
                later_hit: vec![0.5, 0.7],
                ..Default::default()
            },
        );
        by_arm.insert("flat-lb".to_string(), ArmTelemetry::default());
        let note = telemetry_note(&by_arm);
        let lines: Vec<&str> = note.lines().collect();
        assert_eq!(lines[4], "| cacheroute | 75.0% | 85% | 5.0 J |", "{note}");
        assert_eq!(lines[5], "| flat-lb | — | — | — |", "{note}");
        assert!(note.contains(
            ": cacheroute: 40 turns sent, 2 late, 1 sessions abandoned (3 turns); later turns' hit 60.0% (answers' `cached_tokens`).\n"
        ), "{note}");
        assert!(
            note.contains(": cacheroute: replica 1 killed at 30 s of step 2.\n"),
            "{note}"
        );
        assert!(note.contains(
            ": cacheroute: replica 3 unreachable for all of step 4; cacheroute: replica 5 lost during step 6.\n"
        ), "{note}");
        assert!(!note.contains("flat-lb:"), "{note}");
    }

    /// The KV-event counters and predicted against served per destination appear for the
    /// arms whose router subscribed; a destination whose prediction parts from its engine's
    /// counters by more than the tolerance is marked ✗.
    #[test]
    fn the_kv_tables_mark_a_destination_whose_prediction_parts_from_its_engine() {
        let mut by_arm = BTreeMap::new();
        let mut a = ArmTelemetry {
            kv_events: Some(KvEventCounts {
                batches: 40.0,
                mapped_blocks: 100.0,
                ..Default::default()
            }),
            ..Default::default()
        };
        let dest = |predicted: f64, hits: f64| DestHit {
            routed: 1000.0,
            predicted,
            hits,
            queries: 1000.0,
        };
        a.per_dest.insert(0, dest(800.0, 820.0));
        a.per_dest.insert(1, dest(0.0, 700.0));
        by_arm.insert("dynamo".to_string(), a);
        let mut peer = ArmTelemetry::default();
        peer.per_dest.insert(0, dest(0.0, 500.0));
        by_arm.insert("smg".to_string(), peer);
        let note = telemetry_note(&by_arm);
        assert!(
            note.contains("| dynamo | 40 | 0 | 0 | 0 | 0 | 100 | 0 |"),
            "{note}"
        );
        assert!(
            note.contains("| dynamo | 0 | 80.0% | 82.0% | ✓ |"),
            "{note}"
        );
        assert!(note.contains("| dynamo | 1 | 0.0% | 70.0% | ✗ |"), "{note}");
        assert!(!note.contains("| smg | 0 |"), "{note}");
        assert_eq!(dest(800.0, 851.0).agrees(), Some(false));
        assert_eq!(DestHit::default().agrees(), None);
    }
}
