//! The live router: an OpenAI-compatible HTTP reverse proxy in front of N engines (vLLM,
//! SGLang, or `cacheroute emulate`) that routes every request with one of the six policies of
//! [`crate::policy`] — the very objects the simulator runs.
//!
//! Data path (`proxy`): read the body (bounded), derive the routing key (a configurable
//! header, else the body's `user`, else a hash of the prompt's first N characters), ask the
//! policy for a destination over a lock-free [`fleet`] view, forward with hyper's HTTP/1 client
//! (upstream connections kept per client connection) and stream the backend's bytes back unmodified, chunk by chunk. A request that fails before its first byte
//! reached the client is retried once on another destination; connect, first-byte and idle
//! timeouts keep a stalled backend from hanging anything.
//!
//! Around it: active health checks plus passive failure detection (`fleet`), the CacheRoute
//! control loop on its own thread (`control`: per-key rates over a window, plan rebuilt every
//! interval or loaded from a plan file, installed atomically, repaired when a destination goes
//! down), Prometheus `/metrics` (`metrics`) and a bearer-token admin API (`admin`), graceful shutdown that
//! drains in-flight streams, and traffic capture to a trace file (`record`, `--record`).
//!
//! This is a live layer: it may use the pure layers (`policy`, `plan`, `workload`), never the
//! other way round, and nothing here is used by the simulator.

// No panic on input (docs/router.md, "No panic on input"): nothing on a request, discovery or
// control path unwraps, expects, indexes or panics on a value from a request, a backend, a
// file, etcd or Envoy. Each site that cannot fail for another reason says why in an
// `#[allow(…, reason = "…")]`; tests may unwrap (clippy.toml).
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::unreachable,
    clippy::todo,
    clippy::unimplemented
)]

mod admin;
mod backend;
mod config;
mod conn;
mod control;
mod discovery;
pub mod epp;
mod etcd;
mod failure;
mod fleet;
#[cfg(test)]
mod fuzz_driver;
mod health;
mod json;
mod kv_feed;
pub mod kv_map;
mod latency;
mod lifecycle;
mod lock;
mod metrics;
mod proxy;
mod record;
mod settings;
mod state;
mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use config::{EtcdConfig, KvEventsConfig, RecordConfig, RouterConfig, RouterError};
pub use etcd::etcd_put;
pub use fleet::Fleet;
pub use lifecycle::read_backends_file;
use lifecycle::{accept_until, background, bind, open_capture, prepare, stop};
pub use record::RecordSummary;
pub use settings::{PolicySetting, RouterSettings, DEFAULT_LISTEN};

/// A running router. Dropping it does not stop the server; call [`RouterHandle::shutdown`].
pub struct RouterHandle {
    addr: SocketAddr,
    shared: Arc<state::Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    /// Serving worker threads: told to stop accepting (graceful) or to cut (hard).
    workers: Option<Workers>,
    drain_timeout: Duration,
}

struct Workers {
    graceful: tokio::sync::watch::Sender<bool>,
    hard: tokio::sync::watch::Sender<bool>,
}

impl RouterHandle {
    /// The bound address (the real port when the config asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The router's fleet view (up flags and counters), e.g. for tests.
    pub fn fleet(&self) -> &Fleet {
        &self.shared.fleet
    }

    /// The backends in force: (destination slot, base URL), by slot.
    pub fn backends(&self) -> Vec<(usize, String)> {
        self.shared
            .fleet
            .backends()
            .into_iter()
            .map(|(d, u)| (d, u.to_string()))
            .collect()
    }

    /// The recording's counters so far (`None` without `--record`).
    pub fn recording(&self) -> Option<RecordSummary> {
        self.shared.recording().map(|r| r.summary())
    }

    /// Stop accepting connections, let in-flight requests and streams finish (up to the drain
    /// timeout), then stop the health checks and the control loop. Returns whether everything
    /// drained in time.
    pub async fn shutdown(self) -> bool {
        self.shutdown_report().await.drained
    }

    /// [`RouterHandle::shutdown`], also closing the recording: every record held is written,
    /// the file flushed and synced; its final counters are returned.
    pub async fn shutdown_report(mut self) -> ShutdownReport {
        self.shared.begin_drain();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(w) = &self.workers {
            let _ = w.graceful.send(true);
        }
        let drained = match tokio::time::timeout(self.drain_timeout, &mut self.server).await {
            Ok(_) => true,
            Err(_) => {
                if let Some(w) = &self.workers {
                    let _ = w.hard.send(true);
                    // Let the workers drop what they cut, so the recording sees it end.
                    let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.server).await;
                }
                self.server.abort();
                false
            }
        };
        stop(&self.shared);
        ShutdownReport::close(&self.shared, drained)
    }
}

impl ShutdownReport {
    /// The report of a stopped router or EPP: the recording closed (every record held is
    /// written, the file flushed and synced) and its final counters.
    fn close(shared: &state::Shared, drained: bool) -> Self {
        let finished = shared.recorder.as_ref().map(|r| r.finish());
        let recording = finished.filter(|_| shared.cfg.record.is_some());
        ShutdownReport { drained, recording }
    }
}

