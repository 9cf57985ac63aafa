//! `cacheroute epp`: the router as an Envoy `ext_proc` endpoint picker (`crate::router::epp`),
//! run until Ctrl-C or SIGTERM, then drained. It takes `cacheroute route`'s flags (the same
//! policy, backends, health checks and CacheRoute controller) and prints
//! `listening on grpc://ADDR` once bound. docs/epp.md is the manual; deploy/envoy/epp.yaml
//! the Envoy configuration that calls it.

use super::route::{self, RouteArgs};
use crate::router::{self, RouterConfig, RouterSettings};
use anyhow::{Context, Result};
use std::io::Write;

/// The default `--listen`: the Gateway API Inference Extension's EPP port.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9002";

const EPP_EXAMPLES: &str = "\
Examples:
  # The endpoint picker for three engines, CacheRoute planning online; then Envoy in front:
  cacheroute epp --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 \\
      --backend http://10.0.0.3:8000 --policy cacheroute
  #   envoy -c deploy/envoy/epp.yaml   (listens on :8081, asks the EPP on :9002)

Backends are http://IP:PORT (Envoy connects to the address the EPP names). Logs go to stderr;
`listening on grpc://ADDR` is the one stdout line. See docs/epp.md.";

#[derive(clap::Args, Debug)]
#[command(after_help = EPP_EXAMPLES)]
// `--listen` comes from `route`'s flags; its help names the EPP's own default.
#[command(mut_arg("listen", |a| a.help(format!(
    "Address to listen on; port 0 picks a free port (the bound address is printed) \
     [default: {DEFAULT_LISTEN}]"
))))]
pub struct EppArgs {
    #[command(flatten)]
    pub route: RouteArgs,
}

/// `route`'s configuration, with the EPP's own default listen address below the flags and the
/// config file, and no serving workers.
fn config(a: &EppArgs) -> Result<RouterConfig> {
    if a.route.settings.workers.is_some() {
        anyhow::bail!("--workers applies to `cacheroute route` only; the EPP serves gRPC on one multi-threaded runtime");
    }
    let defaults = RouterSettings {
        listen: Some(DEFAULT_LISTEN.parse().expect("literal address")),
        ..Default::default()
    };
    let mut cfg = route::config_over(&a.route, defaults)?;
    cfg.workers = 0;
    Ok(cfg)
}

pub fn run(a: EppArgs) -> Result<()> {
    if a.route.exit_with_parent {
        super::exit_when_stdin_closes();
    }
    let cfg = config(&a)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        // Signals are caught from before the EPP binds (as `route` does).
        let stop = route::shutdown_signal()?;
        let label = cfg.policy.label();
        let record = cfg.record.clone();
        let handle = router::epp::start(cfg).await?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "listening on grpc://{}", handle.addr())?;
            out.flush()?;
        }
        tracing::info!(
            "picking endpoints for Envoy across {} backends with policy {label}; Ctrl-C or SIGTERM drains and stops",
            handle.fleet().occupied()
        );
        route::log_recording_start(record.as_ref());
        stop.await;
        tracing::info!("draining open ext_proc streams…");
        route::log_stopped(handle.shutdown_report().await);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_help_examples_parse() {
        assert_eq!(route::tests::examples_parse(EPP_EXAMPLES), 1);
    }

    #[test]
    fn the_listen_address_is_the_flag_s_then_the_file_s_then_the_epp_s() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("epp.yaml");
        std::fs::write(&yaml, "policy: sticky\nlisten: 127.0.0.1:7001\n").unwrap();
        let listen = |extra: &[&str]| {
            let mut v = vec!["cacheroute", "epp", "--backend", "http://127.0.0.1:9"];
            v.extend_from_slice(extra);
            let crate::cli::Command::Epp(a) = crate::cli::Cli::try_parse_from(v).unwrap().command
            else {
                unreachable!()
            };
            config(&a).unwrap().listen.to_string()
        };
        let y = yaml.to_str().unwrap();
        assert_eq!(listen(&["--policy", "sticky"]), DEFAULT_LISTEN);
        assert_eq!(listen(&["--config", y]), "127.0.0.1:7001");
        assert_eq!(
            listen(&["--config", y, "--listen", "127.0.0.1:7002"]),
            "127.0.0.1:7002"
        );
    }
}
