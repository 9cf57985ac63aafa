//! Allowed ranges of the numbers a user gives (study specs, the workload generator's settings,
//! policy parameters, command-line flags), and the one check that names the field and the
//! range. A value outside its range is refused before anything is allocated for it: a ladder
//! step of 1e300 req/s or four billion replicas must be a one-line error, not an exhausted
//! machine. Pure: no I/O; depends on nothing else in the crate (serde only, to read a whole
//! number whatever the JSON holds: [`JsonWhole`]).

/// Highest offered load of a ladder step or a generated trace, requests/s.
pub const MAX_QPS: f64 = 100_000.0;
/// Longest warm-up, measured window or generated trace, seconds (one week).
pub const MAX_SECONDS: f64 = 604_800.0;
/// Most requests one ladder step (or one generated run) may hold: rate × duration.
pub const MAX_REQUESTS: f64 = 10_000_000.0;
/// Most engine replicas (destinations) of a fleet.
pub const MAX_REPLICAS: u64 = 10_000;
/// Largest tensor-parallel degree.
pub const MAX_TP: u64 = 64;
/// Most seeds of a study.
pub const MAX_SEEDS: u64 = 1_000;
/// Most ladder steps of a study.
pub const MAX_LADDER_STEPS: u64 = 1_000;
/// Most runs of a study (sweep points × policies × seeds).
pub const MAX_RUNS: u64 = 100_000;
/// Most keys of a generated workload.
pub const MAX_KEYS: u64 = 10_000_000;
/// Most live conversations of a generated workload (keys × conversations per key).
pub const MAX_CONVERSATIONS: u64 = 50_000_000;
/// Longest prompt, prefix or answer, tokens.
pub const MAX_TOKENS: u64 = 1 << 20;
/// Highest rate of one key, requests/s: a rates file's row, a router state file's key. The
/// same ceiling as a whole offered load ([`MAX_QPS`]): no one key is offered more than a
/// whole fleet may be. Checked by [`rate`], the one definition of a valid rate.
pub const MAX_RATE: f64 = MAX_QPS;
/// Key names the live router keeps for `/admin/plan?table=true` (the first seen win).
pub const MAX_KEY_NAMES: usize = 65_536;
/// Most keys of a plan file (`route --plan-file`/`--initial-plan`, `plan --previous`): 16 ×
/// [`MAX_KEY_NAMES`], eight times the 128,824 keys of the paper's workload. A plan lists its
/// admitted keys (at most destinations × warm slots); a router's state file lists every key
/// it measured, and keeps the [`MAX_PLAN_KEYS`] hottest.
pub const MAX_PLAN_KEYS: usize = 16 * MAX_KEY_NAMES;
/// Largest plan file, bytes (256 MiB: a state file of [`MAX_PLAN_KEYS`] keys with 100-byte
/// names is about 200 MB).
pub const MAX_PLAN_BYTES: u64 = 256 << 20;
/// Longest control interval, SLO or policy window, seconds (one day).
pub const MAX_INTERVAL_S: f64 = 86_400.0;

/// A number as a person reads it: `1e300`, not three hundred digits.
pub fn show(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e9).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// `field: value is outside the allowed range …` when `v` is not finite or not in
/// `lo..=hi` (`lo` excluded when `lo_open`).
pub fn real(field: &str, v: f64, lo: f64, lo_open: bool, hi: f64) -> Option<String> {
    let inside = v.is_finite() && (if lo_open { v > lo } else { v >= lo }) && v <= hi;
    (!inside).then(|| {
        format!(
            "{field}: {} is outside the allowed range {} {} value ≤ {}",
            show(v),
            show(lo),
            if lo_open { "<" } else { "≤" },
            show(hi)
        )
    })
}

/// [`real`] for `lo < v ≤ hi`.
pub fn positive(field: &str, v: f64, hi: f64) -> Option<String> {
    real(field, v, 0.0, true, hi)
}

/// `field: value is not a finite number > 0` (a value with no upper bound of its own).
pub fn finite_positive(field: &str, v: f64) -> Option<String> {
    (!(v.is_finite() && v > 0.0))
        .then(|| format!("{field}: {} is not a finite number > 0", show(v)))
}

