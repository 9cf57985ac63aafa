//! Router replicas that share one CacheRoute plan through etcd v3 (`--etcd`; docs/router.md,
//! "Many replicas, one plan"). No protocol of our own: etcd's leases, a transaction that
//! creates the leader key only where none exists (`create_revision == 0`), and a watch.
//!
//! Keys under the prefix `P`:
//! - `P/rates/ID`: each replica's measured per-key rates (its [`MAX_PUBLISHED_KEYS`] hottest),
//!   written every control interval under the replica's lease (gone when the replica is).
//! - `P/leader`: the leader's name, under its lease; created by a transaction that succeeds
//!   only while the key does not exist.
//! - `P/plan`: the plan in force ([`PLAN_FORMAT`], schema [`PLAN_SCHEMA`]): generation, the
//!   destinations by URL, key → destination set. Written by the leader only while it still
//!   holds `P/leader` (a transaction comparing the key's create revision).
//!
//! Every interval each replica writes its rates; the leader reads them all, sums them per key,
//! plans with the one controller ([`crate::control::Controller::step_from`]) and writes the
//! plan. Every replica watches `P/plan` and installs what it reads once checked ([`decode`]);
//! a plan that fails the check is refused with a log line and the plan in force kept. A
//! replica installs the stored plan before it serves (`spawn`), and routes on its last plan
//! while etcd cannot be reached (fail static), saying so in `/health` and `/metrics`.
//!
//! etcd is spoken to through its v3 JSON gateway (HTTP/1.1, base64 keys and values) with the
//! HTTP client the router already has, on three threads of its own (lease and leadership,
//! watch, and the control thread's writes), never on the request path.

use super::config::EtcdConfig;
use super::json::{at, set};
use super::lock::Locked;
use super::metrics::Scalar;
use super::state::{Cmd, Shared};
use crate::control::Controller;
use crate::plan::{KeyLoad, KeyMap, Plan};
use crate::workload::trace::TraceRecord;
use serde_json::{json, Value};
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
/// One etcd call's limit (the watch has none: it streams).
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a replica that does not lead tries to (and the leader checks that it still does).
const CAMPAIGN: Duration = Duration::from_millis(500);
/// Wait before a failed watch is opened again.
const RETRY: Duration = Duration::from_millis(500);

// ---------------------------------------------------------------------------------------------
// etcd's v3 JSON gateway.

/// Standard base64 with padding (the gateway's encoding of `bytes` fields).
fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(s: &str) -> Result<Vec<u8>, String> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| format!("not base64 ({e})"))
}

/// A 64-bit field as the gateway writes it (a JSON string), 0 when absent.
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The end of the range of every key that starts with `p`.
fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut e = p.to_vec();
    while let Some(last) = e.last_mut() {
        if *last < 0xff {
            *last += 1;
            return e;
        }
        e.pop();
    }
    vec![0]
}

/// One key-value as etcd returns it.
#[derive(Debug, Clone)]
pub(crate) struct Kv {
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: i64,
}

fn kv(v: &Value) -> Option<Kv> {
    Some(Kv {
        value: unb64(v.get("value").and_then(Value::as_str).unwrap_or("")).ok()?,
        create_revision: int(at(v, "/create_revision")),
        mod_revision: int(at(v, "/mod_revision")),
        lease: int(at(v, "/lease")),
    })
    .filter(|_| v.get("key").is_some())
}

fn kvs(v: &Value) -> Vec<Kv> {
    at(v, "/kvs")
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(kv)
        .collect()
}

/// A blocking client of etcd's v3 JSON gateway (made and used off any async runtime).
pub(crate) struct Client {
    base: String,
    http: reqwest::blocking::Client,
}