/// What [`RouterHandle::shutdown_report`] saw.
#[derive(Debug, Clone)]
pub struct ShutdownReport {
    /// Every in-flight request and stream finished within the drain timeout.
    pub drained: bool,
    /// The recording's final counters (`None` without `--record`).
    pub recording: Option<RecordSummary>,
}

/// Bind, start the health checks and (for CacheRoute) the control loop, and serve.
pub async fn start(mut cfg: RouterConfig) -> Result<RouterHandle, RouterError> {
    prepare(&mut cfg).await?;
    let (recorder, window) = open_capture(&cfg)?;
    if cfg.workers > 0 {
        return start_workers(cfg, recorder, window).await;
    }
    let (listener, addr) = bind(cfg.listen).await?;
    let drain_timeout = cfg.drain_timeout;
    let shared = state::Shared::new(cfg, recorder, window)?;
    background(&shared)?;
    let app = proxy::app(shared.clone(), admin::routes());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, shared.clone(), app, async move {
        let _ = rx.await;
    }));
    Ok(RouterHandle {
        addr,
        shared,
        stop: Some(tx),
        server,
        workers: None,
        drain_timeout,
    })
}

/// Serve on `listener` (one task per connection, see [`conn`]) until `stop`, then stop
/// accepting and drain: in-flight requests and streams finish, idle keep-alive connections
/// close.
async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<state::Shared>,
    app: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    accept_until(listener, stop, |a| {
        let Some(held) = shared.admit_connection() else {
            // Past max_connections: say so and close, off the accept loop.
            tokio::spawn(async move {
                let mut tcp = a.tcp;
                let _ = conn::refuse(&mut tcp, 503, "the router has as many client connections open as it may (max_connections); retry shortly").await;
            });
            return;
        };
        let (s, app) = (shared.clone(), app.clone());
        tokio::spawn(async move {
            conn::serve(a.tcp, s, app, a.stopping, a.alive).await;
            drop(held);
        });
    })
    .await
}

/// A `SO_REUSEPORT` listener on `addr` in the current runtime.
fn reuseport_listener(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    sock.set_reuseport(true)?;
    sock.bind(addr)?;
    sock.listen(4096)
}

/// [`start`] with `cfg.workers` serving threads (see [`RouterConfig::workers`]). Health checks
/// and the control loop stay on the caller's runtime.
async fn start_workers(
    cfg: RouterConfig,
    recorder: Option<Arc<record::Recorder>>,
    window: Option<record::Window>,
) -> Result<RouterHandle, RouterError> {
    let n = cfg.workers;
    let listen = cfg.listen;
    let drain_timeout = cfg.drain_timeout;
    let shared = state::Shared::new(cfg, recorder, window)?;
    let app = proxy::app(shared.clone(), admin::routes());
    let (graceful, graceful_rx) = tokio::sync::watch::channel(false);
    let (hard, hard_rx) = tokio::sync::watch::channel(false);
    // The address must be free: a plain bind first, so that another process's SO_REUSEPORT
    // listener on it is an error here rather than a silent share of its traffic (port 0 picks
    // the port the workers then share).
    let addr = std::net::TcpListener::bind(listen)
        .and_then(|probe| probe.local_addr())
        .map_err(|source| RouterError::Bind {
            addr: listen,
            source,
        })?;
    let mut done = Vec::with_capacity(n);
    for w in 0..n {
        let (bound_tx, bound_rx) = std::sync::mpsc::channel::<std::io::Result<SocketAddr>>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let (app, mut graceful_rx, mut hard_rx) =
            (app.clone(), graceful_rx.clone(), hard_rx.clone());
        let worker_shared = shared.clone();
        let at = addr;
        let spawned = std::thread::Builder::new()
            .name(format!("router-worker-{w}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = bound_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match reuseport_listener(at) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = bound_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = bound_tx.send(listener.local_addr());
                    worker_shared.use_worker_upstream();
                    let graceful = async move {
                        let _ = graceful_rx.wait_for(|stop| *stop).await;
                    };
                    tokio::select! {
                        _ = serve(listener, worker_shared, app, graceful) => {}
                        _ = hard_rx.wait_for(|stop| *stop) => {}
                    }
                });
                // Dropping the runtime drops the connections it still serves (after a hard
                // cut): their requests end (and are recorded) before the worker reports done.
                drop(rt);
                let _ = done_tx.send(());
            });
        let bound = match spawned {
            Ok(_) => bound_rx
                .recv()
                .unwrap_or_else(|_| Err(std::io::Error::other("router worker exited"))),
            Err(e) => Err(e),
        };
        match bound {
            Ok(_) => done.push(done_rx),
            Err(source) => {
                let _ = hard.send(true);
                return Err(RouterError::Bind {
                    addr: listen,
                    source,
                });
            }
        }
    }
    if let Err(e) = background(&shared) {
        let _ = hard.send(true);
        return Err(e);
    }
    let server = tokio::spawn(async move {
        for d in done {
            let _ = d.await;
        }
    });
    Ok(RouterHandle {
        addr,
        shared,
        stop: None,
        server,
        workers: Some(Workers { graceful, hard }),
        drain_timeout,
    })
}
