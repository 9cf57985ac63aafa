//! Sessions with live answers: the turns of one trace `session` are sent one after another,
//! turn n+1 only after turn n's answer arrived (plus a think time), with a prompt made of turn
//! n's prompt, turn n's *actual* answer text and the new user message — so an engine's prefix
//! cache can reuse the tokens it generated, as in real multi-turn chat. Sessions start open
//! loop: each session's first turn leaves at its scheduled time whatever the others do.
//!
//! This module holds the pure parts (grouping a schedule into sessions, think times, the
//! conversation history and the new message's text); the send loop in `mod.rs` drives them.

use std::collections::HashMap;
use std::str::FromStr;

use crate::workload::text::prompt_text;
use crate::workload::trace::TraceRecord;

/// How the turns of a trace session are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sessions {
    /// Every request at its own scheduled time, its prompt synthesised from the trace's
    /// `hash_ids` (a next turn carries synthetic text where the previous answer was).
    #[default]
    Trace,
    /// Turns in order, each after the previous answer, carrying that answer's text.
    Live,
}

impl Sessions {
    pub fn label(&self) -> &'static str {
        match self {
            Sessions::Trace => "trace",
            Sessions::Live => "live",
        }
    }
}

impl FromStr for Sessions {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "trace" => Ok(Sessions::Trace),
            "live" => Ok(Sessions::Live),
            other => Err(format!(
                "{other:?} is not a sessions mode; use trace or live"
            )),
        }
    }
}

/// The pause between an answer and the session's next turn.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ThinkTime {
    /// Keep the trace's gap between the two turns' timestamps, counted from when the previous
    /// turn was due; when the answer arrives after that, the turn leaves at the answer (and is
    /// counted late).
    #[default]
    Trace,
    /// This many seconds after the answer.
    Fixed(f64),
    /// Exponentially distributed with this mean (seconds) after the answer, drawn per turn
    /// from the request id (deterministic for a schedule).
    Exp(f64),
}

impl ThinkTime {
    /// The same think time with every duration passed through `f` (the model's seconds as
    /// wall seconds, by a compressed schedule's time scale).
    pub fn map_secs(self, f: impl Fn(f64) -> f64) -> ThinkTime {
        match self {
            ThinkTime::Trace => ThinkTime::Trace,
            ThinkTime::Fixed(s) => ThinkTime::Fixed(f(s)),
            ThinkTime::Exp(m) => ThinkTime::Exp(f(m)),
        }
    }

    /// The think time of request `id` (`None`: the trace's gap rules).
    fn draw(&self, id: u64) -> Option<f64> {
        match *self {
            ThinkTime::Trace => None,
            ThinkTime::Fixed(s) => Some(s),
            ThinkTime::Exp(m) => {
                // A uniform in (0, 1] from the id; −m·ln(u).
                let u = ((crate::rng::mix64(id ^ 0x7417_c0de_5e55_1011) >> 11) as f64 + 1.0)
                    / (1u64 << 53) as f64;
                Some(-m * u.ln())
            }
        }
    }

    pub fn label(&self) -> String {
        match self {
            ThinkTime::Trace => "trace".into(),
            ThinkTime::Fixed(s) => format!("{s}"),
            ThinkTime::Exp(m) => format!("exp:{m}"),
        }
    }
}

impl FromStr for ThinkTime {
    type Err = String;
    /// `trace`, `SECONDS` or `exp:MEAN_SECONDS`.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "trace" {
            return Ok(ThinkTime::Trace);
        }
        let (exp, num) = match s.strip_prefix("exp:") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let v: f64 = num.trim().parse().map_err(|_| {
            format!("{s:?} is not a think time; use trace, SECONDS (e.g. 2.5) or exp:MEAN (e.g. exp:2.5)")
        })?;
        if !(v.is_finite() && v >= 0.0) || (exp && v == 0.0) {
            return Err(format!(
                "{s:?}: a think time must be a finite number of seconds ≥ 0 (an exp: mean > 0)"
            ));
        }
        Ok(if exp {
            ThinkTime::Exp(v)
        } else {
            ThinkTime::Fixed(v)
        })
    }
}

impl<'de> serde::Deserialize<'de> for ThinkTime {
    /// A number of seconds, or the strings `trace`, `SECONDS`, `exp:MEAN`.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(f64),
            S(String),
        }
        let s = match Raw::deserialize(d)? {
            Raw::N(n) => n.to_string(),
            Raw::S(s) => s,
        };
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for ThinkTime {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ThinkTime::Fixed(v) => s.serialize_f64(*v),
            other => s.serialize_str(&other.label()),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Sessions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Sessions {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.label())
    }
}