/// [`real`] for `0 ≤ v ≤ hi`.
pub fn non_negative(field: &str, v: f64, hi: f64) -> Option<String> {
    real(field, v, 0.0, false, hi)
}

/// The one check of a rate, requests/s (a rates file's row, a state file's key, `--qps`):
/// finite, `0 ≤ rate ≤ MAX_RATE`. The message names the field and the range.
pub fn rate(field: &str, v: f64) -> Option<String> {
    non_negative(field, v, MAX_RATE).map(|e| format!("{e} requests/s"))
}

/// `field: value is outside the allowed range lo ≤ value ≤ hi` for a whole number.
pub fn count(field: &str, v: u64, lo: u64, hi: u64) -> Option<String> {
    (!(lo..=hi).contains(&v))
        .then(|| format!("{field}: {v} is outside the allowed range {lo} ≤ value ≤ {hi}"))
}

/// [`count`] of a whole number given as a real (sweep values): also refuses fractions.
pub fn whole(field: &str, v: f64, lo: u64, hi: u64) -> Option<String> {
    if v.is_finite() && v.fract() == 0.0 && v >= lo as f64 && v <= hi as f64 {
        None
    } else {
        Some(format!(
            "{field}: {} is outside the allowed range {lo} ≤ value ≤ {hi} (a whole number)",
            show(v)
        ))
    }
}

/// A field read from JSON that must be a whole number: the number, or whatever else was
/// there, as text for the error that names the field (`1e308`, `1.5`, `"7"`, `an array`).
#[derive(Debug, Clone, PartialEq)]
pub enum JsonWhole {
    Int(i64),
    Other(String),
}

impl<'de> serde::Deserialize<'de> for JsonWhole {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = JsonWhole;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number")
            }
            fn visit_i64<E>(self, v: i64) -> Result<JsonWhole, E> {
                Ok(JsonWhole::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<JsonWhole, E> {
                Ok(i64::try_from(v)
                    .map_or_else(|_| JsonWhole::Other(v.to_string()), JsonWhole::Int))
            }
            fn visit_f64<E>(self, v: f64) -> Result<JsonWhole, E> {
                Ok(JsonWhole::Other(show(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<JsonWhole, E> {
                Ok(JsonWhole::Other(format!("{v:?}")))
            }
            fn visit_bool<E>(self, v: bool) -> Result<JsonWhole, E> {
                Ok(JsonWhole::Other(v.to_string()))
            }
            fn visit_unit<E>(self) -> Result<JsonWhole, E> {
                Ok(JsonWhole::Other("null".into()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<JsonWhole, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(JsonWhole::Other("an array".into()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<JsonWhole, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(JsonWhole::Other("an object".into()))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_field_and_the_range() {
        let e = positive("ladder[0]", 1e300, MAX_QPS).unwrap();
        assert_eq!(
            e,
            "ladder[0]: 1e300 is outside the allowed range 0 < value ≤ 100000"
        );
        assert!(positive("x", 0.0, 1.0).is_some());
        assert!(positive("x", f64::NAN, 1.0).is_some());
        assert!(positive("x", 1.0, 1.0).is_none());
        assert!(non_negative("x", 0.0, 1.0).is_none());
        assert_eq!(
            count("fleet.replicas", 4_000_000_000, 1, MAX_REPLICAS).unwrap(),
            "fleet.replicas: 4000000000 is outside the allowed range 1 ≤ value ≤ 10000"
        );
        assert!(count("x", 1, 1, 1).is_none());
        assert!(whole("x", 2.5, 1, 10).is_some());
        assert!(whole("x", 4e9, 1, 10).is_some());
        assert!(whole("x", 10.0, 1, 10).is_none());
        assert_eq!(
            rate("line 2: rate", 1e308).unwrap(),
            "line 2: rate: 1e308 is outside the allowed range 0 ≤ value ≤ 100000 requests/s"
        );
        assert!(rate("r", f64::INFINITY).is_some());
        assert!(rate("r", -1.0).is_some());
        assert!(rate("r", 0.0).is_none());
        assert!(rate("r", MAX_RATE).is_none());
    }
}
