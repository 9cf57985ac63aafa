//! The records replicas share through etcd: the plan the leader writes ([`PLAN_FORMAT`],
//! schema [`PLAN_SCHEMA`]; destinations by URL, key → destination set, the settings it was
//! built with) and each replica's rates (its [`MAX_PUBLISHED_KEYS`] hottest keys), with the
//! checks a record read from the store must pass and the merge of every replica's rates.
//! Pure: bytes in, values out.

use super::client::Kv;
use super::lease::PlanMeta;
use crate::analysis::record::Resolved;
use crate::plan::{KeyLoad, KeyMap, Plan};
use crate::router::json::at;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Instant;

/// The `format` of a shared plan record.
pub const PLAN_FORMAT: &str = "cacheroute-shared-plan";
/// The plan record's schema this router writes and reads.
pub const PLAN_SCHEMA: u64 = 1;
/// The largest plan record read or written (etcd's own default request limit is 1.5 MiB).
pub const MAX_PLAN_BYTES: usize = 1 << 20;
/// The most keys a replica publishes each interval (its hottest by rate).
pub const MAX_PUBLISHED_KEYS: usize = 4096;
/// The largest rates record read from another replica.
const MAX_RATES_BYTES: usize = 512 << 10;

/// A plan read from etcd and checked, ready for the control thread to install.
pub(crate) struct Received {
    pub plan: Plan,
    pub meta: PlanMeta,
    /// The settings the leader built it with.
    pub settings: Resolved,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    #[allow(dead_code)]
    format: String,
    #[allow(dead_code)]
    schema: u64,
    generation: u64,
    leader: String,
    destinations: Vec<Option<String>>,
    q_cap: f64,
    warm_slots: u64,
    bounded_sets: Option<bool>,
    /// The dispatch in its written form (`plan+chwbl+prefill`); absent from an older leader's.
    #[serde(default)]
    dispatch: Option<String>,
    keys: Vec<(String, Vec<u16>)>,
}

/// The plan record the leader writes: destinations by URL (`urls`, a vacant slot `None`),
/// key → set, the settings it was built with.
pub(crate) fn encode(
    p: &Plan,
    urls: &[Option<String>],
    leader: &str,
    generation: u64,
    settings: Resolved,
) -> String {
    let keys: Vec<Value> = p
        .entries
        .iter()
        .enumerate()
        .map(|(n, e)| json!([format!("{:016x}", e.key), p.dests_of(n)]))
        .collect();
    json!({
        "format": PLAN_FORMAT,
        "schema": PLAN_SCHEMA,
        "generation": generation,
        "leader": leader,
        "destinations": urls,
        "q_cap": settings.q_cap,
        "warm_slots": settings.warm_slots,
        "bounded_sets": settings.bounded_sets,
        "dispatch": settings.dispatch.to_string(),
        "keys": keys,
    })
    .to_string()
}