/// One request of a schedule with its position (its record id).
#[derive(Debug, Clone)]
pub(crate) struct Turn {
    pub id: u64,
    pub t: f64,
    pub rec: TraceRecord,
}

/// What the dispatcher sends at a scheduled time: one request, or a session whose first turn
/// is due then.
#[derive(Debug)]
pub(crate) enum Unit {
    One(Turn),
    Session(String, Vec<Turn>),
}

impl Unit {
    pub fn ids(&self) -> u64 {
        match self {
            Unit::One(_) => 1,
            Unit::Session(_, v) => v.len() as u64,
        }
    }
}

/// Every request on its own (ids in schedule order): the trace mode.
pub(crate) fn singles(
    schedule: impl Iterator<Item = (f64, TraceRecord)>,
) -> impl Iterator<Item = (f64, Unit)> {
    schedule.enumerate().map(|(i, (t, rec))| {
        (
            t,
            Unit::One(Turn {
                id: i as u64,
                t,
                rec,
            }),
        )
    })
}

/// The live mode's units: requests without a `session` on their own; the requests of a
/// session gathered at its first request's time, in `turn` order (schedule order among equal
/// or missing turns). Ids stay schedule positions. Reads the whole schedule.
pub(crate) fn group(schedule: impl Iterator<Item = (f64, TraceRecord)>) -> Vec<(f64, Unit)> {
    let mut units: Vec<(f64, Unit)> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for (i, (t, rec)) in schedule.enumerate() {
        let turn = Turn {
            id: i as u64,
            t,
            rec,
        };
        match turn.rec.session.clone() {
            None => units.push((t, Unit::One(turn))),
            Some(s) => match at.get(&s) {
                Some(&u) => {
                    if let Unit::Session(_, v) = &mut units[u].1 {
                        v.push(turn);
                    }
                }
                None => {
                    at.insert(s.clone(), units.len());
                    units.push((t, Unit::Session(s, vec![turn])));
                }
            },
        }
    }
    for (_, u) in &mut units {
        if let Unit::Session(_, v) = u {
            v.sort_by_key(|x| x.rec.turn.unwrap_or(0));
        }
    }
    units
}

/// When turn n+1 of a session is due and by how much a slow answer made it late.
///
/// `prev_due` and `prev_trace` are turn n's due time and trace time, `answer` when its answer
/// arrived, `trace` turn n+1's trace time. With [`ThinkTime::Trace`] the trace's gap is kept
/// from `prev_due`, unless the answer comes after that: then the turn leaves at the answer and
/// is late by the difference. Otherwise it leaves the drawn think time after the answer (never
/// late: the trace's gaps are not used).
pub(crate) fn next_due(
    think: ThinkTime,
    id: u64,
    prev_due: f64,
    prev_trace: f64,
    answer: f64,
    trace: f64,
) -> (f64, Option<f64>) {
    match think.draw(id) {
        Some(th) => (answer + th, None),
        None => {
            let planned = prev_due + (trace - prev_trace).max(0.0);
            if answer > planned {
                (answer, Some(answer - planned))
            } else {
                (planned, None)
            }
        }
    }
}

/// A conversation's texts (user and assistant alternating) as one completions prompt: the
/// parts concatenated, a space between two unless one side already has whitespace there (an
/// answer is kept byte for byte).
pub(crate) fn joined(parts: &[String]) -> String {
    let mut s = String::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for p in parts {
        if !s.is_empty() && !s.ends_with(char::is_whitespace) && !p.starts_with(char::is_whitespace)
        {
            s.push(' ');
        }
        s.push_str(p);
    }
    s
}

