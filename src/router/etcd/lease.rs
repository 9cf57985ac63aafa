//! A replica's standing in the store: its lease (renewed, or a new one when it is gone), the
//! leader role (a transaction that creates the leader key only where none exists), whether
//! etcd answers, and the shared plan in force as the store last said it (generation, revision,
//! leader); and the watch that reads the plan key. Mechanism only: what a plan means is the
//! control thread's (`router::control`), what is shown the endpoints'.

use super::client::{Client, Kv};
use crate::router::config::EtcdConfig;
use crate::router::lock::Locked;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a replica that does not lead tries to (and the leader checks that it still does).
const CAMPAIGN: Duration = Duration::from_millis(500);
/// Wait before a failed watch is opened again.
const RETRY: Duration = Duration::from_millis(500);

/// The shared plan in force: its generation, the etcd revision it was written at, its leader.
#[derive(Debug, Clone)]
pub(crate) struct PlanMeta {
    pub generation: u64,
    pub revision: i64,
    pub leader: String,
    pub installed: Instant,
}

#[derive(Default)]
pub(super) struct Inner {
    pub error: Option<String>,
    pub down_since: Option<Instant>,
    pub leader_id: Option<String>,
    pub plan: Option<PlanMeta>,
    refused_revision: i64,
}

/// The replica's view of the store, shared by its etcd threads and its endpoints.
pub(crate) struct Status {
    pub cfg: EtcdConfig,
    pub(super) up: AtomicBool,
    pub(super) leader: AtomicBool,
    pub(super) lease: AtomicI64,
    /// The leader key's create revision while this replica holds it.
    pub(super) led_at: AtomicI64,
    pub(super) refused: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) written: AtomicU64,
    pub(super) stopped: AtomicBool,
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

    pub(crate) fn key(&self, what: &str) -> String {
        format!("{}/{what}", self.cfg.prefix)
    }

    pub(super) fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    pub(crate) fn ok(&self) {
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

    pub(crate) fn failed(&self, e: String) {
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

    pub(crate) fn down_for(&self) -> Duration {
        self.inner()
            .down_since
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    pub fn is_leader(&self) -> bool {
        self.leader.load(Relaxed)
    }

    pub(crate) fn lead(&self, created: i64) {
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

    pub(crate) fn lost_lead(&self, why: &str) {
        if self.leader.swap(false, Relaxed) {
            tracing::warn!(replica = %self.cfg.replica_id, "no longer the leader: {why}");
        }
    }

    pub(crate) fn generation(&self) -> u64 {
        self.inner().plan.as_ref().map_or(0, |p| p.generation)
    }

    /// Whether the plan in force was written at `revision`.
    pub(crate) fn in_force(&self, revision: i64) -> bool {
        self.inner()
            .plan
            .as_ref()
            .is_some_and(|p| p.revision == revision)
    }

    /// Whether a plan written at `revision` is newer than the one in force.
    pub(crate) fn newer(&self, revision: i64) -> bool {
        self.inner()
            .plan
            .as_ref()
            .is_none_or(|p| revision > p.revision)
    }

    /// etcd's revision now: one below the plan in force's means a new store (its data lost or
    /// replaced), whose revisions start over; the plan in force is then kept but no longer
    /// blocks the new store's plans.
    pub(crate) fn store_revision(&self, revision: i64) {
        let mut i = self.inner();
        if let Some(p) = i.plan.as_mut().filter(|p| revision < p.revision) {
            tracing::warn!(
                "etcd's revision {revision} is below the plan in force's {}: a new store; its plans are taken from now on",
                p.revision
            );
            p.revision = 0;
        }
    }

    pub(crate) fn installed(&self, meta: PlanMeta) {
        self.inner().plan = Some(meta);
    }

    pub(crate) fn refuse(&self, revision: i64, why: &str) {
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

    pub(crate) fn plan_json(&self) -> Value {
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

/// The lease and the leader role: renew the lease every third of its TTL (a new one when it
/// is gone), and every [`CAMPAIGN`] (or third of the TTL, if shorter) either check that the
/// leader key is still this replica's or, while another holds it, try to create it: a
/// leader's key is gone a TTL after its last renewal, and another replica holds it at most
/// one look later.
pub(super) fn keep(st: Arc<Status>, etcd: Client) {
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
/// failure, again after [`RETRY`]. Each value read goes to `deliver` with its revision.
pub(super) fn watch(st: Arc<Status>, etcd: Client, deliver: impl Fn(&[u8], i64)) {
    let key = st.key("plan");
    // Each value is given, also one a newer plan already superseded (the leader installs its
    // own at once, maybe before its watch sees what was written just before): a bad record is
    // refused and said so whenever it is read. The plan in force itself is not given twice.
    let deliver = |kv: Kv| {
        if !st.in_force(kv.mod_revision) {
            deliver(&kv.value, kv.mod_revision);
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