/// A plan record read from etcd (written at `revision`), checked against this replica's
/// backends (`ours`: URL → slot, of `destinations` slots): every destination it names must be
/// one of them (matched by URL), every key a 16-hex-digit hash with a non-empty set of named
/// destinations. Why not, in one line.
pub(crate) fn decode(
    bytes: &[u8],
    ours: &HashMap<String, usize>,
    destinations: usize,
    revision: i64,
) -> Result<Received, String> {
    if bytes.len() > MAX_PLAN_BYTES {
        return Err(format!(
            "{} bytes, over the {MAX_PLAN_BYTES} a plan record may have",
            bytes.len()
        ));
    }
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON ({e})"))?;
    if at(&v, "/format").as_str() != Some(PLAN_FORMAT) {
        return Err(format!(
            "format {}: not a cacheroute shared plan (`{PLAN_FORMAT}`)",
            at(&v, "/format")
        ));
    }
    if at(&v, "/schema").as_u64() != Some(PLAN_SCHEMA) {
        return Err(format!(
            "schema {}: this router reads schema {PLAN_SCHEMA} (replicas of different versions?)",
            at(&v, "/schema")
        ));
    }
    let r: Record = serde_json::from_value(v).map_err(|e| format!("not a plan record ({e})"))?;
    if r.keys.len() > crate::bounds::MAX_PLAN_KEYS {
        return Err(format!(
            "{} keys, over the {} a plan may hold",
            r.keys.len(),
            crate::bounds::MAX_PLAN_KEYS
        ));
    }
    if let Some(e) = crate::bounds::non_negative("q_cap", r.q_cap, f64::MAX) {
        return Err(e);
    }
    let mut slot = Vec::with_capacity(r.destinations.len());
    for (i, u) in r.destinations.iter().enumerate() {
        slot.push(match u {
            None => None,
            Some(u) => Some(*ours.get(u).ok_or_else(|| {
                format!("destination {i} `{u}` is not one of this router's backends")
            })? as u16),
        });
    }
    let mut sets: KeyMap<Vec<u16>> = KeyMap::default();
    for (hex, ds) in &r.keys {
        let key = (hex.len() == 16)
            .then(|| u64::from_str_radix(hex, 16).ok())
            .flatten()
            .ok_or_else(|| format!("key `{hex}` is not a 16-hex-digit key hash"))?;
        if ds.is_empty() {
            return Err(format!("key {hex}: no destinations"));
        }
        let mut local = Vec::with_capacity(ds.len());
        for &d in ds {
            let l =
                slot.get(d as usize).copied().flatten().ok_or_else(|| {
                    format!("key {hex}: destination {d} is not one the record names")
                })?;
            if local.contains(&l) {
                return Err(format!("key {hex}: destination {d} twice"));
            }
            local.push(l);
        }
        if sets.insert(key, local).is_some() {
            return Err(format!("key {hex} twice"));
        }
    }
    let plan = crate::plan::file::plan_from_sets(&sets, destinations)?;
    // A record without a dispatch (an older leader's) was planned with the planned one.
    let dispatch = match &r.dispatch {
        None => Default::default(),
        Some(d) => d.parse().map_err(|e| format!("dispatch: {e}"))?,
    };
    Ok(Received {
        plan,
        meta: PlanMeta {
            generation: r.generation,
            revision,
            leader: r.leader,
            installed: Instant::now(),
        },
        // A record without bounded sets (an older leader's) was planned with the default:
        // pinned sets.
        settings: Resolved {
            q_cap: r.q_cap,
            warm_slots: r.warm_slots,
            bounded_sets: r.bounded_sets.unwrap_or(false),
            dispatch,
        },
    })
}

/// A replica's rates record: its [`MAX_PUBLISHED_KEYS`] hottest keys (key, rate, prefix tokens).
pub(crate) fn rates_record(id: &str, rates: &[KeyLoad]) -> String {
    let mut top: Vec<&KeyLoad> = rates.iter().collect();
    if top.len() > MAX_PUBLISHED_KEYS {
        top.select_nth_unstable_by(MAX_PUBLISHED_KEYS - 1, |a, b| b.rate.total_cmp(&a.rate));
        top.truncate(MAX_PUBLISHED_KEYS);
    }
    let keys: Vec<Value> = top
        .iter()
        .map(|k| json!([format!("{:016x}", k.key), k.rate, k.prefix_tokens]))
        .collect();
    json!({"replica": id, "keys": keys}).to_string()
}

#[derive(serde::Deserialize)]
struct Rates {
    replica: String,
    keys: Vec<(String, f64, f64)>,
}

