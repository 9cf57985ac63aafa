//! The live router: an OpenAI-compatible HTTP reverse proxy in front of N engines (vLLM,
//! SGLang, or `cacheroute emulate`) that routes every request with one of the six policies of
//! [`crate::policy`] — the very objects the simulator runs.
//!
//! Data path (`proxy`): read the body (bounded), derive the routing key (a configurable
//! header, else the body's `user`, else a hash of the prompt's first N characters), ask the
//! policy for a destination over a lock-free [`fleet`] view, forward with hyper's pooled HTTP/1
//! client and stream the backend's bytes back unmodified, chunk by chunk. A request that fails before its first byte
//! reached the client is retried once on another destination; connect, first-byte and idle
//! timeouts keep a stalled backend from hanging anything.
//!
//! Around it: active health checks plus passive failure detection (`fleet`), the CacheRoute
//! control loop on its own thread (`control`: per-key rates over a window, plan rebuilt every
//! interval or loaded from a plan file, installed atomically, repaired when a destination goes
//! down), Prometheus `/metrics` and a bearer-token admin API (`admin`), graceful shutdown that
//! drains in-flight streams.
//!
//! This is a live layer: it may use the pure layers (`policy`, `plan`, `workload`), never the
//! other way round, and nothing here is used by the simulator.

mod admin;
mod conn;
mod control;
mod fleet;
mod proxy;
mod upstream;

use crate::policy::PolicySpec;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use fleet::Fleet;

/// Everything the router needs to start. [`RouterConfig::new`] fills sensible defaults.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Address to listen on (port 0 picks a free port; see [`RouterHandle::addr`]).
    pub listen: SocketAddr,
    /// Backend base URLs, e.g. `http://127.0.0.1:9001` (destination index = position).
    pub backends: Vec<String>,
    /// Routing policy and its parameters (CacheRoute's interval and churn-awareness included).
    pub policy: PolicySpec,
    /// Seed for the policy's RNG and hash rings.
    pub seed: u64,
    /// Header carrying the routing key (checked before the body's `user`).
    pub key_header: String,
    /// Without a header or `user`, the key is a hash of the prompt's first this many characters.
    pub prefix_chars: usize,
    /// Tokens (words) per block when hashing prompt text into prefix blocks.
    pub block_tokens: u32,
    /// Active health check period and per-probe timeout (`GET {backend}/health`).
    pub health_interval: Duration,
    pub health_timeout: Duration,
    /// TCP connect timeout to a backend.
    pub connect_timeout: Duration,
    /// From sending a request to its first body byte (prefill included).
    pub first_byte_timeout: Duration,
    /// Longest silence between two body chunks once streaming.
    pub idle_timeout: Duration,
    /// Bearer token for `/admin/*`; `None` disables the admin API.
    pub admin_token: Option<String>,
    /// CacheRoute: install this plan (a `cacheroute plan --out` JSON) instead of planning online.
    pub plan_file: Option<PathBuf>,
    /// CacheRoute: install this plan at start, then keep planning online from measured rates
    /// (a warm start from a previous period's plan, or the state file a previous run wrote:
    /// then its measured rates seed the rate meter too).
    pub initial_plan: Option<PathBuf>,
    /// CacheRoute: at shutdown, write the installed plan and the last measured per-key rates
    /// here (JSON; what `initial_plan` reads), so a restart does not begin cold.
    pub state_file: Option<PathBuf>,
    /// Largest request body accepted (bytes); larger bodies get 413.
    pub max_body_bytes: usize,
    /// How long shutdown waits for in-flight requests and streams before cutting them.
    pub drain_timeout: Duration,
    /// Serving threads. 0: serve on the caller's tokio runtime. N ≥ 1: N threads, each with
    /// its own single-threaded runtime, its own `SO_REUSEPORT` listener on the address and its
    /// own upstream connection pool, so a request is accepted, routed, forwarded and streamed
    /// back without waking another thread (nginx's worker model; `cacheroute route` uses one
    /// per core).
    pub workers: usize,
}

impl RouterConfig {
    /// Defaults for everything but the listen address, backends and policy.
    pub fn new(listen: SocketAddr, backends: Vec<String>, policy: PolicySpec) -> Self {
        Self {
            listen,
            backends,
            policy,
            seed: 0x5eed,
            key_header: "x-cacheroute-key".into(),
            prefix_chars: 256,
            block_tokens: 16,
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(120),
            idle_timeout: Duration::from_secs(60),
            admin_token: None,
            plan_file: None,
            initial_plan: None,
            state_file: None,
            max_body_bytes: 4 << 20,
            drain_timeout: Duration::from_secs(30),
            workers: 0,
        }
    }

