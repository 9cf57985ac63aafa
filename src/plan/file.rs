//! Reading a plan file: a `cacheroute plan --out` JSON (`table`: key name → destinations) or a
//! router's state file (`format` [`STATE_FORMAT`], `keys`: hash, name, destinations, rate).
//! The one reader of both, for the router (`--plan-file`, `--initial-plan`) and for
//! `cacheroute plan --previous`.
//!
//! A plan file is streamed, never held as a JSON tree: the keys are counted as they are read
//! and the file is refused once it holds more than [`MAX_PLAN_KEYS`] of them (its whole count
//! is then still counted, without keeping anything, so the message can name it), and a key's
//! destination list is cut at 65,536 entries. Every key maps to one set of distinct
//! destination indices below the fleet's size. No clock, no randomness; [`read_plan`] takes
//! any reader.

use super::{KeyLoad, KeyMap, Plan, PlannerConfig};
use crate::bounds::{JsonWhole, MAX_PLAN_BYTES, MAX_PLAN_KEYS};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::cell::RefCell;
use std::fmt;

/// The `format` of the state file the router writes at shutdown.
pub const STATE_FORMAT: &str = "cacheroute-router-state/1";

/// What a plan file holds: key → destinations, key → name, and measured rates (state files
/// only, sorted by key).
#[derive(Debug, Default)]
pub struct PlanFile {
    pub sets: KeyMap<Vec<u16>>,
    pub names: KeyMap<String>,
    pub rates: Vec<KeyLoad>,
}

/// The fleet a plan file is read for.
#[derive(Debug, Clone, Copy)]
pub enum Fleet {
    /// Exactly this many destinations (the router): a file planned for another count is
    /// refused, and every index must be below it.
    Exactly(usize),
    /// Any size (`plan --previous`, whose fleet may have grown or shrunk since): indices must be
    /// below the file's own `destinations` when it states one.
    Any,
}

/// Read the plan file at `path` under the real caps ([`MAX_PLAN_BYTES`], [`MAX_PLAN_KEYS`]);
/// the error says what is wrong, the caller names the file.
pub fn read_plan_path(path: &std::path::Path, fleet: Fleet) -> Result<PlanFile, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let len = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
    read_plan(
        std::io::BufReader::with_capacity(1 << 16, f),
        len,
        fleet,
        MAX_PLAN_KEYS,
    )
}

