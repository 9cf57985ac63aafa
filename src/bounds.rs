//! Allowed ranges of the numbers a user gives (study specs, the workload generator's settings,
//! policy parameters, command-line flags), and the one check that names the field and the
//! range. A value outside its range is refused before anything is allocated for it: a ladder
//! step of 1e300 req/s or four billion replicas must be a one-line error, not an exhausted
//! machine. One such number is a type: [`TimeScale`], how many times faster than real time an
//! emulated engine runs its model, and the one way between wall seconds and the model's. Pure:
//! no I/O; depends on nothing else in the crate (serde only, to read a whole number whatever
//! the JSON holds: [`JsonWhole`], and to read and write a [`TimeScale`] as its number).

/// Highest offered load of a ladder step or a generated trace, requests/s.
pub const MAX_QPS: f64 = 100_000.0;
/// Longest warm-up, measured window or generated trace, seconds (one week).
pub const MAX_SECONDS: f64 = 604_800.0;
/// Most requests one ladder step (or one generated run) may hold: rate × duration.
pub const MAX_REQUESTS: f64 = 10_000_000.0;
/// Most engine replicas (destinations) of a fleet.
pub const MAX_REPLICAS: u64 = 10_000;
/// Most router replicas of one policy (a study's `router_replicas` sweep, `simulate
/// --router-replicas`).
pub const MAX_ROUTER_REPLICAS: u64 = 64;
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

/// Highest time scale: how many times faster than real time an emulated engine may run its
/// engine model ([`TimeScale`]).
pub const MAX_TIME_SCALE: f64 = 10_000.0;

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

/// How many times faster than real time the engine model runs (`time_scale`: 1 is real time,
/// 10 ten times faster), and the one way between wall seconds and the model's seconds: model
/// seconds = wall seconds × the scale. Checked once, where it is made ([`TimeScale::new`]:
/// `0 < value ≤ MAX_TIME_SCALE`); files and flags carry it as the plain number.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct TimeScale(f64);

impl TimeScale {
    /// Real time: the model's seconds are wall seconds.
    pub const REAL: TimeScale = TimeScale(1.0);

    /// The scale `f`, or the one-line error that names the field and the range.
    pub fn new(f: f64) -> Result<TimeScale, String> {
        match positive("time_scale", f, MAX_TIME_SCALE) {
            None => Ok(TimeScale(f)),
            Some(e) => Err(format!(
                "{e}; give how many times faster than real time the engine model runs (1: real time)"
            )),
        }
    }

    /// The number (for output; convert with the methods below).
    pub fn get(self) -> f64 {
        self.0
    }

    /// Whether the model runs in real time (scale 1).
    pub fn is_real(self) -> bool {
        self.0 == 1.0
    }

    /// Wall seconds as the model's seconds.
    pub fn to_model(self, wall_s: f64) -> f64 {
        wall_s * self.0
    }

    /// The model's seconds as wall seconds.
    pub fn to_wall(self, model_s: f64) -> f64 {
        model_s / self.0
    }

    /// The model's seconds as a wall-clock duration: 0 when negative or NaN, the longest
    /// duration when too long for one.
    pub fn wall_duration(self, model_s: f64) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.to_wall(model_s).max(0.0))
            .unwrap_or(std::time::Duration::MAX)
    }

    /// A wall-clock duration (time elapsed) in the model's seconds.
    pub fn model_since(self, wall: std::time::Duration) -> f64 {
        self.to_model(wall.as_secs_f64())
    }
}

impl Default for TimeScale {
    fn default() -> Self {
        TimeScale::REAL
    }
}

impl TryFrom<f64> for TimeScale {
    type Error = String;
    fn try_from(f: f64) -> Result<Self, String> {
        TimeScale::new(f)
    }
}

impl From<TimeScale> for f64 {
    fn from(t: TimeScale) -> f64 {
        t.0
    }
}

impl std::str::FromStr for TimeScale {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let f: f64 = s.trim().parse().map_err(|_| {
            format!("time_scale: `{s}` is not a number; give how many times faster than real time the engine model runs (1: real time)")
        })?;
        TimeScale::new(f)
    }
}

/// The number as `f64` prints it (`10`, `0.5`).
impl std::fmt::Display for TimeScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
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

    #[test]
    fn a_time_scale_is_checked_once_in_one_range() {
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            10_001.0,
        ] {
            let e = TimeScale::new(bad).unwrap_err();
            assert!(e.starts_with("time_scale: "), "{e}");
            assert!(e.contains("0 < value ≤ 10000"), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
        for good in [1e4, 0.5, 1.0, 1e-3] {
            assert_eq!(TimeScale::new(good).unwrap().get(), good);
        }
        assert_eq!(
            TimeScale::new(0.0).unwrap_err(),
            "time_scale: 0 is outside the allowed range 0 < value ≤ 10000; give how many \
             times faster than real time the engine model runs (1: real time)"
        );
        assert!(TimeScale::REAL.is_real() && TimeScale::default().is_real());
        assert!(!TimeScale::new(2.0).unwrap().is_real());
    }

    #[test]
    fn a_time_scale_converts_both_ways() {
        let f = TimeScale::new(8.0).unwrap();
        assert_eq!(f.to_model(2.0), 16.0);
        assert_eq!(f.to_wall(16.0), 2.0);
        assert_eq!(f.wall_duration(4.0), std::time::Duration::from_millis(500));
        assert_eq!(f.model_since(std::time::Duration::from_millis(500)), 4.0);
        // Never a panic: nothing before now, and a duration too long for one is the longest.
        assert_eq!(f.wall_duration(-1.0), std::time::Duration::ZERO);
        assert_eq!(f.wall_duration(f64::NAN), std::time::Duration::ZERO);
        assert_eq!(f.wall_duration(f64::INFINITY), std::time::Duration::MAX);
        for s in [0.3, 0.7, 3.0, 1e-4, MAX_TIME_SCALE] {
            let t = TimeScale::new(s).unwrap();
            for x in [0.0, 1e-3, 0.1, 1.0, 123.456, 86_400.0, 1e9] {
                let back = t.to_model(t.to_wall(x));
                assert!(
                    (back - x).abs() <= 1e-12 * x.abs().max(1.0),
                    "{s} {x} {back}"
                );
            }
        }
        assert_eq!(TimeScale::REAL.to_model(1.25), 1.25);
    }

    #[test]
    fn a_time_scale_reads_and_writes_the_plain_number() {
        #[derive(serde::Serialize, serde::Deserialize)]
        struct S {
            time_scale: TimeScale,
        }
        let s: S = serde_json::from_str(r#"{"time_scale": 8}"#).unwrap();
        assert_eq!(s.time_scale.get(), 8.0);
        assert_eq!(serde_json::to_string(&s).unwrap(), r#"{"time_scale":8.0}"#);
        let e = serde_json::from_str::<S>(r#"{"time_scale": 0}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("time_scale: 0 is outside the allowed range"),
            "{e}"
        );
        assert_eq!("2.5".parse::<TimeScale>().unwrap().get(), 2.5);
        assert!("1e9"
            .parse::<TimeScale>()
            .unwrap_err()
            .starts_with("time_scale: 1e9"));
        assert!("x"
            .parse::<TimeScale>()
            .unwrap_err()
            .starts_with("time_scale: `x`"));
        assert_eq!(TimeScale::new(10.0).unwrap().to_string(), "10");
        assert_eq!(TimeScale::new(0.5).unwrap().to_string(), "0.5");
    }
}
