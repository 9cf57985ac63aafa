//! Provisioning over SSH: start a study's replicas on their hosts (each in its own session with
//! a PID file and a log in the host's scratch directory), wait until each answers `/health` and
//! one tiny generation, report their URLs; tear them down by process group — after an error
//! while starting, and later with `fleet down` even when the controller that started them was
//! killed (everything needed is in the PID files on the hosts).

use super::inventory::{place, Inventory, Placement};
use super::launch::{self, LaunchSpec};
use super::ssh::{preflight, Remote, SshError};
use std::time::{Duration, Instant};

/// A replica that is up.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    pub placement: Placement,
    pub host: String,
    pub url: String,
}

/// Errors while provisioning.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    #[error(transparent)]
    Ssh(#[from] SshError),
    #[error("{0}")]
    Placement(String),
    #[error("host {host}: replica {replica} on port {port} did not become healthy within {secs} s; last log lines: {log}; check the engine's install and model on that host")]
    NotHealthy {
        host: String,
        replica: usize,
        port: u16,
        secs: u64,
        log: String,
    },
}

fn tail_log(r: &Remote, replica: usize) -> String {
    let scratch = launch::sh_quote(&r.host.scratch.display().to_string());
    r.run_text(&format!(
        "tail -n 5 {scratch}/replica-{replica}.log 2>/dev/null || true"
    ))
    .map(|t| {
        t.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" | ")
    })
    .unwrap_or_default()
}

/// Whether `url` answers `/health` and a one-token completion.
pub fn ready(client: &reqwest::blocking::Client, url: &str) -> bool {
    let ok = client
        .get(format!("{url}/health"))
        .send()
        .map(|r| r.status().is_success())
        .unwrap_or(false);
    if !ok {
        return false;
    }
    let body = format!(
        r#"{{"model":"{}","prompt":"ready","max_tokens":1}}"#,
        launch::SERVED_MODEL_NAME
    );
    client
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .map(|r| r.status().is_success())
        .unwrap_or(false)
}

/// Start `fleet.replicas` replicas on the inventory's hosts and wait until every one is ready.
/// On any failure everything already started is stopped before the error is returned.
pub fn up(
    inv: &Inventory,
    fleet: &LaunchSpec,
    ready_timeout: Duration,
) -> Result<Vec<Replica>, ProvisionError> {
    let placements = place(inv, fleet.replicas, fleet.tp).map_err(ProvisionError::Placement)?;
    let remotes: Vec<Remote> = inv.hosts.iter().map(|h| Remote::new(inv, h)).collect();
    for (i, r) in remotes.iter().enumerate() {
        let ports: Vec<u16> = placements
            .iter()
            .filter(|p| p.host == i)
            .map(|p| p.port)
            .collect();
        if !ports.is_empty() {
            preflight(r, &ports)?;
        }
    }
    let mut started: Vec<Replica> = Vec::new();
    let result = (|| {
        for p in &placements {
            let r = &remotes[p.host];
            r.run(&launch::start_line(
                fleet,
                p,
                &r.host.engine,
                &r.host.scratch,
            ))?;
            started.push(Replica {
                placement: p.clone(),
                host: r.host.name.clone(),
                url: format!("http://{}:{}", r.host.address, p.port),
            });
            tracing::info!(host = %r.host.name, replica = p.replica, port = p.port, "replica started");
        }
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("http client");
        let t0 = Instant::now();
        let mut pending: Vec<&Replica> = started.iter().collect();
        while !pending.is_empty() {
            pending.retain(|rep| {
                let ok = ready(&client, &rep.url);
                if ok {
                    tracing::info!(host = %rep.host, replica = rep.placement.replica, url = %rep.url, "replica ready");
                }
                !ok
            });
            if pending.is_empty() {
                break;
            }
            if t0.elapsed() > ready_timeout {
                let rep = pending[0];
                let r = &remotes[rep.placement.host];
                return Err(ProvisionError::NotHealthy {
                    host: rep.host.clone(),
                    replica: rep.placement.replica,
                    port: rep.placement.port,
                    secs: ready_timeout.as_secs(),
                    log: tail_log(r, rep.placement.replica),
                });
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(started),
        Err(e) => {
            let _ = down(inv, Duration::from_secs(5));
            Err(e)
        }
    }
}

/// One running replica found on a host.
#[derive(Debug, Clone, PartialEq)]
pub struct Running {
    pub host: String,
    pub replica: usize,
    pub pid: u32,
    pub alive: bool,
}

/// Replicas recorded in the hosts' PID files, and whether their process groups are alive.
pub fn status(inv: &Inventory) -> Result<Vec<Running>, ProvisionError> {
    let mut out = Vec::new();
    for h in &inv.hosts {
        out.extend(host_status(inv, h)?);
    }
    Ok(out)
}

/// The replicas recorded on one host.
fn host_status(
    inv: &Inventory,
    h: &super::inventory::Host,
) -> Result<Vec<Running>, ProvisionError> {
    let r = Remote::new(inv, h);
    let scratch = launch::sh_quote(&h.scratch.display().to_string());
    let text = r.run_text(&format!(
        "for f in {scratch}/replica-*.pid; do [ -e \"$f\" ] || continue; p=$(cat \"$f\"); n=${{f##*/replica-}}; n=${{n%.pid}}; if kill -0 -- -$p 2>/dev/null; then a=1; else a=0; fi; echo $n $p $a; done; true"
    ))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [n, p, a] = f[..] {
            if let (Ok(replica), Ok(pid)) = (n.parse(), p.parse()) {
                out.push(Running {
                    host: h.name.clone(),
                    replica,
                    pid,
                    alive: a == "1",
                });
            }
        }
    }
    Ok(out)
}

/// Stop every replica recorded on the inventory's hosts (SIGTERM to its process group, SIGKILL
/// after `grace`), then check that none is left. A host that cannot be reached does not stop
/// the others: every reachable host is cleaned, then the first failure is returned. Returns
/// how many were stopped.
pub fn down(inv: &Inventory, grace: Duration) -> Result<usize, ProvisionError> {
    let mut stopped = 0;
    let mut first_err: Option<ProvisionError> = None;
    for h in &inv.hosts {
        match down_host(inv, h, grace) {
            Ok(n) => stopped += n,
            Err(e) => {
                tracing::warn!(host = %h.name, "teardown failed: {e}");
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(stopped),
    }
}

/// Stop the replicas recorded on one host and check none is left there.
fn down_host(
    inv: &Inventory,
    h: &super::inventory::Host,
    grace: Duration,
) -> Result<usize, ProvisionError> {
    let mine = host_status(inv, h)?;
    if mine.is_empty() {
        return Ok(0);
    }
    let cmd = mine
        .iter()
        .map(|x| launch::stop_line(x.replica, &h.scratch, grace.as_secs().max(1) as u32))
        .collect::<Vec<_>>()
        .join("; ");
    Remote::new(inv, h).run(&cmd)?;
    for x in &mine {
        tracing::info!(host = %h.name, replica = x.replica, pgid = x.pid, "replica torn down");
    }
    if let Some(x) = host_status(inv, h)?.iter().find(|x| x.alive) {
        return Err(ProvisionError::Ssh(SshError::Preflight {
            host: x.host.clone(),
            detail: format!(
                "replica {} (process group {}) is still running after teardown; kill it by hand",
                x.replica, x.pid
            ),
        }));
    }
    Ok(mine.len())
}