/// Read a plan file of at most `max_keys` keys (the callers pass [`MAX_PLAN_KEYS`]; tests a
/// smaller cap). `len` is the file's size in bytes when known (refused above
/// [`MAX_PLAN_BYTES`] before anything is read). Errors say what is wrong and what to do; the
/// caller names the file.
pub fn read_plan<R: std::io::Read>(
    reader: R,
    len: Option<u64>,
    fleet: Fleet,
    max_keys: usize,
) -> Result<PlanFile, String> {
    if let Some(n) = len.filter(|&n| n > MAX_PLAN_BYTES) {
        return Err(format!(
            "is {n} bytes, more than the {MAX_PLAN_BYTES} a plan file may hold (at most {MAX_PLAN_KEYS} keys); pass a plan written by `cacheroute plan --out` or a router's state file"
        ));
    }
    let ctx = Ctx {
        max_keys,
        err: RefCell::new(None),
    };
    let mut de =
        serde_json::Deserializer::from_reader(std::io::Read::take(reader, MAX_PLAN_BYTES + 1));
    let doc = DocSeed(&ctx).deserialize(&mut de).and_then(|d| {
        de.end()?;
        Ok(d)
    });
    let doc = match (doc, ctx.err.into_inner()) {
        (_, Some(e)) => return Err(e),
        (Err(e), None) => {
            return Err(format!(
                "not valid JSON ({e}); pass a file written by `cacheroute plan --out` or a router's state file"
            ))
        }
        (Ok(d), None) => d,
    };
    let stated =
        match &doc.destinations {
            None => None,
            Some(v) => Some(v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
                format!("`destinations` is `{v}`, not a number of destinations ≥ 1")
            })?),
        };
    let below = match (fleet, stated) {
        (Fleet::Exactly(r), Some(n)) if n != r as u64 => {
            return Err(format!(
                "planned for {n} destinations but the router has {r} backends; replan with `--destinations {r}`"
            ))
        }
        (Fleet::Exactly(r), _) => r as u64,
        (Fleet::Any, Some(n)) => n,
        (Fleet::Any, None) => 1 << 16,
    };
    let mut out = PlanFile::default();
    let mut seen: KeyMap<()> = KeyMap::default();
    if doc.format.as_deref() == Some(STATE_FORMAT) {
        let Some(Keys::List(keys)) = doc.keys else {
            return Err(
                "missing list field `keys` (a router state file lists its keys there)".into(),
            );
        };
        for (i, e) in keys.into_iter().enumerate() {
            let missing = |f: &str| format!("keys[{i}]: missing `{f}`");
            let hex = e.key.ok_or_else(|| missing("key"))?;
            let key = u64::from_str_radix(&hex, 16)
                .map_err(|_| format!("keys[{i}].key: `{hex}` is not a 16-digit hex key hash"))?;
            let rate = e.rate.ok_or_else(|| missing("rate"))?;
            let rate = rate
                .as_f64()
                .ok_or_else(|| format!("keys[{i}].rate: `{rate}` is not a number"))?;
            if let Some(why) = crate::bounds::rate(&format!("keys[{i}].rate"), rate) {
                return Err(format!("{why}; fix or remove the key"));
            }
            let prefix_tokens = e
                .prefix_tokens
                .and_then(|x| x.as_f64())
                .filter(|x| x.is_finite() && *x >= 0.0)
                .unwrap_or(0.0);
            let ds = e.destinations.ok_or_else(|| missing("destinations"))?;
            let set = ds.distinct(&format!("keys[{i}]"), below, true)?;
            if seen.insert(key, ()).is_some() {
                return Err(format!(
                    "keys[{i}]: key {hex} appears twice; list each key once"
                ));
            }
            if !set.is_empty() {
                out.sets.insert(key, set);
            }
            if let Some(n) = e.name {
                out.names.insert(key, n);
            }
            out.rates.push(KeyLoad {
                key,
                rate,
                prefix_tokens,
            });
        }
        out.rates.sort_unstable_by_key(|k| k.key);
        return Ok(out);
    }
    let table = doc
        .table
        .ok_or("missing object field `table` (key → [destination, …])")?;
    for (k, ds) in table {
        let set = ds.distinct(&format!("table entry `{k}`"), below, false)?;
        let h = crate::key_hash(&k);
        if out.sets.insert(h, set).is_some() {
            return Err(format!(
                "table entry `{k}` appears twice; list each key once"
            ));
        }
        out.names.insert(h, k);
    }
    Ok(out)
}

/// The cap of the reading and the first error that is the file's, not the JSON's.
struct Ctx {
    max_keys: usize,
    err: RefCell<Option<String>>,
}

impl Ctx {
    /// Record `msg` as the error and stop the parse.
    fn fail<E: de::Error>(&self, msg: String) -> E {
        self.err.borrow_mut().get_or_insert(msg);
        E::custom("plan file refused")
    }

    /// Count what is left of a map or list without keeping it, and refuse the file.
    fn too_many<E: de::Error>(&self, n: usize, what: &str) -> E {
        self.fail(format!(
            "holds {n} {what}, more than the {} a plan file may hold; a plan lists the admitted keys (at most destinations × warm slots), so this is not one: pass a plan written by `cacheroute plan --out` or a router's state file",
            self.max_keys
        ))
    }
}

/// The top-level fields this reader uses (others are skipped).
#[derive(Default)]
struct Doc {
    format: Option<String>,
    destinations: Option<serde_json::Value>,
    table: Option<Vec<(String, Dests)>>,
    keys: Option<Keys>,
}

/// A state file's `keys` list; a plan file's `keys` is a count, not used here.
enum Keys {
    List(Vec<StateKey>),
    Count,
}

#[derive(Deserialize)]
struct StateKey {
    key: Option<String>,
    name: Option<String>,
    destinations: Option<Dests>,
    rate: Option<serde_json::Value>,
    prefix_tokens: Option<serde_json::Value>,
}

/// Most entries of one key's destination list kept: more than any fleet has destinations.
const MAX_LIST: usize = 1 << 16;

