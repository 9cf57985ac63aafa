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
//! and the control thread plans from them with the one controller and writes the plan. Every
//! replica watches `P/plan` and installs what it reads once checked ([`codec::decode`]); a
//! plan that fails the check is refused with a log line and the plan in force kept. A replica
//! installs the stored plan before it serves, and routes on its last plan while etcd cannot be
//! reached (fail static), saying so in `/health` and `/metrics`.
//!
//! This module is the mechanism: [`client`] (the gateway), [`lease`] (lease, leader role,
//! watch, what the replica knows of the store), [`codec`] (the records) and here the
//! [`Sharer`] the control thread calls. It knows nothing of the controller, the installed plan
//! or the metrics: the control thread (`router::control`) is the one owner of those.
//!
//! etcd is spoken to through its v3 JSON gateway (HTTP/1.1, base64 keys and values) with the
//! HTTP client the router already has, on three threads of its own (lease and leadership,
//! watch, and the control thread's writes), never on the request path.

pub(crate) mod client;
pub(crate) mod codec;
pub(crate) mod lease;

use crate::analysis::record::Resolved;
use crate::plan::{KeyLoad, Plan};
pub use client::etcd_put;
use client::{Client, Kv, CALL_TIMEOUT};
use codec::{encode, merge, rates_record, MAX_PLAN_BYTES};
use lease::{PlanMeta, Status};
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The control thread's side of the sharing (its own client), made by [`start`].
pub(crate) struct Sharer {
    st: Arc<Status>,
    etcd: Client,
}

/// Start sharing: read the stored plan record (the caller checks and installs it before the
/// replica serves), then start the lease-and-leadership thread and the watch, which gives
/// every plan record it reads to `deliver` (bytes, revision). Runs on a plain thread (the
/// blocking client must not be made on an async runtime). etcd unreachable is not an error:
/// the replica starts without a plan and takes one when etcd answers.
pub(crate) fn start(
    st: Arc<Status>,
    deliver: impl Fn(&[u8], i64) + Send + 'static,
) -> Result<(Sharer, Option<Kv>), String> {
    let etcd = Client::new(&st.cfg.endpoint, Some(CALL_TIMEOUT))?;
    let first = match etcd.get(&st.key("plan")) {
        Ok((kv, _)) => {
            st.ok();
            kv
        }
        Err(e) => {
            st.failed(e);
            None
        }
    };
    let keeper = (
        st.clone(),
        Client::new(&st.cfg.endpoint, Some(CALL_TIMEOUT))?,
    );
    std::thread::Builder::new()
        .name("cacheroute-etcd-lease".into())
        .spawn(move || lease::keep(keeper.0, keeper.1))
        .map_err(|e| format!("starting the etcd lease thread: {e}"))?;
    let watcher = (
        st.clone(),
        Client::new(&st.cfg.endpoint, Some(Duration::from_secs(300)))?,
    );
    std::thread::Builder::new()
        .name("cacheroute-etcd-watch".into())
        .spawn(move || lease::watch(watcher.0, watcher.1, deliver))
        .map_err(|e| format!("starting the etcd watch thread: {e}"))?;
    Ok((Sharer { st, etcd }, first))
}

impl Sharer {
    /// Publish this replica's rates (`local`) under its lease. When it leads, every replica's
    /// rates summed per key, to plan from; `None` when it does not lead (or etcd failed).
    pub fn exchange(&self, local: &[KeyLoad]) -> Option<Vec<KeyLoad>> {
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
        match self.etcd.get_prefix(&st.key("rates/")) {
            Ok(kvs) => Some(merge(&kvs)),
            Err(e) => {
                st.failed(e);
                None
            }
        }
    }

    /// Write plan `p` built with `settings` as the next generation, while this replica still
    /// holds the leader key (`urls`: the destinations by URL, a vacant slot `None`). What the
    /// store said of it, once written.
    pub fn write(&self, p: &Plan, urls: &[Option<String>], settings: Resolved) -> Option<PlanMeta> {
        let st = &self.st;
        let me = &st.cfg.replica_id;
        let generation = st.generation() + 1;
        let text = encode(p, urls, me, generation, settings);
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
                Some(PlanMeta {
                    generation,
                    revision,
                    leader: me.clone(),
                    installed: Instant::now(),
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

/// What a replica knows of the store at one moment, for `/metrics`.
pub(crate) struct StoreView {
    pub up: bool,
    pub leader: bool,
    /// The shared plan in force (0: none yet).
    pub generation: u64,
    /// Seconds since it was installed (NaN: none yet).
    pub age_s: f64,
    pub refused: u64,
    pub errors: u64,
    pub written: u64,
}

impl Status {
    pub(crate) fn view(&self) -> StoreView {
        let (generation, age_s) = match &self.inner().plan {
            Some(p) => (p.generation, p.installed.elapsed().as_secs_f64()),
            None => (0, f64::NAN),
        };
        StoreView {
            up: self.up.load(Relaxed),
            leader: self.is_leader(),
            generation,
            age_s,
            refused: self.refused.load(Relaxed),
            errors: self.errors.load(Relaxed),
            written: self.written.load(Relaxed),
        }
    }

    /// `/health`'s `plan_store` details.
    pub(crate) fn health(&self) -> Value {
        let i = self.inner();
        let up = self.up.load(Relaxed);
        let state = match (up, i.plan.is_some()) {
            (true, _) => "ok",
            (false, true) => "unreachable: routing on the last plan (fail static)",
            (false, false) => "unreachable: no shared plan yet (routing by the cold tail)",
        };
        let leader_id = i.leader_id.clone();
        let error = i.error.clone();
        let down_for = i.down_since.map(|t| t.elapsed().as_secs_f64());
        drop(i);
        json!({
            "store": "etcd",
            "endpoint": self.cfg.endpoint,
            "prefix": self.cfg.prefix,
            "replica_id": self.cfg.replica_id,
            "up": up,
            "state": state,
            "leader": self.is_leader(),
            "leader_id": leader_id,
            "error": error,
            "down_for_s": down_for,
            "plan": self.plan_json(),
            "plans_refused": self.refused.load(Relaxed),
        })
    }

    /// `/admin/plan`'s `shared` part.
    pub(crate) fn summary(&self) -> Value {
        let mut v = self.plan_json();
        if v.is_null() {
            v = json!({});
        }
        crate::router::json::set(&mut v, "this_replica_leads", json!(self.is_leader()));
        crate::router::json::set(&mut v, "replica_id", json!(self.cfg.replica_id));
        v
    }
}
