//! `cacheroute peer`: start an external router (see [`crate::peer`]) in front of engines, exactly
//! as a study does, until Ctrl-C or SIGTERM. The first line on stdout is `listening on
//! http://ADDR`, then its version and command line. For benchmarks
//! (`benches/router_vs_nginx.sh`) and for trying a peer by hand.

use crate::peer::{ExternalSpec, Router};
use anyhow::{bail, Result};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  # SMG's cache-aware policy in front of two engines (install it first:
  # bash scripts/install-peers.sh smg); prints `listening on http://…`, stops on Ctrl-C
  cacheroute peer --router smg --policy cache_aware \\
      --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002
  # Envoy hashing on the x-cacheroute-key header, config and log kept in ./envoy
  cacheroute peer --router envoy --policy ring_hash --worker http://127.0.0.1:8001 --dir envoy")]
pub struct PeerArgs {
    /// smg, vllm-router, sglang-router, envoy or nginx.
    #[arg(long)]
    pub router: String,
    /// One of the router's policies (docs/peers.md).
    #[arg(long)]
    pub policy: String,
    /// An engine base URL (repeat per engine).
    #[arg(long = "worker", required = true)]
    pub workers: Vec<String>,
    /// Run this executable instead of the installed one.
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// Directory for its config and log (default: a temporary one, removed at exit).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

pub fn run(a: PeerArgs) -> Result<()> {
    let Some(router) = Router::ALL.into_iter().find(|r| r.name() == a.router) else {
        bail!(
            "--router: unknown router `{}`; choose one of {}",
            a.router,
            Router::ALL.map(|r| r.name()).join(", ")
        );
    };
    let spec = ExternalSpec {
        router,
        policy: a.policy,
        binary: a.binary,
    };
    if let Some(p) = spec.problems().first() {
        bail!("--{p}");
    }
    let tmp = tempfile::tempdir()?;
    let dir = a.dir.unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir)?;
    // SAFETY: handlers that only store to an atomic (async-signal-safe).
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    let mut peer =
        match crate::peer::start(&spec, &a.workers, &dir, crate::peer::START_TIMEOUT, &[]) {
            Ok(p) => p,
            Err(e) => {
                let tail = e.log_tail().trim_end().replace('\n', " | ");
                bail!(
                    "{}: {e}{}",
                    spec.label(),
                    if tail.is_empty() {
                        String::new()
                    } else {
                        format!("; log: {tail}")
                    }
                )
            }
        };
    let mut out = std::io::stdout();
    writeln!(out, "listening on {}", peer.url)?;
    writeln!(
        out,
        "{} ({}): {}",
        peer.what, peer.version, peer.command_line
    )?;
    out.flush()?;
    while !STOP.load(Ordering::Relaxed) {
        if let Some(why) = peer.exited() {
            bail!(
                "{}: {why}; log: {}",
                peer.what,
                peer.log_tail(5).trim_end().replace('\n', " | ")
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}