/// One key's destination list as read: the indices, or the first entry that is not one.
#[derive(Default)]
struct Dests {
    list: Vec<u16>,
    bad: Option<String>,
    not_a_list: bool,
}

impl Dests {
    /// The key's destinations as a sorted set, after checking each index is below `below`,
    /// none repeats, and (unless `may_be_empty`) there is one.
    fn distinct(self, what: &str, below: u64, may_be_empty: bool) -> Result<Vec<u16>, String> {
        if self.not_a_list || (!may_be_empty && self.list.is_empty() && self.bad.is_none()) {
            return Err(format!(
                "{what} is not a non-empty array of destination indices"
            ));
        }
        if let Some(b) = self.bad {
            return Err(format!(
                "{what} holds `{b}`, not a destination index below {below}"
            ));
        }
        if let Some(&d) = self.list.iter().find(|&&d| d as u64 >= below) {
            return Err(format!(
                "{what} holds `{d}`, not a destination index below {below}"
            ));
        }
        let mut set = self.list;
        set.sort_unstable();
        if let Some(w) = set.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "{what} lists destination {} more than once; a key maps to a set of distinct destinations: list each once",
                w[0]
            ));
        }
        Ok(set)
    }
}

impl<'de> Deserialize<'de> for Dests {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Dests;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of destination indices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Dests, A::Error> {
                let mut out = Dests::default();
                while let Some(v) = s.next_element::<JsonWhole>()? {
                    if out.bad.is_some() {
                        continue;
                    }
                    match v {
                        JsonWhole::Int(d)
                            if (0..=u16::MAX as i64).contains(&d) && out.list.len() < MAX_LIST =>
                        {
                            out.list.push(d as u16)
                        }
                        // More entries than there are indices: one repeats.
                        JsonWhole::Int(d) if d >= 0 && out.list.len() == MAX_LIST => {
                            out.bad = Some(format!("more than {MAX_LIST} entries"))
                        }
                        JsonWhole::Int(d) => out.bad = Some(d.to_string()),
                        JsonWhole::Other(t) => out.bad = Some(t),
                    }
                }
                Ok(out)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Dests, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Dests {
                    not_a_list: true,
                    ..Dests::default()
                })
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Dests, E> {
                Ok(Dests {
                    not_a_list: true,
                    ..Dests::default()
                })
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Dests, E> {
                self.visit_str("")
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Dests, E> {
                self.visit_str("")
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Dests, E> {
                self.visit_str("")
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Dests, E> {
                self.visit_str("")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Dests, E> {
                self.visit_str("")
            }
        }
        d.deserialize_any(V)
    }
}

struct DocSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for DocSeed<'_> {
    type Value = Doc;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Doc, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DocSeed<'_> {
    type Value = Doc;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Doc, A::Error> {
        let mut doc = Doc::default();
        while let Some(k) = m.next_key::<String>()? {
            match k.as_str() {
                "format" => doc.format = m.next_value::<Option<String>>()?,
                "destinations" => doc.destinations = Some(m.next_value()?),
                "table" => doc.table = Some(m.next_value_seed(TableSeed(self.0))?),
                "keys" => doc.keys = Some(m.next_value_seed(KeysSeed(self.0))?),
                _ => {
                    m.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(doc)
    }
}

/// A plan's `table`, refused past the cap.
struct TableSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for TableSeed<'_> {
    type Value = Vec<(String, Dests)>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TableSeed<'_> {
    type Value = Vec<(String, Dests)>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of key → [destination, …]")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(k) = m.next_key::<String>()? {
            if out.len() == self.0.max_keys {
                let mut n = out.len() + 1;
                m.next_value::<IgnoredAny>()?;
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
                    n += 1;
                }
                return Err(self.0.too_many(n, "keys in `table`"));
            }
            let v = m.next_value::<Dests>()?;
            out.push((k, v));
        }
        Ok(out)
    }
}

/// A state file's `keys` (a list, refused past the cap) or a plan's `keys` (a count).
struct KeysSeed<'c>(&'c Ctx);