    /// Every problem with the configuration, one per line, each naming its field.
    pub fn validate(&self) -> Result<(), RouterError> {
        let mut errs = Vec::new();
        if self.backends.is_empty() {
            errs.push(
                "backends: at least one backend URL is needed (`--backend http://host:port`)"
                    .to_string(),
            );
        }
        if self.backends.len() > u16::MAX as usize {
            errs.push(format!("backends: at most {} backends", u16::MAX));
        }
        for (i, b) in self.backends.iter().enumerate() {
            match reqwest::Url::parse(b) {
                Ok(u) if u.scheme() == "http" && u.host().is_some() => {}
                Ok(_) => errs.push(format!(
                    "backends[{i}]: `{b}` must be a plain http:// URL with a host (engines serve plain HTTP)"
                )),
                Err(e) => errs.push(format!("backends[{i}]: `{b}` is not a URL ({e})")),
            }
        }
        if axum::http::HeaderName::from_bytes(self.key_header.as_bytes()).is_err() {
            errs.push(format!(
                "key_header: `{}` is not a valid HTTP header name",
                self.key_header
            ));
        }
        if self.prefix_chars == 0 {
            errs.push("prefix_chars: must be ≥ 1".into());
        }
        if self.block_tokens == 0 {
            errs.push("block_tokens: must be ≥ 1".into());
        }
        for (name, d) in [
            ("health_interval", self.health_interval),
            ("health_timeout", self.health_timeout),
            ("connect_timeout", self.connect_timeout),
            ("first_byte_timeout", self.first_byte_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if d.is_zero() {
                errs.push(format!("{name}: must be > 0"));
            }
        }
        if self.max_body_bytes == 0 {
            errs.push("max_body_bytes: must be ≥ 1".into());
        }
        if matches!(&self.admin_token, Some(t) if t.is_empty()) {
            errs.push(
                "admin_token: empty; pass a non-empty token or none to disable the admin API"
                    .into(),
            );
        }
        if let PolicySpec::Cacheroute(c) = &self.policy {
            if !(c.interval_s.is_finite() && c.interval_s > 0.0) {
                errs.push("policy.interval_s: must be > 0 seconds".into());
            }
        } else if self.plan_file.is_some()
            || self.initial_plan.is_some()
            || self.state_file.is_some()
        {
            errs.push(format!(
                "plan_file: only the cacheroute policy uses a plan, but the policy is `{}`",
                self.policy.label()
            ));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(RouterError::Config(errs.join("\n")))
        }
    }
}

/// Why the router could not start (or reload).
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid router configuration:\n{0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}; pick a free port or use port 0")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("plan file {path}: {msg}")]
    PlanFile { path: String, msg: String },
    #[error("building the HTTP client: {0}")]
    Client(String),
}

/// A running router. Dropping it does not stop the server; call [`RouterHandle::shutdown`].
pub struct RouterHandle {
    addr: SocketAddr,
    shared: Arc<proxy::Shared>,
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

    /// Stop accepting connections, let in-flight requests and streams finish (up to the drain
    /// timeout), then stop the health checks and the control loop. Returns whether everything
    /// drained in time.
    pub async fn shutdown(mut self) -> bool {
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
                }
                self.server.abort();
                false
            }
        };
        self.shared.stop_background();
        if let Some(path) = &self.shared.cfg.state_file {
            if let Err(e) = control::save_state(&self.shared, path) {
                eprintln!("warning: router state not saved to {}: {e}", path.display());
            }
        }
        drained
    }
}

/// Bind, start the health checks and (for CacheRoute) the control loop, and serve.
pub async fn start(cfg: RouterConfig) -> Result<RouterHandle, RouterError> {
    cfg.validate()?;
    if cfg.workers > 0 {
        return start_workers(cfg).await;
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| RouterError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| RouterError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let drain_timeout = cfg.drain_timeout;
    let shared = proxy::Shared::new(cfg)?;
    control::spawn(&shared)?;
    fleet::spawn_health_checks(&shared);
    let app = proxy::app(shared.clone());
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

/// Serve on `listener` (TCP_NODELAY on every connection, one task per connection, see
/// [`conn`]) until `stop`, then stop accepting and drain: in-flight requests and streams finish,
/// idle keep-alive connections close.
async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<proxy::Shared>,
    app: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (stopping, stop_rx) = tokio::sync::watch::channel(false);
    // Every connection holds a sender; `recv` ends when the last one is gone.
    let (alive, mut all_gone) = tokio::sync::mpsc::channel::<()>(1);
    let mut stop = std::pin::pin!(stop);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(_) => {
                    // Out of file descriptors or a connection reset before accept: back off
                    // briefly rather than spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = tcp.set_nodelay(true);
        tokio::spawn(conn::serve(
            tcp,
            shared.clone(),
            app.clone(),
            stop_rx.clone(),
            alive.clone(),
        ));
    }
    drop(listener);
    let _ = stopping.send(true);
    drop(alive);
    let _ = all_gone.recv().await;
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
async fn start_workers(cfg: RouterConfig) -> Result<RouterHandle, RouterError> {
    let n = cfg.workers;
    let listen = cfg.listen;
    let drain_timeout = cfg.drain_timeout;
    let shared = proxy::Shared::new(cfg)?;
    let app = proxy::app(shared.clone());
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
    if let Err(e) = control::spawn(&shared) {
        let _ = hard.send(true);
        return Err(e);
    }
    fleet::spawn_health_checks(&shared);
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