impl Client {
    pub fn new(endpoint: &str, timeout: Option<Duration>) -> Result<Self, String> {
        let http = reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(1))
            .timeout(timeout)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("etcd client: {}", crate::error_chain(&e)))?;
        Ok(Self {
            base: format!("{}/v3", endpoint.trim_end_matches('/')),
            http,
        })
    }

    fn post(&self, path: &str, body: &Value) -> Result<reqwest::blocking::Response, String> {
        let r = self
            .http
            .post(format!("{}/{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .map_err(|e| format!("etcd {}/{path}: {}", self.base, crate::error_chain(&e)))?;
        if r.status().is_success() {
            return Ok(r);
        }
        let status = r.status();
        let text: String = r.text().unwrap_or_default().chars().take(300).collect();
        Err(format!("etcd {}/{path}: HTTP {status}: {text}", self.base))
    }

    fn call(&self, path: &str, body: Value) -> Result<Value, String> {
        let text = self
            .post(path, &body)?
            .text()
            .map_err(|e| format!("etcd {}/{path}: {}", self.base, crate::error_chain(&e)))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| format!("etcd {}/{path}: not JSON ({e})", self.base))?;
        match v.get("error") {
            Some(e) => Err(format!("etcd {}/{path}: {e}", self.base)),
            None => Ok(v),
        }
    }

    /// `key`'s value (if any) and the store's revision.
    pub fn get(&self, key: &str) -> Result<(Option<Kv>, i64), String> {
        let v = self.call("kv/range", json!({"key": b64(key.as_bytes())}))?;
        Ok((kvs(&v).into_iter().next(), int(at(&v, "/header/revision"))))
    }

    /// Every key under `prefix`.
    pub fn get_prefix(&self, prefix: &str) -> Result<Vec<Kv>, String> {
        let p = prefix.as_bytes();
        let v = self.call(
            "kv/range",
            json!({"key": b64(p), "range_end": b64(&prefix_end(p))}),
        )?;
        Ok(kvs(&v))
    }

    /// Put `key` = `value` (under `lease` when not 0); the store's new revision.
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<i64, String> {
        let mut b = json!({"key": b64(key.as_bytes()), "value": b64(value)});
        if lease != 0 {
            set(&mut b, "lease", json!(lease.to_string()));
        }
        Ok(int(at(&self.call("kv/put", b)?, "/header/revision")))
    }

    /// A lease of `ttl_s` seconds: its id.
    pub fn grant(&self, ttl_s: u64) -> Result<i64, String> {
        let v = self.call("lease/grant", json!({"TTL": ttl_s.to_string()}))?;
        match int(at(&v, "/ID")) {
            0 => Err(format!("etcd lease/grant: no lease in {v}")),
            id => Ok(id),
        }
    }

    /// Renew lease `id`: its TTL now (0: the lease is gone).
    pub fn keepalive(&self, id: i64) -> Result<i64, String> {
        let v = self.call("lease/keepalive", json!({"ID": id.to_string()}))?;
        Ok(int(at(&v, "/result/TTL")))
    }

    pub fn revoke(&self, id: i64) -> Result<(), String> {
        self.call("lease/revoke", json!({"ID": id.to_string()}))
            .map(|_| ())
    }

    /// Create `key` = `value` under `lease` where `key` does not exist: `Ok(Ok(its create
    /// revision))` when this call created it, `Ok(Err(what holds it))` otherwise.
    pub fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
    ) -> Result<Result<i64, Option<Kv>>, String> {
        let k = b64(key.as_bytes());
        let v = self.call(
            "kv/txn",
            json!({
                "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": k, "value": b64(value), "lease": lease.to_string()}}],
                "failure": [{"request_range": {"key": k}}],
            }),
        )?;
        if at(&v, "/succeeded").as_bool() == Some(true) {
            return Ok(Ok(int(at(&v, "/header/revision"))));
        }
        Ok(Err(kvs(at(&v, "/responses/0/response_range"))
            .into_iter()
            .next()))
    }

    /// Put `key` = `value` only while `guard`'s create revision is `created` (the replica
    /// that created it still holds it): the put's revision, or `None`.
    pub fn put_if(
        &self,
        guard: &str,
        created: i64,
        key: &str,
        value: &[u8],
    ) -> Result<Option<i64>, String> {
        let v = self.call(
            "kv/txn",
            json!({
                "compare": [{"key": b64(guard.as_bytes()), "target": "CREATE", "result": "EQUAL",
                             "create_revision": created.to_string()}],
                "success": [{"request_put": {"key": b64(key.as_bytes()), "value": b64(value)}}],
            }),
        )?;
        Ok((at(&v, "/succeeded").as_bool() == Some(true)).then(|| int(at(&v, "/header/revision"))))
    }

    /// Watch `key` from revision `start`: every value put, to `on_put`, until the stream ends
    /// or fails.
    pub fn watch(&self, key: &str, start: i64, mut on_put: impl FnMut(Kv)) -> Result<(), String> {
        let r = self.post(
            "watch",
            &json!({"create_request": {"key": b64(key.as_bytes()), "start_revision": start.to_string()}}),
        )?;
        for line in std::io::BufReader::new(r).lines() {
            let line = line.map_err(|e| format!("etcd watch: {e}"))?;
            if line.trim().is_empty() {
                continue;
            }
            let v: Value =
                serde_json::from_str(&line).map_err(|e| format!("etcd watch: not JSON ({e})"))?;
            if let Some(e) = v.get("error") {
                return Err(format!("etcd watch: {e}"));
            }
            let res = at(&v, "/result");
            if at(res, "/canceled").as_bool() == Some(true) {
                return Err(format!(
                    "etcd watch canceled: {}",
                    at(res, "/cancel_reason")
                ));
            }
            for e in at(res, "/events").as_array().into_iter().flatten() {
                if at(e, "/type").as_str() == Some("DELETE") {
                    continue;
                }
                if let Some(kv) = kv(at(e, "/kv")) {
                    on_put(kv);
                }
            }
        }
        Ok(())
    }
}