impl<'de> DeserializeSeed<'de> for KeysSeed<'_> {
    type Value = Keys;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Keys, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeysSeed<'_> {
    type Value = Keys;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of keys or a count")
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Keys, E> {
        Ok(Keys::Count)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Keys, E> {
        Ok(Keys::Count)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Keys, E> {
        Ok(Keys::Count)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Keys, A::Error> {
        let mut out = Vec::new();
        loop {
            if out.len() == self.0.max_keys {
                let mut n = out.len();
                while s.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                if n > out.len() {
                    return Err(self.0.too_many(n, "entries in `keys`"));
                }
                return Ok(Keys::List(out));
            }
            match s.next_element::<StateKey>()? {
                Some(k) => out.push(k),
                None => return Ok(Keys::List(out)),
            }
        }
    }
}

/// A [`Plan`] whose table is exactly `sets`, through the planner's public API: a churn-aware
/// replan against `sets` where every key's rate equals its set size at q_cap 1 (so k_b = |set|),
/// every key fits the slot budget, and the imbalance bound never forces a move.
pub fn plan_from_sets(sets: &KeyMap<Vec<u16>>, r: usize) -> Result<Plan, String> {
    let mut keys: Vec<KeyLoad> = sets
        .iter()
        .map(|(&key, s)| KeyLoad {
            key,
            rate: s.len() as f64,
            prefix_tokens: 0.0,
        })
        .collect();
    keys.sort_unstable_by_key(|k| k.key);
    let total_k: u64 = sets.values().map(|s| s.len() as u64).sum();
    let mut pc = PlannerConfig::new(r, 1.0, total_k.max(1));
    pc.max_imbalance = 1e12;
    pc.admission_hysteresis = 0.0;
    let p =
        super::replan(&pc, &keys, sets, None).map_err(|e| format!("cannot build the plan: {e}"))?;
    let got = p.key_sets();
    if got.len() != sets.len() || sets.iter().any(|(k, s)| got.get(k) != Some(s)) {
        return Err("the planner could not reproduce the file's table exactly".into());
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str, fleet: Fleet, cap: usize) -> Result<PlanFile, String> {
        read_plan(text.as_bytes(), Some(text.len() as u64), fleet, cap)
    }

    #[test]
    fn a_plan_table_reads_back() {
        let f = read(
            r#"{"destinations": 3, "keys": 9, "table": {"a": [2, 0], "b": [1]}}"#,
            Fleet::Exactly(3),
            10,
        )
        .unwrap();
        assert_eq!(f.sets[&crate::key_hash("a")], vec![0, 2]);
        assert_eq!(f.names[&crate::key_hash("b")], "b");
        assert!(f.rates.is_empty());
    }

    #[test]
    fn keys_past_the_cap_are_refused_with_their_count() {
        let table: Vec<String> = (0..7).map(|i| format!("\"k{i}\": [0]")).collect();
        let text = format!("{{\"table\": {{{}}}}}", table.join(","));
        assert!(read(&text, Fleet::Any, 7).is_ok());
        let e = read(&text, Fleet::Any, 6).unwrap_err();
        assert!(
            e.starts_with("holds 7 keys in `table`, more than the 6 a plan file may hold;"),
            "{e}"
        );
        let keys: Vec<String> = (0..5)
            .map(|i| format!("{{\"key\": \"{i:016x}\", \"destinations\": [], \"rate\": 1}}"))
            .collect();
        let state = format!(
            "{{\"format\": \"{STATE_FORMAT}\", \"keys\": [{}]}}",
            keys.join(",")
        );
        assert_eq!(read(&state, Fleet::Any, 5).unwrap().rates.len(), 5);
        let e = read(&state, Fleet::Any, 4).unwrap_err();
        assert!(
            e.starts_with("holds 5 entries in `keys`, more than the 4"),
            "{e}"
        );
        let e = read_plan(&b"{}"[..], Some(MAX_PLAN_BYTES + 1), Fleet::Any, 4).unwrap_err();
        assert!(
            e.starts_with(&format!("is {} bytes, more than the", MAX_PLAN_BYTES + 1)),
            "{e}"
        );
    }

    #[test]
    fn a_key_maps_to_distinct_destinations_below_the_fleet_size() {
        let e = read(r#"{"table": {"k1": [0, 0, 1, 1]}}"#, Fleet::Exactly(2), 10).unwrap_err();
        assert_eq!(
            e,
            "table entry `k1` lists destination 0 more than once; a key maps to a set of distinct destinations: list each once"
        );
        let e = read(r#"{"table": {"k1": [0, 2]}}"#, Fleet::Exactly(2), 10).unwrap_err();
        assert_eq!(
            e,
            "table entry `k1` holds `2`, not a destination index below 2"
        );
        // Any fleet size: below the file's own count, when it states one.
        assert!(read(r#"{"table": {"k1": [0, 7]}}"#, Fleet::Any, 10).is_ok());
        let e = read(
            r#"{"destinations": 4, "table": {"k1": [7]}}"#,
            Fleet::Any,
            10,
        )
        .unwrap_err();
        assert!(
            e.contains("holds `7`, not a destination index below 4"),
            "{e}"
        );
        for (ds, what) in [("[\"x\"]", "`\"x\"`"), ("[-1]", "`-1`"), ("[1.5]", "`1.5`")] {
            let e = read(
                &format!("{{\"table\": {{\"k\": {ds}}}}}"),
                Fleet::Exactly(2),
                9,
            )
            .unwrap_err();
            assert!(e.contains(what), "{ds}: {e}");
        }
        for ds in ["[]", "3", "{}", "null"] {
            let e = read(
                &format!("{{\"table\": {{\"k\": {ds}}}}}"),
                Fleet::Exactly(2),
                9,
            )
            .unwrap_err();
            assert!(e.contains("not a non-empty array"), "{ds}: {e}");
        }
        let e = read(r#"{"table": {"k": [0], "k": [1]}}"#, Fleet::Exactly(2), 9).unwrap_err();
        assert!(e.contains("`k` appears twice"), "{e}");
        let e = read(r#"{"destinations": 3, "table": {}}"#, Fleet::Exactly(2), 9).unwrap_err();
        assert!(e.contains("replan with `--destinations 2`"), "{e}");
    }

    #[test]
    fn state_files_are_checked_field_by_field() {
        let st = |k: &str| format!("{{\"format\": \"{STATE_FORMAT}\", \"keys\": [{k}]}}");
        let ok = read(
            &st(r#"{"key": "00000000000000ff", "name": "a", "destinations": [1], "rate": 2.5, "prefix_tokens": 64}"#),
            Fleet::Exactly(2),
            9,
        )
        .unwrap();
        assert_eq!(ok.sets[&255], vec![1]);
        assert_eq!(ok.rates[0].rate, 2.5);
        let e = read(
            &st(r#"{"key": "00000000000000ff", "destinations": [1], "rate": 1e308}"#),
            Fleet::Exactly(2),
            9,
        )
        .unwrap_err();
        assert_eq!(
            e,
            "keys[0].rate: 1e308 is outside the allowed range 0 ≤ value ≤ 100000 requests/s; fix or remove the key"
        );
        let e = read(
            &st(r#"{"key": "00000000000000ff", "destinations": [1, 1], "rate": 1}"#),
            Fleet::Exactly(2),
            9,
        )
        .unwrap_err();
        assert!(
            e.starts_with("keys[0] lists destination 1 more than once"),
            "{e}"
        );
        let e = read(
            &st(r#"{"destinations": [1], "rate": 1}"#),
            Fleet::Exactly(2),
            9,
        )
        .unwrap_err();
        assert_eq!(e, "keys[0]: missing `key`");
        let e = read(
            &st(r#"{"key": "zz", "destinations": [1], "rate": 1}"#),
            Fleet::Any,
            9,
        )
        .unwrap_err();
        assert!(e.contains("not a 16-digit hex key hash"), "{e}");
    }

    #[test]
    fn not_json_says_what_to_pass() {
        for text in ["{not json", "[1, 2]", "{\"table\": {}} x"] {
            let e = read(text, Fleet::Any, 9).unwrap_err();
            assert!(e.starts_with("not valid JSON"), "{text}: {e}");
            assert!(e.contains("cacheroute plan --out"), "{e}");
        }
        let e = read("{}", Fleet::Any, 9).unwrap_err();
        assert!(e.starts_with("missing object field `table`"), "{e}");
    }
}