/// The new user message of a later turn: the words of the trace's prompt for this turn past
/// what the previous turn's prompt and answer covered (`context` tokens by the trace's
/// lengths), at least one word.
pub(crate) fn new_message(
    rec: &TraceRecord,
    context: u32,
    block_tokens: u32,
    unique: u64,
) -> String {
    let full = prompt_text(&rec.hash_ids, rec.input_length, block_tokens, unique);
    let n = rec.input_length.saturating_sub(context).max(1) as usize;
    let words: Vec<&str> = full.split_ascii_whitespace().collect();
    let from = words.len().saturating_sub(n);
    let msg = words[from..].join(" ");
    if msg.is_empty() {
        // A zero-length prompt in the trace: still send one word.
        "w000".into()
    } else {
        msg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: f64, session: Option<&str>, turn: Option<u32>, input: u32) -> TraceRecord {
        TraceRecord {
            timestamp_ms: ts,
            key: "k".into(),
            input_length: input,
            output_length: 4,
            hash_ids: vec![1, 2, 3, 4],
            session: session.map(str::to_owned),
            turn,
        }
    }

    #[test]
    fn think_times_parse_and_reject_with_the_value() {
        assert_eq!("trace".parse::<ThinkTime>().unwrap(), ThinkTime::Trace);
        assert_eq!("2.5".parse::<ThinkTime>().unwrap(), ThinkTime::Fixed(2.5));
        assert_eq!("exp:1".parse::<ThinkTime>().unwrap(), ThinkTime::Exp(1.0));
        for bad in ["-1", "exp:0", "x", "exp:", "inf"] {
            let e = bad.parse::<ThinkTime>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        assert!("sometimes"
            .parse::<Sessions>()
            .unwrap_err()
            .contains("trace or live"));
        let v: ThinkTime = yaml_serde::from_str("3").unwrap();
        assert_eq!(v, ThinkTime::Fixed(3.0));
        let v: ThinkTime = yaml_serde::from_str("exp:2").unwrap();
        assert_eq!(v, ThinkTime::Exp(2.0));
        // Exponential draws: mean near the parameter, deterministic per id.
        let e = ThinkTime::Exp(2.0);
        let mean = (0..20_000).map(|i| e.draw(i).unwrap()).sum::<f64>() / 20_000.0;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
        assert_eq!(e.draw(7), e.draw(7));
    }

    #[test]
    fn groups_sessions_in_turn_order_at_their_first_time() {
        let s = vec![
            (0.0, rec(0.0, Some("a"), Some(1), 8)),
            (0.5, rec(500.0, None, None, 8)),
            (1.0, rec(1000.0, Some("b"), Some(2), 8)),
            (1.5, rec(1500.0, Some("a"), Some(2), 8)),
            (2.0, rec(2000.0, Some("b"), Some(1), 8)),
        ];
        let u = group(s.into_iter());
        assert_eq!(u.len(), 3);
        assert_eq!(u.iter().map(|(_, u)| u.ids()).sum::<u64>(), 5);
        match &u[0].1 {
            Unit::Session(s, v) => {
                assert_eq!(s, "a");
                assert_eq!(v.iter().map(|t| t.id).collect::<Vec<_>>(), [0, 3]);
            }
            _ => panic!(),
        }
        assert!(matches!(&u[1].1, Unit::One(t) if t.id == 1));
        // Session b: turn 1 (id 4) before turn 2 (id 2), at b's first time.
        assert_eq!(u[2].0, 1.0);
        match &u[2].1 {
            Unit::Session(_, v) => assert_eq!(v.iter().map(|t| t.id).collect::<Vec<_>>(), [4, 2]),
            _ => panic!(),
        }
    }

    #[test]
    fn next_turn_keeps_the_trace_gap_unless_the_answer_is_slow() {
        // Turn n due at 1.0 (trace 0.5), next turn's trace time 2.5: gap 2 → due 3.0.
        assert_eq!(
            next_due(ThinkTime::Trace, 0, 1.0, 0.5, 2.0, 2.5),
            (3.0, None)
        );
        // The answer at 3.5: the turn leaves at the answer, 0.5 s late.
        assert_eq!(
            next_due(ThinkTime::Trace, 0, 1.0, 0.5, 3.5, 2.5),
            (3.5, Some(0.5))
        );
        // A think time: after the answer, whatever the trace says.
        assert_eq!(
            next_due(ThinkTime::Fixed(0.25), 0, 1.0, 0.5, 3.5, 2.5),
            (3.75, None)
        );
    }

    #[test]
    fn history_and_new_message() {
        let p = |v: &[&str]| joined(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(p(&["a b", " g1 g2", "c"]), "a b g1 g2 c");
        assert_eq!(p(&["a b", "g1"]), "a b g1");
        // The trace's turn: 20 tokens, of which 12 were the previous prompt + answer.
        let r = rec(0.0, Some("a"), Some(2), 20);
        let m = new_message(&r, 12, 4, 9);
        assert_eq!(crate::workload::text::count_tokens(&m), 8);
        let full = prompt_text(&r.hash_ids, 20, 4, 9);
        assert!(full.ends_with(&m));
        // A trace whose turns do not grow: one word.
        assert_eq!(
            crate::workload::text::count_tokens(&new_message(&r, 40, 4, 9)),
            1
        );
    }
}