/// Put `key` = `value` into the etcd at `endpoint` (http://HOST:PORT): the store's new
/// revision. For tools and tests that write a key by hand (the router itself writes through
/// its threads). Blocking: call it off any async runtime.
pub fn etcd_put(endpoint: &str, key: &str, value: &[u8]) -> Result<i64, String> {
    Client::new(endpoint, Some(CALL_TIMEOUT))?.put(key, value, 0)
}

// ---------------------------------------------------------------------------------------------
// What a replica knows of the store (shown by /health, /metrics, /admin/plan).

/// The shared plan in force: its generation, the etcd revision it was written at, its leader.
#[derive(Debug, Clone)]
pub(crate) struct PlanMeta {
    pub generation: u64,
    pub revision: i64,
    pub leader: String,
    pub installed: Instant,
}

#[derive(Default)]
struct Inner {
    error: Option<String>,
    down_since: Option<Instant>,
    leader_id: Option<String>,
    plan: Option<PlanMeta>,
    refused_revision: i64,
}

/// The replica's view of the store, shared by its etcd threads and its endpoints.
pub(crate) struct Status {
    pub cfg: EtcdConfig,
    up: AtomicBool,
    leader: AtomicBool,
    lease: AtomicI64,
    /// The leader key's create revision while this replica holds it.
    led_at: AtomicI64,
    refused: AtomicU64,
    errors: AtomicU64,
    written: AtomicU64,
    stopped: AtomicBool,
    inner: Mutex<Inner>,
}