/// Every replica's rates summed per key (prefix tokens: the rate-weighted mean), by key. A
/// record that is not one is skipped with a log line.
pub(crate) fn merge(records: &[Kv]) -> Vec<KeyLoad> {
    let mut sum: KeyMap<(f64, f64)> = KeyMap::default();
    for r in records {
        let parsed = if r.value.len() > MAX_RATES_BYTES {
            Err(format!("{} bytes", r.value.len()))
        } else {
            serde_json::from_slice::<Rates>(&r.value).map_err(|e| e.to_string())
        };
        let rows: Result<Vec<(u64, f64, f64)>, String> = parsed.and_then(|x| {
            if x.keys.len() > MAX_PUBLISHED_KEYS {
                return Err(format!("replica {}: {} keys", x.replica, x.keys.len()));
            }
            x.keys
                .iter()
                .map(|(h, rate, p)| {
                    let key = u64::from_str_radix(h, 16).map_err(|_| format!("key `{h}`"))?;
                    let bad = crate::bounds::rate("rate", *rate)
                        .or_else(|| (!(p.is_finite() && *p >= 0.0)).then(|| format!("prefix {p}")));
                    match bad {
                        Some(b) => Err(b),
                        None => Ok((key, *rate, *p)),
                    }
                })
                .collect()
        });
        match rows {
            Ok(rows) => {
                for (key, rate, p) in rows {
                    let e = sum.entry(key).or_insert((0.0, 0.0));
                    e.0 += rate;
                    e.1 += rate * p;
                }
            }
            Err(e) => tracing::warn!(
                revision = r.mod_revision,
                "a rates record in etcd is not one ({e}); left out of the plan"
            ),
        }
    }
    let mut out: Vec<KeyLoad> = sum
        .into_iter()
        .filter(|(_, (rate, _))| *rate > 0.0)
        .map(|(key, (rate, wp))| KeyLoad {
            key,
            rate,
            prefix_tokens: wp / rate,
        })
        .collect();
    out.sort_unstable_by_key(|k| k.key);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(value: String) -> Kv {
        Kv {
            value: value.into_bytes(),
            create_revision: 1,
            mod_revision: 1,
            lease: 0,
        }
    }

    /// The leader's dispatch reaches the replicas; an older leader's record (none) reads as the
    /// planned dispatch; a dispatch this version cannot read refuses the record, naming it.
    #[test]
    fn the_dispatch_round_trips_and_a_bad_one_is_refused_naming_it() {
        use crate::analysis::record::Dispatch;
        let sets: crate::plan::KeyMap<Vec<u16>> = [(7u64, vec![0u16])].into_iter().collect();
        let plan = crate::plan::file::plan_from_sets(&sets, 1).unwrap();
        let urls = vec![Some("http://a:1".to_string())];
        let ours: HashMap<String, usize> = [("http://a:1".to_string(), 0)].into();
        let settings = Resolved {
            q_cap: 2.0,
            warm_slots: 4,
            bounded_sets: false,
            dispatch: Dispatch::REACTIVE,
        };
        let text = encode(&plan, &urls, "l", 1, settings);
        let got = decode(text.as_bytes(), &ours, 1, 1).unwrap();
        assert_eq!(got.settings.dispatch, Dispatch::REACTIVE);
        let mut v: Value = serde_json::from_str(&text).unwrap();
        v.as_object_mut().unwrap().remove("dispatch");
        let got = decode(v.to_string().as_bytes(), &ours, 1, 1).unwrap();
        assert_eq!(got.settings.dispatch, Dispatch::PLANNED);
        v["dispatch"] = Value::from("plan+ring+prefill");
        let e = decode(v.to_string().as_bytes(), &ours, 1, 1).err().unwrap();
        assert!(e.starts_with("dispatch: `plan+ring+prefill`"), "{e}");
    }

    #[test]
    fn rates_are_summed_per_key_and_a_bad_record_is_left_out() {
        let a = rates_record(
            "a",
            &[
                KeyLoad {
                    key: 1,
                    rate: 2.0,
                    prefix_tokens: 100.0,
                },
                KeyLoad {
                    key: 2,
                    rate: 1.0,
                    prefix_tokens: 10.0,
                },
            ],
        );
        let b = rates_record(
            "b",
            &[KeyLoad {
                key: 1,
                rate: 6.0,
                prefix_tokens: 200.0,
            }],
        );
        let bad = r#"{"replica":"c","keys":[["0000000000000001",-5.0,1.0]]}"#.to_string();
        let m = merge(&[rec(a), rec(b), rec(bad), rec("{".into())]);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].key, m[0].rate, m[0].prefix_tokens), (1, 8.0, 175.0));
        assert_eq!((m[1].key, m[1].rate), (2, 1.0));
    }

    #[test]
    fn a_replica_publishes_only_its_hottest_keys() {
        let rates: Vec<KeyLoad> = (0..(MAX_PUBLISHED_KEYS as u64 + 50))
            .map(|k| KeyLoad {
                key: k,
                rate: k as f64,
                prefix_tokens: 0.0,
            })
            .collect();
        let m = merge(&[rec(rates_record("a", &rates))]);
        assert_eq!(m.len(), MAX_PUBLISHED_KEYS);
        assert_eq!(m[0].key, 50, "the 50 coldest were left out");
    }
}