impl Status {
    pub fn new(cfg: &EtcdConfig) -> Self {
        Self {
            cfg: cfg.clone(),
            up: AtomicBool::new(false),
            leader: AtomicBool::new(false),
            lease: AtomicI64::new(0),
            led_at: AtomicI64::new(0),
            refused: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            written: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn key(&self, what: &str) -> String {
        format!("{}/{what}", self.cfg.prefix)
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    fn ok(&self) {
        let mut i = self.inner();
        if let Some(since) = i.down_since.take() {
            tracing::info!(
                endpoint = %self.cfg.endpoint,
                "etcd reachable again after {:.1} s; sharing the plan again",
                since.elapsed().as_secs_f64()
            );
        }
        i.error = None;
        self.up.store(true, Relaxed);
    }

    fn failed(&self, e: String) {
        self.errors.fetch_add(1, Relaxed);
        self.up.store(false, Relaxed);
        let mut i = self.inner();
        if i.down_since.is_none() {
            i.down_since = Some(Instant::now());
            tracing::warn!(
                endpoint = %self.cfg.endpoint,
                "{e}; routing on the plan in force (fail static) and retrying"
            );
        }
        i.error = Some(e);
    }

    fn down_for(&self) -> Duration {
        self.inner()
            .down_since
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    pub fn is_leader(&self) -> bool {
        self.leader.load(Relaxed)
    }

    fn lead(&self, created: i64) {
        self.led_at.store(created, Relaxed);
        if !self.leader.swap(true, Relaxed) {
            tracing::info!(
                replica = %self.cfg.replica_id,
                "this replica leads: it merges every replica's rates and writes the plan ({}/leader, lease {:x})",
                self.cfg.prefix,
                self.lease.load(Relaxed)
            );
        }
        self.inner().leader_id = Some(self.cfg.replica_id.clone());
    }

    fn lost_lead(&self, why: &str) {
        if self.leader.swap(false, Relaxed) {
            tracing::warn!(replica = %self.cfg.replica_id, "no longer the leader: {why}");
        }
    }

    fn generation(&self) -> u64 {
        self.inner().plan.as_ref().map_or(0, |p| p.generation)
    }

    /// Whether the plan in force was written at `revision`.
    fn in_force(&self, revision: i64) -> bool {
        self.inner()
            .plan
            .as_ref()
            .is_some_and(|p| p.revision == revision)
    }

    /// Whether a plan written at `revision` is newer than the one in force.
    fn newer(&self, revision: i64) -> bool {
        self.inner()
            .plan
            .as_ref()
            .is_none_or(|p| revision > p.revision)
    }

    /// etcd's revision now: one below the plan in force's means a new store (its data lost or
    /// replaced), whose revisions start over; the plan in force is then kept but no longer
    /// blocks the new store's plans.
    fn store_revision(&self, revision: i64) {
        let mut i = self.inner();
        if let Some(p) = i.plan.as_mut().filter(|p| revision < p.revision) {
            tracing::warn!(
                "etcd's revision {revision} is below the plan in force's {}: a new store; its plans are taken from now on",
                p.revision
            );
            p.revision = 0;
        }
    }

    fn installed(&self, meta: PlanMeta) {
        self.inner().plan = Some(meta);
    }

    fn refuse(&self, revision: i64, why: &str) {
        let mut i = self.inner();
        if i.refused_revision == revision {
            return;
        }
        i.refused_revision = revision;
        self.refused.fetch_add(1, Relaxed);
        tracing::warn!(
            revision,
            "plan in etcd ({}/plan, revision {revision}) refused: {why}; the plan in force stays",
            self.cfg.prefix
        );
    }

    fn plan_json(&self) -> Value {
        match &self.inner().plan {
            None => Value::Null,
            Some(p) => json!({
                "generation": p.generation,
                "revision": p.revision,
                "leader": p.leader,
                "age_s": p.installed.elapsed().as_secs_f64(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The records.

/// A plan read from etcd and checked, ready for the control thread to install.
pub(crate) struct Received {
    pub plan: Plan,
    pub meta: PlanMeta,
    pub q_cap: f64,
    pub warm_slots: u64,
    pub bounded_sets: Option<bool>,
    /// The merged rates it was built from (the leader's own plan; empty when read).
    pub rates: Vec<KeyLoad>,
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
    keys: Vec<(String, Vec<u16>)>,
}

/// The plan record the leader writes: destinations by URL (vacant slots null), key → set.
fn encode(p: &Plan, s: &Shared, generation: u64, q_cap: f64, w: u64, b: Option<bool>) -> String {
    let urls: Vec<Value> = (0..p.destinations)
        .map(|d| {
            if d < s.fleet.dests.len() && !s.fleet.is_vacant(d) {
                json!(&*s.fleet.dest(d).url())
            } else {
                Value::Null
            }
        })
        .collect();
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
        "leader": s.plan_store.as_ref().map_or("", |st| st.cfg.replica_id.as_str()),
        "destinations": urls,
        "q_cap": q_cap,
        "warm_slots": w,
        "bounded_sets": b,
        "keys": keys,
    })
    .to_string()
}

/// A plan record read from etcd (written at `revision`), checked against this replica's
/// backends: every destination it names must be one of them (matched by URL), every key a
/// 16-hex-digit hash with a non-empty set of named destinations. Why not, in one line.
pub(crate) fn decode(bytes: &[u8], s: &Shared, revision: i64) -> Result<Received, String> {
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
    if !(r.q_cap.is_finite() && r.q_cap >= 0.0) {
        return Err(format!("q_cap {} is not a rate", r.q_cap));
    }
    let ours: std::collections::HashMap<String, usize> = s
        .fleet
        .backends()
        .into_iter()
        .map(|(d, u)| (u.to_string(), d))
        .collect();
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
    let plan = super::control::plan_from_sets(&sets, s.fleet.dests.len())?;
    Ok(Received {
        plan,
        meta: PlanMeta {
            generation: r.generation,
            revision,
            leader: r.leader,
            installed: Instant::now(),
        },
        q_cap: r.q_cap,
        warm_slots: r.warm_slots,
        bounded_sets: r.bounded_sets,
        rates: Vec::new(),
    })
}

/// A replica's rates record: its [`MAX_PUBLISHED_KEYS`] hottest keys (key, rate, prefix tokens).
fn rates_record(id: &str, rates: &[KeyLoad]) -> String {
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
fn merge(records: &[Kv]) -> Vec<KeyLoad> {
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

// ---------------------------------------------------------------------------------------------
// The threads.

/// The control thread's side of the sharing (its own client), made by [`start`].
pub(crate) struct Sharer {
    st: Arc<Status>,
    etcd: Client,
}

/// Start sharing: read the stored plan (to be installed before the replica serves), then
/// start the lease-and-leadership thread and the watch. Runs on a plain thread (the blocking
/// client must not be made on an async runtime). etcd unreachable is not an error: the
/// replica starts without a plan and takes one when etcd answers.
pub(crate) fn start(
    s: &Arc<Shared>,
    st: Arc<Status>,
) -> Result<(Sharer, Option<Received>), String> {
    let etcd = Client::new(&st.cfg.endpoint, Some(CALL_TIMEOUT))?;
    let first = match etcd.get(&st.key("plan")) {
        Ok((kv, _)) => {
            st.ok();
            kv.and_then(|kv| match decode(&kv.value, s, kv.mod_revision) {
                Ok(r) => Some(r),
                Err(e) => {
                    st.refuse(kv.mod_revision, &e);
                    None
                }
            })
        }
        Err(e) => {
            st.failed(e);
            None
        }
    };
    match &first {
        Some(r) => tracing::info!(
            generation = r.meta.generation,
            revision = r.meta.revision,
            leader = %r.meta.leader,
            "shared plan read from etcd before serving: {} keys",
            r.plan.admitted()
        ),
        None => tracing::info!(
            "no shared plan in etcd yet ({}/plan); routing by the cold tail until the leader writes one",
            st.cfg.prefix
        ),
    }
    let keeper = (
        st.clone(),
        Client::new(&st.cfg.endpoint, Some(CALL_TIMEOUT))?,
    );
    std::thread::Builder::new()
        .name("cacheroute-etcd-lease".into())
        .spawn(move || keep(keeper.0, keeper.1))
        .map_err(|e| format!("starting the etcd lease thread: {e}"))?;
    let watcher = (
        s.clone(),
        st.clone(),
        Client::new(&st.cfg.endpoint, Some(Duration::from_secs(300)))?,
    );
    std::thread::Builder::new()
        .name("cacheroute-etcd-watch".into())
        .spawn(move || watch(watcher.0, watcher.1, watcher.2))
        .map_err(|e| format!("starting the etcd watch thread: {e}"))?;
    Ok((Sharer { st, etcd }, first))
}

/// The lease and the leader role: renew the lease every third of its TTL (a new one when it
/// is gone), and every [`CAMPAIGN`] (or third of the TTL, if shorter) either check that the
/// leader key is still this replica's or, while another holds it, try to create it: a
/// leader's key is gone a TTL after its last renewal, and another replica holds it at most
/// one look later.
fn keep(st: Arc<Status>, etcd: Client) {
    let ttl = st.cfg.lease_ttl;
    let leader_key = st.key("leader");
    let me = st.cfg.replica_id.clone();
    let renew_every = ttl / 3;
    let mut renewed: Option<Instant> = None;
    while !st.stopped.load(Relaxed) {
        let mut lease = st.lease.load(Relaxed);
        if lease != 0 && renewed.is_none_or(|t| t.elapsed() >= renew_every) {
            renewed = Some(Instant::now());
            match etcd.keepalive(lease) {
                Ok(t) if t > 0 => st.ok(),
                Ok(_) => {
                    st.ok();
                    tracing::warn!("etcd lease {lease:x} expired; taking a new one");
                    st.lost_lead("its lease expired");
                    st.lease.store(0, Relaxed);
                    lease = 0;
                }
                Err(e) => {
                    st.failed(e);
                    if st.down_for() >= ttl {
                        st.lost_lead("etcd unreachable for a lease TTL");
                    }
                }
            }
        }
        if lease == 0 {
            match etcd.grant(ttl.as_secs()) {
                Ok(id) => {
                    st.ok();
                    st.lease.store(id, Relaxed);
                    lease = id;
                    renewed = Some(Instant::now());
                }
                Err(e) => st.failed(e),
            }
        }
        if lease != 0 && st.up.load(Relaxed) {
            if st.is_leader() {
                match etcd.get(&leader_key) {
                    Ok((Some(kv), _)) if kv.create_revision == st.led_at.load(Relaxed) => {}
                    Ok(_) => st.lost_lead("the leader key is gone or another's"),
                    Err(e) => st.failed(e),
                }
            } else {
                match etcd.create(&leader_key, me.as_bytes(), lease) {
                    Ok(Ok(created)) => st.lead(created),
                    // Still ours (held through an outage of etcd under the same lease).
                    Ok(Err(Some(kv))) if kv.lease == lease && kv.value == me.as_bytes() => {
                        st.lead(kv.create_revision)
                    }
                    Ok(Err(holder)) => {
                        st.inner().leader_id =
                            holder.map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
                    }
                    Err(e) => st.failed(e),
                }
            }
        }
        std::thread::sleep(renew_every.min(CAMPAIGN));
    }
}

/// The plan's watch: read the stored plan, then watch from the next revision; on any
/// failure, again after [`RETRY`].
fn watch(s: Arc<Shared>, st: Arc<Status>, etcd: Client) {
    let key = st.key("plan");
    // Each value is checked, also one a newer plan already superseded (the leader installs
    // its own at once, maybe before its watch sees what was written just before): a bad
    // record is refused and said so whenever it is read. The plan in force itself is not
    // read twice.
    let deliver = |kv: Kv| {
        if st.in_force(kv.mod_revision) {
            return;
        }
        match decode(&kv.value, &s, kv.mod_revision) {
            Ok(r) if st.newer(kv.mod_revision) => {
                s.send_control(Cmd::Shared(Box::new(r)));
            }
            Ok(_) => {}
            Err(e) => st.refuse(kv.mod_revision, &e),
        }
    };
    while !st.stopped.load(Relaxed) {
        match etcd.get(&key) {
            Ok((kv, revision)) => {
                st.ok();
                st.store_revision(revision);
                if let Some(kv) = kv {
                    deliver(kv);
                }
                if let Err(e) = etcd.watch(&key, revision + 1, &deliver) {
                    if !st.stopped.load(Relaxed) {
                        st.failed(e);
                    }
                }
            }
            Err(e) => st.failed(e),
        }
        std::thread::sleep(RETRY);
    }
}

impl Sharer {
    /// One control interval: publish this replica's rates (`local`); when it leads, plan from
    /// every replica's and write the plan. The leader's plan, once etcd took it.
    pub fn tick(
        &self,
        s: &Shared,
        ctl: &mut Controller,
        local: &[KeyLoad],
        down: &[bool],
        recent: &[TraceRecord],
    ) -> Option<Received> {
        let st = &self.st;
        let lease = st.lease.load(Relaxed);
        if lease == 0 {
            return None;
        }
        let me = &st.cfg.replica_id;
        let published = rates_record(me, local);
        if let Err(e) = self
            .etcd
            .put(&st.key(&format!("rates/{me}")), published.as_bytes(), lease)
        {
            st.failed(e);
            return None;
        }
        st.ok();
        if !st.is_leader() {
            return None;
        }
        let all = match self.etcd.get_prefix(&st.key("rates/")) {
            Ok(kvs) => kvs,
            Err(e) => {
                st.failed(e);
                return None;
            }
        };
        let merged = merge(&all);
        let step = match ctl.step_from(merged.clone(), down, recent)? {
            Ok(step) => step,
            Err(e) => {
                tracing::warn!("{e}; no plan written");
                return None;
            }
        };
        let (q_cap, w) = (step.q_cap, step.warm_slots);
        let bounded = step
            .tuned
            .as_ref()
            .map(|t| t.1)
            .or(ctl.tuned().map(|t| t.2))
            .or(ctl.config().bounded_sets);
        let prev = s.plan();
        let d = match ctl.build(step, s.now(), prev.as_deref(), down) {
            Ok(d) => d,
            Err(e) => {
                s.counters.plan_failures.fetch_add(1, Relaxed);
                tracing::warn!("{e}; the plan in force stays");
                return None;
            }
        };
        let generation = st.generation() + 1;
        let text = encode(&d.plan, s, generation, q_cap, w, bounded);
        if text.len() > MAX_PLAN_BYTES {
            tracing::warn!(
                "the plan is {} bytes, over the {MAX_PLAN_BYTES} a plan record may have; not written (admit fewer keys: a lower --warm-slots)",
                text.len()
            );
            return None;
        }
        let wrote = self.etcd.put_if(
            &st.key("leader"),
            st.led_at.load(Relaxed),
            &st.key("plan"),
            text.as_bytes(),
        );
        match wrote {
            Ok(Some(revision)) => {
                st.written.fetch_add(1, Relaxed);
                Some(Received {
                    plan: d.plan,
                    meta: PlanMeta {
                        generation,
                        revision,
                        leader: me.clone(),
                        installed: Instant::now(),
                    },
                    q_cap,
                    warm_slots: w,
                    bounded_sets: bounded,
                    rates: merged,
                })
            }
            Ok(None) => {
                st.lost_lead("the leader key is no longer this replica's");
                None
            }
            Err(e) => {
                st.failed(e);
                None
            }
        }
    }

    /// Whether a plan written at `revision` is newer than the one in force; remember it as
    /// installed when it is.
    pub fn take(&self, meta: &PlanMeta) -> bool {
        if !self.st.newer(meta.revision) {
            return false;
        }
        self.st.installed(meta.clone());
        true
    }

    /// Stop: the threads end, the lease is revoked (the leader role passes at once rather
    /// than after a TTL).
    pub fn stop(&self) {
        self.st.stopped.store(true, Relaxed);
        let lease = self.st.lease.swap(0, Relaxed);
        self.st.leader.store(false, Relaxed);
        if lease != 0 {
            let _ = self.etcd.revoke(lease);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the endpoints show.

/// `/health`'s `plan_store` details (`None` without `--etcd`).
pub(crate) fn health(s: &Shared) -> Option<Value> {
    let st = s.plan_store.as_ref()?;
    let i = st.inner();
    let up = st.up.load(Relaxed);
    let state = match (up, i.plan.is_some()) {
        (true, _) => "ok",
        (false, true) => "unreachable: routing on the last plan (fail static)",
        (false, false) => "unreachable: no shared plan yet (routing by the cold tail)",
    };
    let leader_id = i.leader_id.clone();
    let error = i.error.clone();
    let down_for = i.down_since.map(|t| t.elapsed().as_secs_f64());
    drop(i);
    Some(json!({
        "store": "etcd",
        "endpoint": st.cfg.endpoint,
        "prefix": st.cfg.prefix,
        "replica_id": st.cfg.replica_id,
        "up": up,
        "state": state,
        "leader": st.is_leader(),
        "leader_id": leader_id,
        "error": error,
        "down_for_s": down_for,
        "plan": st.plan_json(),
        "plans_refused": st.refused.load(Relaxed),
    }))
}

/// `/admin/plan`'s `shared` part (`None` without `--etcd`).
pub(crate) fn summary(s: &Shared) -> Option<Value> {
    let st = s.plan_store.as_ref()?;
    let mut v = st.plan_json();
    if v.is_null() {
        v = json!({});
    }
    set(&mut v, "this_replica_leads", json!(st.is_leader()));
    set(&mut v, "replica_id", json!(st.cfg.replica_id));
    Some(v)
}

/// The plan store's Prometheus families (none without `--etcd`), written by `/metrics`
/// after the router's own.
pub(crate) fn metrics(s: &Shared) -> Option<[Scalar; 7]> {
    use super::metrics::Kind::{Counter, Gauge};
    use super::metrics::V;
    let st = s.plan_store.as_ref()?;
    let (generation, age) = match &st.inner().plan {
        Some(p) => (p.generation, p.installed.elapsed().as_secs_f64()),
        None => (0, f64::NAN),
    };
    let row = |name, kind, help, value| Scalar {
        name,
        kind,
        help,
        value,
    };
    #[rustfmt::skip]
    let rows = [
        row("cacheroute_plan_store_up", Gauge, "1 while etcd answers; 0: routing on the last plan (fail static).", V::from(st.up.load(Relaxed))),
        row("cacheroute_plan_store_leader", Gauge, "1 while this replica leads (merges the rates and writes the shared plan).", V::from(st.is_leader())),
        row("cacheroute_plan_generation", Gauge, "Generation of the shared plan in force (0: none yet).", V::N(generation)),
        row("cacheroute_plan_age_seconds", Gauge, "Seconds since the shared plan in force was installed (NaN: none yet).", V::X(age)),
        row("cacheroute_plan_store_refused_total", Counter, "Plans read from etcd and refused (not JSON, wrong schema, unknown destinations, oversized).", V::N(st.refused.load(Relaxed))),
        row("cacheroute_plan_store_errors_total", Counter, "etcd calls that failed.", V::N(st.errors.load(Relaxed))),
        row("cacheroute_plan_store_plans_written_total", Counter, "Plans this replica wrote as the leader.", V::N(st.written.load(Relaxed))),
    ];
    Some(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_the_standard_alphabet() {
        assert_eq!(b64(b"/x/plan"), "L3gvcGxhbg==");
        assert_eq!(b64(b"hi"), "aGk=");
        assert_eq!(b64(b"abc"), "YWJj");
        assert_eq!(b64(b""), "");
        for n in 0..300usize {
            let v: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
            assert_eq!(unb64(&b64(&v)).unwrap(), v, "{n} bytes");
        }
        assert!(unb64("a*b").is_err());
    }

    #[test]
    fn the_prefix_range_ends_after_every_key_under_it() {
        assert_eq!(prefix_end(b"/p/rates/"), b"/p/rates0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    fn rec(value: String) -> Kv {
        Kv {
            value: value.into_bytes(),
            create_revision: 1,
            mod_revision: 1,
            lease: 0,
        }
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
